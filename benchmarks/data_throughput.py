"""What the data path reads and delivers, against what the default training step consumes, in one run.

1. Bytes: bytes read from storage per data-parallel rank over one epoch of the default workload's data
   (global batch 16), for dp = 1, 2, 4, counted by the reader (what its file objects returned), against
   the dataset's size and against the whole-shard read every rank did before row groups.
2. Delivery: one data-parallel rank's `SampleStream` (dp 2, its own row groups only) taking step after
   step with no compute, through the pyarrow reader and through Ray Data (on a local Ray), on local files
   and on S3 (a local moto server through s3fs); the first batch's latency is reported separately.
3. Consumption (`--train`): the default workload's training step on 2 gloo processes, and the data-wait
   share of a Ray Train run with the Ray Data reader (from metrics.jsonl, after the first logged interval).

The footers (row-group metadata) every rank reads once per shard are a fixed cost per row group: large
against the default workload's tiny rows (128 tokens, 8 rows a group), small against real ones; `--set`
prepares and measures another shape of the same corpus, e.g. `--set data.seq_len=1024
--set data.row_group_rows=4` (a dp 4 rank's slice of a 16-sample batch is 4 rows: a row group larger than
the slice is read by every rank that shares it). `--bytes-only` skips parts 2 and 3.

    python benchmarks/data_throughput.py [--steps 200] [--train] [--set KEY=VALUE ...] [--bytes-only] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time

import torch

from raydist.config import Config
from raydist.data.position import RankPlan, SampleOrder, rank_slice
from raydist.data.prepare import read_manifest
from raydist.data.readers import ArrowReader, RayDataReader
from raydist.data.stream import SampleStream, Split
from raydist.parallel.runtime import spawn


def _order(path: str, seed: int) -> tuple[Split, SampleOrder]:
    split = Split.open(path, "train")
    return split, SampleOrder(split.shard_rows, seed, block=read_manifest(path).get("row_group_rows", 1))


def dataset_bytes(path: str) -> int:
    import fsspec

    fs, _ = fsspec.core.url_to_fs(path)
    split = Split.open(path, "train")
    return sum(fs.size(fsspec.core.url_to_fs(split.uri(i))[1]) for i in range(len(split.shards)))


def epoch_bytes(path: str, seed: int, g: int, dp: int, rank: int, planned: bool = True) -> tuple[int, int]:
    """Bytes rank `rank` of `dp` reads over the whole steps of the first epoch and of the second (a reader
    one shard ahead; a fresh process's footer cache at the start)."""
    from raydist.data.row_groups import FOOTERS

    FOOTERS.__init__()
    split, order = _order(path, seed)
    start = rank_slice(0, g, rank, dp)[0]
    stream = SampleStream(split, order, ArrowReader(prefetch=1), start,
                          RankPlan.at(0, g, rank, dp) if planned else None)
    steps = order.num_samples // g
    try:
        for step in range(steps):
            stream.take(*rank_slice(step * g, g, rank, dp))
        first = stream.bytes_read
        for step in range(steps, 2 * steps):
            stream.take(*rank_slice(step * g, g, rank, dp))
        return first, stream.bytes_read - first
    finally:
        stream.close()


def delivery(path: str, seed: int, g: int, reader, steps: int) -> tuple[float, float, int]:
    """(seconds to the first batch, samples/s after it, bytes read) for dp rank 0 of 2, its rows only."""
    split, order = _order(path, seed)
    stream = SampleStream(split, order, reader, 0, RankPlan.at(0, g, 0, 2))
    start = time.perf_counter()
    stream.take(*rank_slice(0, g, 0, 2))
    first = time.perf_counter() - start
    start = time.perf_counter()
    for step in range(1, steps + 1):
        stream.take(*rank_slice(step * g, g, 0, 2))
    elapsed = time.perf_counter() - start
    read = stream.bytes_read
    stream.close()
    return first, steps * g / 2 / elapsed, read


def _consume(raw: dict, steps: int) -> float:
    from raydist.training.trainer import Trainer

    trainer = Trainer(Config.from_dict(raw), torch.device("cpu"))
    times = [trainer.train_step().step_time_s for _ in range(steps)]
    trainer.close()
    return statistics.median(times[5:])


def _moto_s3(local_path: str):
    """A local moto S3 server holding a copy of the dataset; returns (server, s3 uri)."""
    import fsspec.config
    import s3fs
    from moto.server import ThreadedMotoServer

    from raydist.parallel.runtime import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # not a line per request
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"})
    fsspec.config.set_conf_env(fsspec.config.conf)
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    fs.mkdir("raydist-bench")
    fs.put(local_path.rstrip("/") + "/", "raydist-bench/data/", recursive=True)
    return server, "s3://raydist-bench/data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--train", action="store_true", help="also measure the training step and a Ray Train run")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line at the end")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override of the default workload (e.g. data.seq_len=1024)")
    parser.add_argument("--bytes-only", action="store_true", help="only part 1, the bytes per dp rank")
    args = parser.parse_args()
    import ray

    from raydist.driver.launcher import with_prepared_data, launch
    from raydist.metrics.logger import read_metrics

    cfg = with_prepared_data(Config.load("workloads/gpt_tiny.toml", ["train.eval_every=0", *args.set]), log=print)
    path, seed, g = cfg.data.path, cfg.train.seed, cfg.train.global_batch
    out: dict = {"global_batch": g, "seq_len": cfg.data.seq_len,
                 "row_group_rows": read_manifest(path).get("row_group_rows", 1)}

    # 1. bytes per dp rank per epoch
    size = dataset_bytes(path)
    whole = epoch_bytes(path, seed, g, 1, 0, planned=False)[0]
    out.update(dataset_bytes=size, whole_shard_read_bytes=whole, per_rank={})
    print(f"\ndataset (train split): {size / 1e6:.2f} MB in row groups of {out['row_group_rows']} rows; the "
          f"whole-shard read of one epoch (every rank before): {whole / 1e6:.2f} MB ({whole / size:.3f}x)")
    print(f"bytes read from storage per dp rank per epoch (global batch {g}; the most any rank read):")
    for dp in (1, 2, 4):
        per = [epoch_bytes(path, seed, g, dp, r) for r in range(dp)]
        first, second = max(p[0] for p in per), max(p[1] for p in per)
        out["per_rank"][dp] = {"epoch1_bytes": first, "epoch1_over_dataset": first / size,
                               "epoch2_bytes": second, "epoch2_over_dataset": second / size}
        print(f"  dp={dp}: epoch 1 {first / 1e6:6.2f} MB = {first / size:.3f} of the dataset, epoch 2 (footers "
              f"kept) {second / 1e6:6.2f} MB = {second / size:.3f}   (1/dp = {1 / dp:.3f}; slice {g // dp} rows)")

    if args.bytes_only:
        if args.json:
            print(json.dumps(out))
        return
    # 2. delivery, local files and S3
    rates = {}
    server, s3_path = _moto_s3(path)  # before Ray starts: its workers inherit the S3 endpoint and keys
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="warning")
    try:
        for storage, where in (("local", path), ("s3", s3_path)):
            steps = args.steps if storage == "local" else max(20, args.steps // 4)
            for name, reader in (("arrow", ArrowReader(prefetch=2)), ("ray", RayDataReader(prefetch=2))):
                first, rate, read = delivery(where, seed, g, reader, steps)
                rates[f"{storage}_{name}"] = {"first_batch_s": first, "samples_per_s": rate, "bytes": read}
    finally:
        ray.shutdown()
        server.stop()
    out["delivery_dp2_rank0"] = rates
    print(f"\none dp rank's stream (dp 2, its row groups only), {args.steps} steps (S3: fewer):")
    for key, r in rates.items():
        print(f"  {key:10s}: {r['samples_per_s']:10.0f} samples/s, first batch after {r['first_batch_s']:.2f} s")

    # 3. consumption
    if args.train:
        raw = cfg.to_dict()
        raw["data"]["reader"] = "arrow"
        step_s = spawn(_consume, 2, raw, 40)[0]
        out["train_step_ms"] = step_s * 1e3
        out["consumed_samples_per_s_per_rank"] = g / 2 / step_s
        with tempfile.TemporaryDirectory() as tmp:
            run = Config.load("workloads/gpt_tiny.toml", [f"data.path={path}", "train.eval_every=0",
                                                          "train.steps=100", "train.log_every=10", "data.reader=ray",
                                                          f"checkpoint.storage={tmp}", "train.run_name=bench"])
            launch(run, log=lambda *_: None)
            records = [r for r in read_metrics(os.path.join(tmp, "bench")) if r.get("step_time_s") and r["step"] > 10]
            out["data_wait_share_ray_reader"] = statistics.mean(r["data_wait_s"] / r["step_time_s"] for r in records)
        print(f"training step consumes {g / 2 / step_s:.0f} samples/s per rank ({step_s * 1e3:.1f} ms/step); data "
              f"wait in a Ray Train run (Ray Data reader): {100 * out['data_wait_share_ray_reader']:.2f}% of step time")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
