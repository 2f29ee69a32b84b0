"""`raydist plan --calibrate`: measure this machine's alpha, beta, matmul peak and memory bandwidth.

Runs `world_size` gloo processes (raydist.runtime.spawn) at once, the way training will: every rank
times a square fp32 matmul (raydist.metrics.flops.measure_cpu_matmul_peak) and a large copy while the
others do the same, so the peak is what one rank gets when the cores are shared. Then rank 0 times
all-reduce and all-gather over a range of message sizes and fits seed 003's model by least squares:

    t(all-reduce, n bytes) = alpha * log2(p) + 2 (p-1)/p * n / beta
    t(all-gather, n bytes) = alpha * log2(p) +   (p-1)/p * n / beta

The result goes to $RAYDIST_CACHE/calibration.json (default ~/.cache/raydist/), which `raydist plan
--device cpu` reads. On a Ray cluster the same function would run inside the cluster's workers (one per
device, NCCL, and separate intra- and inter-node fits from groups placed inside / across nodes); this
checkout runs it with local processes only.
"""

from __future__ import annotations

import math
import platform
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from raydist.planner.hardware import save_calibration, workload_signature
from raydist.runtime import spawn

SIZES_BYTES = (4 * 2**10, 64 * 2**10, 512 * 2**10, 2 * 2**20, 8 * 2**20)


def _time_collective(fn, tensor_bytes: int, reps: int) -> float:
    times = []
    for i in range(reps + 2):
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        if i >= 2:
            times.append(elapsed)
    # the slowest rank finishes the collective: take the max across ranks of the median
    value = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def memory_bandwidth_bytes_per_s(num_bytes: int = 64 * 2**20, min_time_s: float = 0.3) -> float:
    """Read + write bandwidth of a large tensor copy on this process's threads."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_time_s:
        dst.copy_(src)
        reps += 1
    return 2 * num_bytes * reps / (time.perf_counter() - start)


def _time_model(model_cfg: dict, seq_len: int, micro_batch: int, policy: str, min_time_s: float = 0.6) -> float:
    """Seconds for one forward + backward of the workload's model on `micro_batch` samples."""
    from raydist.config import ModelConfig
    from raydist.models.gpt import build_model, cross_entropy
    from raydist.parallel.checkpointing import apply_activation_checkpointing

    cfg = ModelConfig(**model_cfg)
    model = build_model(cfg, seq_len, 0)
    apply_activation_checkpointing(model, policy)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len + 1))

    def once():
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()

    once()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < min_time_s or len(times) < 3:
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _calibrate_workload(spec: dict) -> dict:
    """Time the workload's forward+backward at two micro-batch sizes without recompute (a line: fixed
    overhead + FLOPs / rate) and at the larger size with each recompute policy."""
    from raydist.config import ModelConfig
    from raydist.models.gpt import flops_per_token

    small, large = spec["micro_batches"]
    fpt = flops_per_token(ModelConfig(**spec["model"]), spec["seq_len"])
    t_small = _time_model(spec["model"], spec["seq_len"], small, "none")
    t_large = _time_model(spec["model"], spec["seq_len"], large, "none")
    flops_small, flops_large = fpt * small * spec["seq_len"], fpt * large * spec["seq_len"]
    rate = (flops_large - flops_small) / max(t_large - t_small, 1e-9)
    overhead = max(0.0, t_small - flops_small / rate)
    factors = {}
    for policy in spec["policies"]:
        factors[policy] = _time_model(spec["model"], spec["seq_len"], large, policy) / t_large - 1.0
    return {"rate_flops": rate, "overhead_s": overhead, "recompute_factors": factors,
            "t_small_s": t_small, "t_large_s": t_large}


def _calibrate_rank(reps: int, matmul_size: int, workload: dict | None = None) -> dict:
    from raydist.metrics.flops import measure_cpu_matmul_peak

    world = dist.get_world_size()
    dist.barrier()
    peak = measure_cpu_matmul_peak(size=matmul_size, min_time_s=0.5)
    dist.barrier()
    bandwidth = memory_bandwidth_bytes_per_s()
    dist.barrier()
    samples = []
    for n_bytes in SIZES_BYTES:
        numel = n_bytes // 4
        x = torch.ones(numel)
        t_ar = _time_collective(lambda: dist.all_reduce(x), n_bytes, reps)
        shard = torch.ones(max(1, numel // world))
        out = torch.empty(shard.numel() * world)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        t_ag = _time_collective(lambda: gather(out, shard), out.numel() * 4, reps)
        samples.append({"bytes": n_bytes, "all_reduce_s": t_ar, "all_gather_s": t_ag})
    stats = torch.tensor([peak, bandwidth], dtype=torch.float64)
    dist.all_reduce(stats)
    stats /= world
    out = {"matmul_peak_flops": float(stats[0]), "memory_bandwidth_bytes_per_s": float(stats[1]),
           "samples": samples}
    if workload is not None:
        dist.barrier()
        out["workload"] = _calibrate_workload(workload)
    return out


def fit_alpha_beta(samples: list[dict], world_size: int) -> tuple[float, float]:
    """Least squares of both collectives' times on [log2 p, factor * n]: (alpha_s, beta_bytes_per_s)."""
    p = world_size
    rows, times = [], []
    for s in samples:
        rows.append([math.log2(p), 2 * (p - 1) / p * s["bytes"]])
        times.append(s["all_reduce_s"])
        rows.append([math.log2(p), (p - 1) / p * s["bytes"]])
        times.append(s["all_gather_s"])
    (alpha, inv_beta), *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
    alpha = max(float(alpha), 1e-7)
    inv_beta = max(float(inv_beta), 1e-13)
    return alpha, 1.0 / inv_beta


def calibrate(world_size: int, reps: int = 10, matmul_size: int = 512, save: bool = True,
              threads: int = 1, config=None) -> dict:
    """Measure with `world_size` local gloo processes, `threads` torch threads each; store and return.

    With a `config` (raydist.config.Config), also time that model's forward+backward on every rank at
    once (micro-batch 1 and the config's micro_batch, and each recompute policy) so that plans for that
    workload use its measured compute rate, per-micro-batch overhead and recompute cost instead of the
    matmul peak and the analytic one-extra-forward."""
    if world_size < 2:
        world_size = 2  # a collective needs two ranks; the peak is still per rank
    workload = None
    if config is not None:
        import dataclasses

        large = max(2, config.train.micro_batch)
        workload = {"model": dataclasses.asdict(config.model), "seq_len": config.data.seq_len,
                    "micro_batches": (1, large), "policies": ("selective", "full", "every_k")}
    results = spawn(_calibrate_rank, world_size, reps, matmul_size, workload, threads=threads)
    r0 = results[0]
    alpha, beta = fit_alpha_beta(r0["samples"], world_size)
    record = {
        "device": "cpu",
        "world_size": world_size,
        "threads_per_rank": threads,
        "host": platform.node(),
        "matmul_size": matmul_size,
        "matmul_peak_flops": r0["matmul_peak_flops"],
        "memory_bandwidth_bytes_per_s": r0["memory_bandwidth_bytes_per_s"],
        "alpha_s": alpha,
        "beta_bytes_per_s": beta,
        "samples": r0["samples"],
        "note": "local gloo processes on one host (intra = inter); on a Ray cluster run per node pair",
    }
    if workload is not None:
        per_rank = [r["workload"] for r in results]
        rate = statistics.median(w["rate_flops"] for w in per_rank)
        record["workloads"] = {workload_signature(workload["model"], workload["seq_len"]): {
            "compute_efficiency": min(1.0, rate / record["matmul_peak_flops"]),
            "block_overhead_s": statistics.median(w["overhead_s"] for w in per_rank)
                                / (workload["model"]["num_layers"] + 1),
            "recompute_factors": {p: statistics.median(w["recompute_factors"][p] for w in per_rank)
                                  for p in workload["policies"]},
            "micro_batches": list(workload["micro_batches"]),
        }}
    if save:
        record["path"] = str(save_calibration(record))
    return record


def format_calibration(record: dict) -> str:
    lines = [f"calibrated {record['world_size']} local gloo processes ({record['threads_per_rank']} thread each):",
             f"  matmul peak      {record['matmul_peak_flops'] / 1e9:8.2f} GFLOP/s per rank "
             f"({record['matmul_size']}^3 fp32, all ranks at once)",
             f"  memory bandwidth {record['memory_bandwidth_bytes_per_s'] / 1e9:8.2f} GB/s per rank",
             f"  alpha            {record['alpha_s'] * 1e6:8.1f} us per log2(p) step",
             f"  beta             {record['beta_bytes_per_s'] / 1e9:8.3f} GB/s"]
    for s in record["samples"]:
        lines.append(f"    {s['bytes'] / 1024:8.0f} KiB  all-reduce {s['all_reduce_s'] * 1e3:7.2f} ms  "
                     f"all-gather {s['all_gather_s'] * 1e3:7.2f} ms")
    for sig, w in record.get("workloads", {}).items():
        factors = ", ".join(f"{p} +{f:.0%}" for p, f in w["recompute_factors"].items())
        lines.append(f"  workload {sig}: forward+backward at {w['compute_efficiency']:.0%} of the matmul peak, "
                     f"{w['block_overhead_s'] * 1e3:.2f} ms fixed per block per micro-batch; recompute {factors}")
    if "path" in record:
        lines.append(f"  saved to {record['path']}")
    return "\n".join(lines)
