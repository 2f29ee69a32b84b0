"""DiLoCo between two replicas against synchronous training, side by side on the default workload: the loss
after the run and the bytes each rank sent to the other replica.

    python benchmarks/diloco.py [--steps 300] [--every 8] [--json]

Two replicas of one worker each, as live recovery runs them (raydist.elastic.live.TorchftReplicas: a real
torchft Lighthouse and Manager, gloo between the replicas), without Ray: first `elastic.sync = every_step`
(every step's gradients summed over the replicas: synchronous data parallelism), then `diloco` with
`elastic.sync_every` = --every (each replica steps alone on its half of each global batch; one all-reduce of
the outer gradient per window, and at the last step). Both from the same seed and data. Reported: the
validation loss after the last step (the replicas hold the same parameters then), the mean training loss of
the last 10 steps (each replica's own, averaged), the bytes per rank between replicas and their ratio.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import time
from pathlib import Path

import torch

from raydist.config import Config

WORKLOAD = Path(__file__).resolve().parent.parent / "workloads" / "gpt_tiny.toml"
REPLICAS = 2


def _replica(replica: int, raw: dict, lighthouse: str, out) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from raydist.elastic.diloco import replica_manager
    from raydist.elastic.live import TorchftReplicas
    from raydist.planner.policy import replica_layout
    from raydist.training.trainer import Trainer

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=600))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCHFT_LIGHTHOUSE=lighthouse)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    cfg = Config.from_dict(raw)
    trainer = Trainer(cfg, torch.device("cpu"), replica_layout(cfg))
    replicas = replica_manager(TorchftReplicas(replica, torch.device("cpu"), 120.0, trainer.state_parts,
                                               replicas=REPLICAS), trainer)
    replicas.writes_checkpoints = False  # (no checkpoint: the inner states are not gathered for one)
    trainer.replicas = replicas
    replicas.join()
    losses, start = [], time.perf_counter()
    while trainer.step < cfg.train.steps:
        losses.append(trainer.train_step())
    wall = time.perf_counter() - start
    out.put({"replica": replica, "losses": [s.loss for s in losses], "val_loss": trainer.evaluate(),
             "sent_bytes": replicas.sent_bytes, "wall_s": wall})
    time.sleep(1.0)  # the peer reads its last quorum before this Manager goes
    replicas.shutdown()
    trainer.close()
    dist.destroy_process_group()


def run(raw: dict) -> dict:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=5000)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_replica, args=(r, raw, lighthouse.address(), out)) for r in range(REPLICAS)]
    try:
        for p in procs:
            p.start()
        results = []
        while len(results) < len(procs):
            try:
                results.append(out.get(timeout=5))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"a replica exited with {[p.exitcode for p in procs]}") from None
        results.sort(key=lambda r: r["replica"])
        for p in procs:
            p.join(60)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"a replica exited with {[p.exitcode for p in procs]}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    last = [statistics.fmean(r["losses"][-10:]) for r in results]
    return {"val_loss": round(results[0]["val_loss"], 4), "val_losses": [round(r["val_loss"], 4) for r in results],
            "train_loss_last10": round(statistics.fmean(last), 4),
            "bytes_per_rank": results[0]["sent_bytes"], "wall_s": round(max(r["wall_s"] for r in results), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=8, help="DiLoCo's H")
    ap.add_argument("--outer-lr", type=float, default=None, help="elastic.outer_lr (the config's default)")
    ap.add_argument("--outer-momentum", type=float, default=None, help="elastic.outer_momentum")
    ap.add_argument("--json", action="store_true", help="one JSON line")
    args = ap.parse_args()
    from raydist.driver.launcher import ensure_data

    base = Config.load(str(WORKLOAD))
    raw = base.to_dict()
    raw["data"]["path"] = ensure_data(base, log=lambda *_: None)
    raw["train"].update(steps=args.steps, eval_every=args.steps)  # (opens the validation split)
    raw["checkpoint"]["every_steps"] = 0
    raw["parallel"].update(dp_replicate=REPLICAS, dp_shard=1, cp=1, tp=1, pp=1, auto=False)
    raw["ray"]["num_workers"] = REPLICAS
    results = {}
    for sync in ("every_step", "diloco"):
        raw["elastic"].update(live_recovery=True, sync=sync, sync_every=args.every)
        for key in ("outer_lr", "outer_momentum"):
            if getattr(args, key) is not None:
                raw["elastic"][key] = getattr(args, key)
        results[sync] = run(raw)
    sync, diloco = results["every_step"], results["diloco"]
    summary = {"benchmark": "diloco", "steps": args.steps, "every": args.every,
               "outer_lr": raw["elastic"].get("outer_lr"), "outer_momentum": raw["elastic"].get("outer_momentum"),
               "every_step": sync, "diloco": diloco,
               "val_loss_ratio": round(diloco["val_loss"] / sync["val_loss"], 4),
               "bytes_ratio": round(sync["bytes_per_rank"] / max(diloco["bytes_per_rank"], 1), 2)}
    if args.json:
        print(json.dumps(summary))
        return
    print(f"{'':12} {'val loss':>9} {'train loss (last 10)':>21} {'MB per rank':>12} {'wall s':>7}")
    for name, r in results.items():
        print(f"{name:12} {r['val_loss']:9.4f} {r['train_loss_last10']:21.4f} {r['bytes_per_rank'] / 2**20:12.1f} "
              f"{r['wall_s']:7.1f}")
    print(f"diloco / every_step: val loss x{summary['val_loss_ratio']}, bytes / {summary['bytes_ratio']}")


if __name__ == "__main__":
    main()
