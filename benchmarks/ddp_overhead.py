"""raydist's per-step time with 2 workers against a plain torch.multiprocessing + DDP loop, in one run.

Both sides train the default workload's model on the same prepared shards with the same global batch,
micro-batch and optimizer, one torch thread per process. The baseline is the textbook loop: the whole
token array in memory, indexed by a fixed permutation, DDP + AdamW, nothing else. raydist runs its
`Trainer` (stream reader, layout, clipping, schedule, metrics bookkeeping) through `raydist.parallel.runtime.spawn`,
and then the whole job through Ray Train (`launch`), whose steady-state step time is read from
metrics.jsonl. The three sides alternate in rounds (a Ray Train run in every round, so a slow spell of the
machine hits every side alike) and the ratio of medians is printed; also the CPU MFU of the default model
(against the in-process fp32 matmul peak).

Every side's figure is the same statistic: the median over the mean step time of each LOG_EVERY steps
after step 10, which is what metrics.jsonl's `step_time_s` gives for the Ray Train run (its mean over the
logged interval). A median of single steps drops the slow ones a mean keeps: on this machine the plain loop's
median step was 1.2% below the median of its 5-step means, which made the Ray Train side look that much slower.

The Ray Train run is the default workload as `raydist train` runs it (default reader, evaluation on), so it
also gives the start-up figure: seconds from the `start` event (worker group up, model built, weights ready)
to the step-0 line (first batch read, the untrained model evaluated on the validation split and on it).

    python benchmarks/ddp_overhead.py [--steps 60] [--rounds 2] [--skip-ray] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from raydist.config import Config
from raydist.parallel.runtime import spawn

WARMUP = 10  # steps left out of every side's figure
LOG_EVERY = 5  # the Ray Train run's logged interval: every side's figure is a median of such means


def baseline(cfg_raw: dict, steps: int) -> list[float]:
    import pyarrow.parquet as pq
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from raydist.data.prepare import read_manifest
    from raydist.models.gpt import build_model
    from raydist.models.loss import cross_entropy

    cfg = Config.from_dict(cfg_raw)
    rank, world = dist.get_rank(), dist.get_world_size()
    manifest = read_manifest(cfg.data.path)
    shard = manifest["splits"]["train"]["shards"][0]
    table = pq.read_table(os.path.join(cfg.data.path, shard["path"]))
    data = torch.from_numpy(np.stack(table.column("tokens").to_numpy(zero_copy_only=False)).astype(np.int64))
    model = DDP(build_model(cfg.model, cfg.data.seq_len, cfg.train.seed))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=(0.9, 0.95), weight_decay=0.1)
    per_rank = cfg.train.global_batch // world
    accum = per_rank // cfg.train.micro_batch
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    times = []
    for step in range(steps):
        start = time.perf_counter()
        idx = perm[(step * cfg.train.global_batch + rank * per_rank) % len(data):][:per_rank]
        batch = data[idx]
        for i, chunk in enumerate(batch.split(cfg.train.micro_batch)):
            ctx = model.no_sync() if i < accum - 1 else torch.enable_grad()
            with ctx:
                loss = cross_entropy(model(chunk[:, :-1]), chunk[:, 1:]) / accum
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times


def raydist_trainer(cfg_raw: dict, steps: int) -> tuple[list[float], float]:
    from raydist.metrics.flops import measure_cpu_matmul_peak
    from raydist.training.trainer import Trainer

    cfg = Config.from_dict(cfg_raw)
    trainer = Trainer(cfg, torch.device("cpu"))
    times = [trainer.train_step().step_time_s for _ in range(steps)]
    trainer.close()
    return times, measure_cpu_matmul_peak()


def steady(times: list[float]) -> float:
    """Median over the means of steps (WARMUP, WARMUP + LOG_EVERY], ...: metrics.jsonl's intervals."""
    return statistics.median(statistics.mean(times[i:i + LOG_EVERY])
                             for i in range(WARMUP, len(times) - LOG_EVERY + 1, LOG_EVERY))


def ray_train_run(data_path: str, steps: int) -> tuple[float, float]:
    """The default workload through `launch` (Ray Train): (steady step time, start event -> step-0 line)."""
    from raydist.driver.launcher import launch
    from raydist.metrics.goodput import read_events
    from raydist.metrics.logger import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        cfg = Config.load("workloads/gpt_tiny.toml", [f"data.path={data_path}", f"train.steps={steps}",
                                                      f"train.log_every={LOG_EVERY}", f"checkpoint.storage={tmp}",
                                                      "train.run_name=bench"])
        launch(cfg, log=lambda *_: None)
        records = read_metrics(os.path.join(tmp, "bench"))
        step = statistics.median(r["step_time_s"] for r in records if r.get("step_time_s") and r["step"] > WARMUP)
        start = next(e for e in read_events(os.path.join(tmp, "bench")) if e["kind"] == "start")
        step0 = next(r for r in records if r["step"] == 0)
    return step, step0["elapsed_s"] - start["elapsed_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-ray", action="store_true", help="compare the Trainer only (no Ray Train run)")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = parser.parse_args()

    from raydist.driver.launcher import with_prepared_data
    from raydist.models.gpt import flops_per_token

    # the default run's micro-batch (derived: 8 at dp 2), set explicitly for the hand-written baseline
    cfg = with_prepared_data(Config.load("workloads/gpt_tiny.toml", ["data.reader=arrow", "train.eval_every=0",
                                                              "train.micro_batch=8"]))
    raw = cfg.to_dict()
    base_t, ours_t, ray_t, step0_t, peaks = [], [], [], [], []
    for r in range(args.rounds):
        base_t.append(steady(spawn(baseline, 2, raw, args.steps)[0]))
        times, peak = spawn(raydist_trainer, 2, raw, args.steps)[0]
        ours_t.append(steady(times))
        peaks.append(peak)
        line = f"round {r + 1}: plain DDP {base_t[-1] * 1e3:.1f} ms/step, raydist Trainer {ours_t[-1] * 1e3:.1f} ms/step"
        if not args.skip_ray:
            step, to_step0 = ray_train_run(cfg.data.path, args.steps)
            ray_t.append(step)
            step0_t.append(to_step0)
            line += f", raydist on Ray Train {step * 1e3:.1f} ms/step"
        print(line, flush=True)
    base, ours = statistics.median(base_t), statistics.median(ours_t)
    tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)
    peak = statistics.median(peaks)
    mfu = tokens_per_step / ours * fpt / 2 / peak
    print(f"\nplain torch.multiprocessing + DDP : {base * 1e3:7.1f} ms/step")
    print(f"raydist Trainer (2 gloo procs)    : {ours * 1e3:7.1f} ms/step   ratio {ours / base:.3f}")
    figures = {"benchmark": "ddp_overhead", "plain_ddp_ms": base * 1e3, "trainer_ms": ours * 1e3,
               "trainer_ratio": ours / base}
    if not args.skip_ray:
        ray_step, to_step0 = statistics.median(ray_t), statistics.median(step0_t)
        print(f"raydist on Ray Train (2 workers)  : {ray_step * 1e3:7.1f} ms/step   ratio {ray_step / base:.3f}")
        print(f"start event -> step-0 line        : {to_step0:7.2f} s (default reader)")
        figures.update(ray_train_ms=ray_step * 1e3, ray_train_ratio=ray_step / base, start_to_step0_s=to_step0)
    print(f"CPU MFU of the default model: {100 * mfu:.1f}% of a measured fp32 matmul peak "
          f"({peak / 1e9:.1f} GFLOP/s per process, {fpt / 1e6:.2f} MFLOP/token)")
    if args.json:
        print(json.dumps({**figures, "cpu_mfu": mfu}))


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
