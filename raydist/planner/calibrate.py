"""`raydist plan --calibrate`: measure this machine's alpha, beta, matmul peak and memory bandwidth.

Runs `world_size` gloo processes (raydist.parallel.runtime.spawn) at once, the way training will: every rank times a
square fp32 matmul (raydist.metrics.flops.measure_cpu_matmul_peak) and a large copy while the others do the
same, so the peak is what one rank gets when the cores are shared. Then rank 0 times all-reduce and all-gather
over a range of message sizes and fits the alpha-beta model (Hockney 1994) by least squares:

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

from raydist.parallel.runtime import spawn
from raydist.planner.hardware import save_calibration, workload_signature

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


def _model_and_loss(model_cfg: dict, seq_len: int, kernels: dict | None, split: bool = False):
    """The workload's model as a Trainer builds it (the config's kernels installed; split over every rank of
    the world by raydist's tensor parallelism when `split`, without sequence parallelism) and
    `loss(tokens)`, its mean loss as the Trainer's step takes it: the head's fused matmul and loss where
    kernels.loss and the head allow (raydist.parallel.parallelize.ParallelModel.loss), else the logits' loss
    (vocabulary-parallel when split). A timing with the plain model and loss priced the default workload's
    TP 2 split at 1.75x one rank's whole model where its run took 1.45x (the fused path's share)."""
    from raydist.config import KernelsConfig, ModelConfig
    from raydist.kernels.select import apply_kernels
    from raydist.models.gpt import build_model
    from raydist.models.loss import cross_entropy

    cfg = ModelConfig(**model_cfg)
    kernels_cfg = KernelsConfig(**kernels) if kernels is not None else KernelsConfig()
    model = build_model(cfg, seq_len, 0)
    apply_kernels(model, kernels_cfg, "cpu")
    head = model.head
    fused = (kernels_cfg.loss != "plain" and getattr(head, "fuses_loss", False)
             and getattr(head, "bias", None) is None)
    loss_fn = cross_entropy
    if split:
        from torch.distributed.device_mesh import init_device_mesh

        from raydist.parallel.tensor import apply_tensor_parallel

        loss_fn = apply_tensor_parallel(model, init_device_mesh("cpu", (dist.get_world_size(),),
                                                                mesh_dim_names=("tp",)))

    def loss(tokens: torch.Tensor) -> torch.Tensor:
        if fused:
            return model(tokens[:, :-1], None, targets=tokens[:, 1:])
        return loss_fn(model(tokens[:, :-1]), tokens[:, 1:])

    return cfg, model, loss


def _timer(cfg, seq_len: int, model, loss, together: bool = False):
    """run(micro_batch) -> seconds of one forward + backward of `model` on fresh tokens (one seed: the same
    tokens on every rank, as a TP group gets them); `together`: every rank starts it at once (the ranks of a
    split model wait for each other)."""
    generator = torch.Generator().manual_seed(0)

    def run(micro_batch: int) -> float:
        tokens = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len + 1), generator=generator)
        if together:
            dist.barrier()  # not the wait for a rank still in its previous (unsplit) run
        start = time.perf_counter()
        loss(tokens).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    return run


def _fwd_bwd_timer(model_cfg: dict, seq_len: int, policy: str, kernels: dict | None = None):
    """A function that runs one forward + backward of the workload's model on `micro_batch` samples and
    returns its seconds."""
    from raydist.parallel.checkpointing import apply_activation_checkpointing

    cfg, model, loss = _model_and_loss(model_cfg, seq_len, kernels)
    apply_activation_checkpointing(model, policy)
    return _timer(cfg, seq_len, model, loss)


def _tp_fwd_bwd_timer(model_cfg: dict, seq_len: int, kernels: dict | None = None):
    """As _fwd_bwd_timer, the model split over every rank of the world by raydist's tensor parallelism (no
    sequence parallelism): all ranks call it together, on the same tokens. None where the runtime would not
    split the model over the world (raydist.parallel.layout.validate)."""
    from raydist.config import ModelConfig
    from raydist.parallel.layout import Layout, validate

    if validate(Layout.of(tp=dist.get_world_size(), micro_batch=1), ModelConfig(**model_cfg), seq_len):
        return None  # the runtime would refuse this split (heads, hidden sizes or vocabulary not divisible)
    cfg, model, loss = _model_and_loss(model_cfg, seq_len, kernels, split=True)
    return _timer(cfg, seq_len, model, loss, together=True)


def _calibrate_workload(spec: dict, reps: int = 5) -> dict:
    """Time the workload's forward+backward without recompute at several micro-batch sizes and with each
    recompute policy at the largest, all interleaved rep by rep, keeping each one's median repetition (the
    fastest, kept before, priced the default run's step at 0.54 of what it measured: a training step shares
    the cores with the other ranks all the time, not in its best moments). Fit t = overhead + FLOPs / rate
    by least squares; recompute cost = t(policy) / t(none) - 1 at the largest size."""
    from raydist.config import ModelConfig
    from raydist.models.gpt import flops_per_token

    sizes, seq_len = spec["micro_batches"], spec["seq_len"]
    kernels = spec.get("kernels")
    runners = {policy: _fwd_bwd_timer(spec["model"], seq_len, policy, kernels)
               for policy in ("none", *spec["policies"])}
    split = _tp_fwd_bwd_timer(spec["model"], seq_len, kernels) if dist.get_world_size() > 1 else None
    if split is not None:
        runners["tp"] = split
    seen: dict[tuple[str, int], list[float]] = {}
    jobs = ([("none", b) for b in sizes] + [(p, sizes[-1]) for p in spec["policies"]]
            + ([("tp", sizes[-1])] if split is not None else []))  # (every rank runs them in this order)
    for rep in range(reps + 1):
        for policy, b in jobs:
            t = runners[policy](b)
            if rep:  # the first pass warms up
                seen.setdefault((policy, b), []).append(t)
    best = {key: statistics.median(times) for key, times in seen.items()}
    fpt = flops_per_token(ModelConfig(**spec["model"]), seq_len)
    flops = [fpt * b * seq_len for b in sizes]
    times = [best["none", b] for b in sizes]
    (overhead, inv_rate), *_ = np.linalg.lstsq(np.array([[1.0, f] for f in flops]), np.array(times), rcond=None)
    if inv_rate <= 0:  # noise swamped the slope: no fixed cost, the mean rate
        overhead, inv_rate = 0.0, sum(times) / sum(flops)
    factors = {p: best[p, sizes[-1]] / best["none", sizes[-1]] - 1.0 for p in spec["policies"]}
    tp_factors = ({str(dist.get_world_size()): best["tp", sizes[-1]] / best["none", sizes[-1]]}
                  if split is not None else {})
    return {"rate_flops": 1.0 / float(inv_rate), "overhead_s": max(0.0, float(overhead)),
            "recompute_factors": factors, "tp_factors": tp_factors,
            "times_s": {f"{p}/{b}": t for (p, b), t in best.items()}}


def _calibrate_rank(reps: int, matmul_size: int, workload: dict | None = None) -> dict:
    from raydist.metrics.flops import measure_cpu_matmul_peak

    world = dist.get_world_size()
    # Best of several short bursts, all ranks at once: the machine's capacity per rank when our own ranks
    # share it, without the dips when another job takes the cores.
    dist.barrier()
    peak = max(measure_cpu_matmul_peak(size=matmul_size, min_time_s=0.1) for _ in range(5))
    dist.barrier()
    bandwidth = max(memory_bandwidth_bytes_per_s(min_time_s=0.1) for _ in range(3))
    dist.barrier()
    samples = []
    for n_bytes in SIZES_BYTES:
        numel = n_bytes // 4
        x = torch.ones(numel)
        t_ar = _time_collective(lambda x=x: dist.all_reduce(x), n_bytes, reps)
        shard = torch.ones(max(1, numel // world))
        out = torch.empty(shard.numel() * world)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        t_ag = _time_collective(lambda out=out, shard=shard, gather=gather: gather(out, shard), out.numel() * 4, reps)
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

        large = max(2, config.train.micro_batch or _derived_micro_batch(config, world_size))
        sizes = sorted({1, max(1, large // 2), large})
        workload = {"model": dataclasses.asdict(config.model), "kernels": dataclasses.asdict(config.kernels),
                    "seq_len": config.data.seq_len,
                    "micro_batches": tuple(sizes), "policies": ("selective", "full", "every_k")}
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
        record["workloads"] = {workload_signature(workload["model"], workload["seq_len"], workload["kernels"]): {
            "compute_efficiency": min(1.0, rate / record["matmul_peak_flops"]),
            "block_overhead_s": statistics.median(w["overhead_s"] for w in per_rank)
                                / (workload["model"]["num_layers"] + 1),
            "recompute_factors": {p: statistics.median(w["recompute_factors"][p] for w in per_rank)
                                  for p in workload["policies"]},
            # (the slowest rank's: the split model's ranks wait for each other)
            "tp_factors": {tp: max(w["tp_factors"][tp] for w in per_rank) for tp in per_rank[0]["tp_factors"]},
            "micro_batches": list(workload["micro_batches"]),
        }}
    if save:
        record["path"] = str(save_calibration(record))
    return record


def _derived_micro_batch(config, world_size: int) -> int:
    """The micro-batch an unset `train.micro_batch` becomes for the config's layout on `world_size` ranks (the
    sizes timed must reach it: a fit over micro-batches 1 and 2 priced the default run's micro-batch of 8 at
    half its measured step). 1 when the config has no layout on that world."""
    from raydist.errors import ConfigError
    from raydist.planner.policy import plan_layout

    try:
        return plan_layout(config, world_size).micro_batch
    except ConfigError:
        return 1


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
        split = "".join(f"; split over tp {tp}: {f:.2f}x one rank's whole model"
                        for tp, f in (w.get("tp_factors") or {}).items())
        lines.append(f"  workload {sig}: forward+backward at {w['compute_efficiency']:.0%} of the matmul peak, "
                     f"{w['block_overhead_s'] * 1e3:.2f} ms fixed per block per micro-batch; recompute {factors}"
                     + split)
    if "path" in record:
        lines.append(f"  saved to {record['path']}")
    return "\n".join(lines)
