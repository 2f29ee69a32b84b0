"""What the strict-collectives mode (raydist.strict) costs: its collectives and batches against plain gloo's,
and a training step under it against the same step on gloo, measured side by side.

    python benchmarks/strict_overhead.py [--ops N] [--rounds R] [--steps S] [--json]

Operations: one 2-rank world under the mode holds a plain gloo group and a strict group over the same ranks;
rounds alternate N operations on each (all_reduce of 16 and of 256k floats, a send/receive batch), and the
figure is the median per-operation time of each and their ratio. Steps: the tiny model's Trainer with
FSDP over 2 ranks, S steps per run, runs alternating gloo and strict (each in fresh processes); the figure is
the median step time of each and the ratio. Prints a table, and with --json one line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from raydist import strict  # noqa: E402
from raydist.parallel.runtime import spawn  # noqa: E402


def _ops(n: int, rounds: int) -> dict[str, dict[str, float]]:
    gloo = dist.new_group([0, 1], backend="gloo")
    checked = dist.new_group([0, 1])  # the strict backend: the world's
    peer = 1 - dist.get_rank()
    small, large = torch.ones(16), torch.ones(256 * 1024)
    recv = torch.empty(4096)

    def batch(group):
        ops = [dist.P2POp(c10d.isend, torch.ones(4096), peer, group), dist.P2POp(c10d.irecv, recv, peer, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    cases = {"all_reduce 16": lambda g: dist.all_reduce(small, group=g),
             "all_reduce 256k": lambda g: dist.all_reduce(large, group=g),
             "send/recv batch 4k": batch}
    out = {}
    for name, op in cases.items():
        times = {"gloo": [], "strict": []}
        for _ in range(rounds):
            for label, group in (("gloo", gloo), ("strict", checked)):
                dist.barrier(group=gloo)
                start = time.perf_counter()
                for _ in range(n):
                    op(group)
                times[label].append((time.perf_counter() - start) / n)
        out[name] = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    dist.barrier(group=gloo)
    return out


def _steps(data: str, steps: int) -> float:
    from raydist.config import Config
    from raydist.parallel.runtime import pick_device
    from raydist.testing import tiny_config
    from raydist.training.trainer import Trainer

    cfg = Config.from_dict(tiny_config(data, parallel={"dp_shard": 2}))
    trainer = Trainer(cfg, pick_device())
    trainer.train_step()  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step().loss  # (reading it waits for the step)
        times.append(time.perf_counter() - start)
    trainer.close()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--runs", type=int, default=2, help="step runs of each mode, alternating")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    saved = os.environ.get(strict.ENV)
    os.environ[strict.ENV] = "1"
    ops = spawn(_ops, 2, args.ops, args.rounds, timeout_s=600)[0]
    from raydist.config import DataConfig
    from raydist.data.prepare import prepare

    data = os.path.join(tempfile.mkdtemp(), "stdlib-s32")
    prepare(DataConfig(corpus="stdlib", seq_len=32, max_corpus_mb=0.3, shard_rows=1024), data, log=lambda *_: None)
    step = {"gloo": [], "strict": []}
    for _ in range(args.runs):
        for label, value in (("gloo", "0"), ("strict", "1")):
            os.environ[strict.ENV] = value
            step[label].append(statistics.median(spawn(_steps, 2, data, args.steps, timeout_s=600)))
    if saved is None:
        os.environ.pop(strict.ENV, None)
    else:
        os.environ[strict.ENV] = saved
    result = {"ops_us": {k: {**v, "ratio": v["strict"] / v["gloo"]} for k, v in ops.items()},
              "fsdp2_step_s": {k: statistics.median(v) for k, v in step.items()}}
    result["fsdp2_step_s"]["ratio"] = result["fsdp2_step_s"]["strict"] / result["fsdp2_step_s"]["gloo"]
    print(f"{'operation':<22} {'gloo us':>10} {'strict us':>10} {'ratio':>7}")
    for name, v in result["ops_us"].items():
        print(f"{name:<22} {v['gloo']:>10.1f} {v['strict']:>10.1f} {v['ratio']:>7.2f}")
    s = result["fsdp2_step_s"]
    print(f"{'FSDP 2 step (s)':<22} {s['gloo']:>10.4f} {s['strict']:>10.4f} {s['ratio']:>7.2f}")
    if args.json:
        print(json.dumps({"benchmark": "strict_overhead", **result}))


if __name__ == "__main__":
    main()
