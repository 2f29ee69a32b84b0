"""Bytes each rank sends per optimizer step, counted at the collectives, beside the seed's figures.

DDP: a ring all-reduce of the gradients: 2 (p-1)/p x the parameter bytes (seed 001/003: "2x").
FSDP: all-gather in forward, all-gather again in backward (reshard after forward), reduce-scatter of
the gradients: 3 (p-1)/p x the parameter bytes (seed 003: "about 3x"). One micro-batch per step here;
with gradient accumulation FSDP all-gathers again for every micro-batch.

    python benchmarks/comm_volume.py
"""

from __future__ import annotations

import torch

from raydist.config import Config
from raydist.metrics.comm import CommCounter
from raydist.runtime import spawn

WORLD = 4


def _count_on_rank(raw: dict) -> dict:
    from raydist.trainer import Trainer

    trainer = Trainer(Config.from_dict(raw), torch.device("cpu"))
    trainer.train_step()  # warm-up: lazy initialisation is not part of a step
    counter = CommCounter()
    if trainer.pm.kind == "ddp":
        trainer.pm.module.register_comm_hook(None, counter.ddp_hook())
    batch = trainer.next_batch()
    with counter.patch():
        trainer.train_step(batch)
    trainer.close()
    return {"bytes": dict(counter.bytes), "calls": dict(counter.calls), "total": counter.total}


def main() -> None:
    from raydist.launcher import ensure_data
    from raydist.models.gpt import param_counts

    cfg = Config.load("workloads/gpt_tiny.toml", ["data.reader=arrow", "train.eval_every=0",
                                                  f"train.micro_batch={16 // WORLD}"])
    ensure_data(cfg)
    param_bytes = 4 * param_counts(cfg.model)["total"]
    p = WORLD
    print(f"parameter bytes (fp32): {param_bytes / 2**20:.3f} MiB, p = {p}\n")
    print(f"{'layout':<8} {'sent MiB/rank/step':>20} {'x param bytes':>14} {'seed figure':>12}  by collective")
    for name, layout, seed in (("DDP", (p, 1), 2 * (p - 1) / p), ("FSDP", (1, p), 3 * (p - 1) / p)):
        raw = cfg.to_dict()
        raw["parallel"].update(dp_replicate=layout[0], dp_shard=layout[1])
        result = spawn(_count_on_rank, p, raw)[0]
        detail = ", ".join(f"{k} {v / 2**20:.2f} MiB ({result['calls'][k]} calls)" for k, v in result["bytes"].items())
        print(f"{name:<8} {result['total'] / 2**20:>20.3f} {result['total'] / param_bytes:>14.3f} {seed:>12.3f}  {detail}")


if __name__ == "__main__":
    main()
