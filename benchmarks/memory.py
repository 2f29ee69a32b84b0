"""Per-rank training-state bytes under DDP, FSDP and HSDP, and saved-activation bytes per checkpointing
policy, measured from the tensors each rank holds, beside the seed's figures.

State (4 gloo ranks, the default workload's model): parameters + gradients + AdamW moments, counted
from local tensors (`raydist.metrics.memory.state_bytes`) after an optimizer step with gradients
present. Seed 001: 16N bytes per replica in fp32 with Adam; fully sharded over p ranks, 16N/p.

Activations (one process): bytes held for backward at the end of forward, counted two ways: with
saved-tensor hooks (`SavedActivations`; checkpointed regions report the input they keep) and as the op
outputs still alive (`LiveActivations`, which also sees selective checkpointing's cache). Seed 002:
`full` keeps one input per block, `every_k` one per k-block segment (the sqrt(n) rule) plus one
segment recomputed at a time in backward, `selective` drops the cheap elementwise outputs.

    python benchmarks/memory.py [--layers 16]
"""

from __future__ import annotations

import argparse

import torch

from raydist.config import Config
from raydist.metrics.memory import LiveActivations, SavedActivations, state_bytes
from raydist.runtime import spawn

LAYOUTS = {"DDP 4": (4, 1), "FSDP 4": (1, 4), "HSDP 2x2": (2, 2)}


def _state_on_rank(raw: dict) -> dict:
    from raydist.trainer import Trainer

    trainer = Trainer(Config.from_dict(raw), torch.device("cpu"))
    trainer.train_step()  # creates the optimizer state
    tokens, _ = trainer.next_batch()
    loss = torch.nn.functional.cross_entropy(trainer.pm.module(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()  # gradients present, as during the optimizer step
    trainer.close()
    return state_bytes(trainer.pm.model, trainer.optimizer)


def measure_state(cfg: Config, layout: tuple[int, int]) -> list[dict]:
    raw = cfg.to_dict()
    raw["parallel"].update(dp_replicate=layout[0], dp_shard=layout[1])
    raw["train"].update(micro_batch=cfg.train.global_batch // 4)
    return spawn(_state_on_rank, 4, raw)


def measure_activations(cfg: Config, policy: str, batch: int) -> tuple[int, int]:
    """(saved-tensor-hook bytes, live bytes) held for backward at the end of forward."""
    from raydist.models.gpt import build_model, cross_entropy
    from raydist.parallel.checkpointing import apply_activation_checkpointing

    model = build_model(cfg.model, cfg.data.seq_len, seed=0)
    saved = SavedActivations(exclude=model.parameters())
    apply_activation_checkpointing(model, policy, 0)
    tokens = torch.randint(0, cfg.model.vocab_size, (batch, cfg.data.seq_len + 1))
    with saved.hooks(), LiveActivations() as live:
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    result = saved.live, live.live_bytes(exclude=(loss, *model.parameters(), *model.buffers()))
    loss.backward()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16, help="blocks for the activation measurement")
    args = parser.parse_args()
    from raydist.launcher import ensure_data
    from raydist.models.gpt import param_counts

    cfg = Config.load("workloads/gpt_tiny.toml", ["data.reader=arrow", "train.eval_every=0"])
    ensure_data(cfg)
    n = param_counts(cfg.model)["total"]
    print(f"model: {n / 1e6:.3f} M parameters; seed figure 16N = {16 * n / 2**20:.2f} MiB per full replica\n")
    print(f"{'layout':<10} {'params':>10} {'grads':>10} {'optim':>10} {'total MiB':>10} {'seed MiB':>9} {'ratio':>7}")
    for name, (rep, shard) in LAYOUTS.items():
        per_rank = measure_state(cfg, (rep, shard))
        worst = max(per_rank, key=lambda r: r["total"])
        seed = 16 * n / shard
        print(f"{name:<10} {worst['params'] / 2**20:>10.3f} {worst['grads'] / 2**20:>10.3f} "
              f"{worst['optimizer'] / 2**20:>10.3f} {worst['total'] / 2**20:>10.3f} {seed / 2**20:>9.3f} "
              f"{worst['total'] / seed:>7.3f}")
    act_cfg = Config.load("workloads/gpt_tiny.toml", [f"model.num_layers={args.layers}"])
    print(f"\nactivations held for backward at the end of forward, {args.layers} blocks, batch 8 x seq "
          f"{act_cfg.data.seq_len}:")
    print(f"  {'policy':<10} {'saved-tensor hooks':>19} {'live tensors':>13} {'of none':>8}")
    base = None
    for policy in ("none", "full", "every_k", "selective"):
        hooked, live = measure_activations(act_cfg, policy, 8)
        base = base or live
        print(f"  {policy:<10} {hooked / 2**20:>15.2f} MiB {live / 2**20:>9.2f} MiB {live / base:>8.3f}")
    print("  (hooks see autograd's saved tensors, checkpoint regions' inputs included; selective checkpointing\n"
          "   keeps its matmul outputs in its own cache, which only the live-tensor count sees)")


if __name__ == "__main__":
    main()
