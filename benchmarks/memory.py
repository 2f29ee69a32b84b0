"""Per-rank training-state bytes under DDP, FSDP and HSDP, and saved-activation bytes per checkpointing
policy, measured from the tensors each rank holds, beside the published figures.

State (4 gloo ranks, the default workload's model): parameters + gradients + AdamW moments, counted
from local tensors (`raydist.metrics.memory.state_bytes`) after an optimizer step with gradients
present. 16N bytes per replica in fp32 with Adam (4 + 4 + 8: the 16N of Rajbhandari et al. 2020, ZeRO);
fully sharded over p ranks, 16N/p.

Activations (one process): bytes held for backward at the end of forward, counted two ways: with saved-tensor
hooks (`SavedActivations`; checkpointed regions report the input they keep) and as the op outputs still alive
(`LiveActivations`, which also sees selective checkpointing's cache). Expected (Chen et al. 2016): `full`
keeps one input per block, `every_k` one per k-block segment (the sqrt(n) rule) plus one segment recomputed at
a time in backward, `selective` drops the cheap elementwise outputs.

The activation table is measured on both kernel paths: torch (sdpa, nn.Linear: aten ops) and Triton
(raydist's kernels, torch custom operators the selective policy keeps). `selective` must land strictly
between `none` and `full` on both. The Triton path runs compiled on CUDA when there is a GPU; on a CPU
machine it runs through Triton's interpreter (TRITON_INTERPRET=1), on a small model only (2 blocks,
d_model 64, seq 32), and says so.

    python benchmarks/memory.py [--layers 16] [--skip-state]
"""

from __future__ import annotations

import argparse
import os

import torch

from raydist.config import Config
from raydist.metrics.memory import LiveActivations, SavedActivations, state_bytes
from raydist.parallel.runtime import spawn

LAYOUTS = {"DDP 4": (4, 1), "FSDP 4": (1, 4), "HSDP 2x2": (2, 2)}


def _state_on_rank(raw: dict) -> dict:
    from raydist.training.trainer import Trainer

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


def measure_activations(cfg: Config, policy: str, batch: int, kernels: tuple[str, str] | None = None,
                        device: str = "cpu") -> tuple[int, int]:
    """(saved-tensor-hook bytes, live bytes) held for backward at the end of forward; `kernels` =
    (attention, matmul) installs that kernel choice first (e.g. ("triton", "triton"))."""
    from raydist.config import KernelsConfig
    from raydist.kernels import apply_kernels
    from raydist.models.gpt import build_model
    from raydist.models.loss import cross_entropy
    from raydist.parallel.checkpointing import apply_activation_checkpointing

    model = build_model(cfg.model, cfg.data.seq_len, seed=0, device=device)
    if kernels is not None:
        apply_kernels(model, KernelsConfig(*kernels), device)
    saved = SavedActivations(exclude=model.parameters())
    apply_activation_checkpointing(model, policy, 0)
    tokens = torch.randint(0, cfg.model.vocab_size, (batch, cfg.data.seq_len + 1)).to(device)
    with saved.hooks(), LiveActivations() as live:
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    result = saved.live, live.live_bytes(exclude=(loss, *model.parameters(), *model.buffers()))
    loss.backward()
    return result


POLICIES = ("none", "full", "every_k", "selective")


def activation_table(cfg: Config, batch: int, kernels: tuple[str, str] | None, device: str) -> dict[str, int]:
    """Prints one row per policy; returns the live bytes by policy."""
    print(f"  {'policy':<10} {'saved-tensor hooks':>19} {'live tensors':>13} {'of none':>8}")
    live_by_policy = {}
    for policy in POLICIES:
        hooked, live = measure_activations(cfg, policy, batch, kernels, device)
        live_by_policy[policy] = live
        base = live_by_policy["none"]
        print(f"  {policy:<10} {hooked / 2**20:>15.3f} MiB {live / 2**20:>9.3f} MiB {live / base:>8.3f}")
    full, selective, none = (live_by_policy[p] for p in ("full", "selective", "none"))
    verdict = "yes" if full < selective < none else "NO: selective is not between full and none"
    print(f"  selective strictly between full and none: {verdict}")
    return live_by_policy


def triton_activations() -> dict[str, int] | None:
    """The activation table on the Triton kernels: compiled on CUDA at the workload's shape, else through
    the interpreter on a small model; None when Triton is not importable."""
    from raydist.kernels import runtime

    if runtime.triton_import_error() is not None:
        print(f"\nTriton path skipped: triton is not importable ({runtime.triton_import_error()})")
        return None
    if torch.cuda.is_available():
        cfg = Config.load("workloads/gpt_tiny.toml")  # head dim 32: a size the Triton attention supports
        device, batch = "cuda", 8
        print(f"\nactivations on the Triton path (compiled, {torch.cuda.get_device_name()}), "
              f"{cfg.model.num_layers} blocks, batch {batch} x seq {cfg.data.seq_len}, fp32:")
    else:
        os.environ["TRITON_INTERPRET"] = "1"
        cfg = Config.load("workloads/gpt_tiny.toml", ["model.num_layers=2", "model.d_model=64", "model.num_heads=4",
                                                      "model.ffn_hidden=176", "data.seq_len=32"])
        device, batch = "cpu", 2
        print(f"\nactivations on the Triton path: NO CUDA device, so the Triton kernels run on CPU through "
              f"Triton's interpreter (TRITON_INTERPRET=1) on a small model only ({cfg.model.num_layers} blocks, "
              f"d_model {cfg.model.d_model}, batch {batch} x seq {cfg.data.seq_len}); bytes are exact, time is "
              "meaningless:")
    return activation_table(cfg, batch, ("triton", "triton"), device)


def state_table(cfg: Config) -> None:
    from raydist.models.gpt import param_counts

    n = param_counts(cfg.model)["total"]
    print(f"model: {n / 1e6:.3f} M parameters; ZeRO's 16N = {16 * n / 2**20:.2f} MiB per full replica\n")
    print(f"{'layout':<10} {'params':>10} {'grads':>10} {'optim':>10} {'total MiB':>10} {'16N/p MiB':>9} {'ratio':>7}")
    for name, (rep, shard) in LAYOUTS.items():
        per_rank = measure_state(cfg, (rep, shard))
        worst = max(per_rank, key=lambda r: r["total"])
        zero = 16 * n / shard
        print(f"{name:<10} {worst['params'] / 2**20:>10.3f} {worst['grads'] / 2**20:>10.3f} "
              f"{worst['optimizer'] / 2**20:>10.3f} {worst['total'] / 2**20:>10.3f} {zero / 2**20:>9.3f} "
              f"{worst['total'] / zero:>7.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16, help="blocks for the activation measurement")
    parser.add_argument("--skip-state", action="store_true", help="only the activation tables (no processes)")
    args = parser.parse_args()
    if not args.skip_state:
        from raydist.driver.launcher import with_prepared_data

        state_table(with_prepared_data(Config.load("workloads/gpt_tiny.toml", ["data.reader=arrow", "train.eval_every=0"])))
    act_cfg = Config.load("workloads/gpt_tiny.toml", [f"model.num_layers={args.layers}"])
    print(f"\nactivations held for backward at the end of forward, torch path (sdpa, nn.Linear), {args.layers} "
          f"blocks, batch 8 x seq {act_cfg.data.seq_len}:")
    activation_table(act_cfg, 8, ("sdpa", "torch"), "cpu")
    triton_activations()
    print("  (hooks see autograd's saved tensors, checkpoint regions' inputs included; selective checkpointing\n"
          "   keeps its matmul and attention outputs in its own cache, which only the live-tensor count sees)")


if __name__ == "__main__":
    main()
