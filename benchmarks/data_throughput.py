"""Samples/s the data stream delivers against samples/s the default training step consumes, in one run.

1. Delivery: one data-parallel rank's `SampleStream` of the default workload (global batch 16, dp 2)
   taking step after step with no compute, through the pyarrow reader and through Ray Data (on a local
   Ray), after a warm-up that is reported separately (Ray Data's first batch starts its read tasks).
2. Consumption: the default workload's training step on 2 gloo processes (`Trainer.train_step`).
3. Data-wait share: the default workload trained through Ray Train with the Ray Data reader; the mean
   `data_wait_s / step_time_s` from metrics.jsonl (steady state, after the first logged interval).

    python benchmarks/data_throughput.py [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from raydist.config import Config
from raydist.data.position import SampleOrder, rank_slice
from raydist.data.stream import ArrowReader, RayDataReader, SampleStream, Split
from raydist.runtime import spawn


def delivery(cfg: Config, reader, steps: int) -> tuple[float, float]:
    """(seconds to the first batch, samples/s after it) for dp rank 0 of 2."""
    split = Split.open(cfg.data.path, "train")
    order = SampleOrder(split.shard_rows, cfg.train.seed)
    g = cfg.train.global_batch
    stream = SampleStream(split, order, reader, start_position=0)
    start = time.perf_counter()
    stream.take(*rank_slice(0, g, 0, 2))
    first = time.perf_counter() - start
    start = time.perf_counter()
    for step in range(1, steps + 1):
        stream.take(*rank_slice(step * g, g, 0, 2))
    elapsed = time.perf_counter() - start
    stream.close()
    return first, steps * g / 2 / elapsed


def _consume(raw: dict, steps: int) -> float:
    from raydist.trainer import Trainer

    trainer = Trainer(Config.from_dict(raw), torch.device("cpu"))
    times = [trainer.train_step().step_time_s for _ in range(steps)]
    trainer.close()
    return statistics.median(times[5:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    import ray

    from raydist.launcher import ensure_data, launch
    from raydist.metrics.logger import read_metrics

    cfg = Config.load("workloads/gpt_tiny.toml", ["train.eval_every=0"])
    cfg = ensure_data(cfg)
    g = cfg.train.global_batch
    first_arrow, arrow = delivery(cfg, ArrowReader(prefetch=2), args.steps)
    ray.init(address="local", num_cpus=4, logging_level="warning")
    try:
        first_ray, ray_rate = delivery(cfg, RayDataReader(prefetch=2), args.steps)
    finally:
        ray.shutdown()
    raw = cfg.to_dict()
    raw["data"]["reader"] = "arrow"
    step_s = spawn(_consume, 2, raw, 40)[0]
    consumed = g / 2 / step_s  # per dp rank
    with tempfile.TemporaryDirectory() as tmp:
        run = Config.load("workloads/gpt_tiny.toml", [f"data.path={cfg.data.path}", "train.eval_every=0",
                                                      "train.steps=100", "train.log_every=10", "data.reader=ray",
                                                      f"checkpoint.storage={tmp}", "train.run_name=bench"])
        launch(run, log=lambda *_: None)
        records = [r for r in read_metrics(os.path.join(tmp, "bench")) if r.get("step_time_s") and r["step"] > 10]
        wait_share = statistics.mean(r["data_wait_s"] / r["step_time_s"] for r in records)
        first_interval = next(r for r in read_metrics(os.path.join(tmp, "bench")) if r.get("step_time_s"))
    print(f"\nper data-parallel rank (dp 2, global batch {g}, seq_len {cfg.data.seq_len}):")
    print(f"  stream delivers, pyarrow reader : {arrow:10.0f} samples/s  (first batch after {first_arrow:.2f} s)")
    print(f"  stream delivers, Ray Data reader: {ray_rate:10.0f} samples/s  (first batch after {first_ray:.2f} s)")
    print(f"  training step consumes          : {consumed:10.0f} samples/s  ({step_s * 1e3:.1f} ms/step)")
    print(f"  headroom (Ray Data / consumption): {ray_rate / consumed:.1f}x")
    print(f"data wait in a Ray Train run (Ray Data reader): {100 * wait_share:.2f}% of step time in steady state; "
          f"first logged interval {100 * first_interval['data_wait_s'] / first_interval['step_time_s']:.1f}% "
          "(includes the reader's start)")


if __name__ == "__main__":
    main()
