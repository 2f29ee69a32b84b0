"""Bytes each rank sends per optimizer step, counted at the collectives, beside the seed's figures.

DDP: a ring all-reduce of the gradients: 2 (p-1)/p x the parameter bytes (seed 001/003: "2x").
FSDP: all-gather in forward, all-gather again in backward (reshard after forward), reduce-scatter of
the gradients: 3 (p-1)/p x the parameter bytes (seed 003: "about 3x"). One micro-batch per step here;
with gradient accumulation FSDP all-gathers again for every micro-batch.

TP (and TP + SP): bytes per transformer block per step, counted at DTensor's collectives as the bytes of a
model with 2 blocks minus those of 1 block, forward and backward apart, beside Megatron's figure
(`metrics.comm.megatron_block_bytes`: 2 all-reduces of the (B, T, D) activations forward, 2 backward;
with SP each becomes a reduce-scatter + an all-gather, the same bytes). "Other" is what a block adds
besides activations: the SP norm-gradient sums and, when num_kv_heads < tp, the replicated kv weights'
gradient sums.

    python benchmarks/comm_volume.py
"""

from __future__ import annotations

import torch

from raydist.config import Config
from raydist.metrics.comm import _FACTORS, CommCounter, megatron_block_bytes
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


def _tp_phases_on_rank(raw: dict) -> dict:
    """{num_layers: {"forward"/"backward": {(kind, payload bytes): calls}}} for one micro-batch."""
    from raydist.trainer import Trainer

    out = {}
    for layers in (1, 2):
        trainer = Trainer(Config.from_dict({**raw, "model": {**raw["model"], "num_layers": layers}}),
                          torch.device("cpu"))
        micro = trainer._micro_batches(trainer.next_batch()[0])[0]
        trainer.forward_loss(micro).backward()  # warm-up
        trainer.optimizer.zero_grad(set_to_none=True)
        forward, backward = CommCounter(), CommCounter()
        with forward.patch():
            loss = trainer.forward_loss(micro)
        with backward.patch():
            loss.backward()
        out[layers] = {"forward": dict(forward.sizes), "backward": dict(backward.sizes)}
        trainer.close()
    return out


def _sent(sizes: dict, p: int, activation: bool, n: int) -> dict:
    totals: dict = {}
    for (kind, payload), calls in sizes.items():
        if (payload == n) == activation:
            totals[kind] = totals.get(kind, 0.0) + calls * _FACTORS[kind](p) * payload
    return totals


def tensor_parallel_section(cfg: Config) -> None:
    m = cfg.model
    micro, seq = cfg.train.global_batch, cfg.data.seq_len  # dp = 1: one micro-batch per step
    n = micro * seq * m.d_model * 4
    print(f"\ntensor parallel: bytes per transformer block per step, one rank (micro-batch {micro} x seq {seq} x "
          f"d_model {m.d_model}, fp32: activation n = {n / 2**20:.3f} MiB)")
    print(f"{'layout':<8} {'fwd MiB':>8} {'bwd MiB':>8} {'total':>8} {'Megatron':>9} {'ratio':>6} {'other MiB':>10}"
          "  by collective (activations)")
    for p in (2, 4):
        for sp in (False, True):
            raw = cfg.to_dict()
            raw["parallel"].update(dp_replicate=1, dp_shard=1, tp=p, sequence_parallel=sp)
            raw["train"].update(micro_batch=micro)
            phases = spawn(_tp_phases_on_rank, p, raw)[0]
            block, other = {}, 0.0
            for phase in ("forward", "backward"):
                one, two = (_sent(phases[k][phase], p, True, n) for k in (1, 2))
                block[phase] = {k: two.get(k, 0.0) - one.get(k, 0.0) for k in set(one) | set(two)}
                other += sum(_sent(phases[2][phase], p, False, n).values()) - sum(
                    _sent(phases[1][phase], p, False, n).values())
            fwd, bwd = (sum(block[ph].values()) for ph in ("forward", "backward"))
            megatron = sum(megatron_block_bytes(micro, seq, m.d_model, p, sp).values())
            kinds = {k: block["forward"].get(k, 0.0) + block["backward"].get(k, 0.0)
                     for k in set(block["forward"]) | set(block["backward"])}
            detail = ", ".join(f"{k} {v / 2**20:.3f}" for k, v in sorted(kinds.items()))
            name = f"TP{p}" + ("+SP" if sp else "")
            print(f"{name:<8} {fwd / 2**20:>8.3f} {bwd / 2**20:>8.3f} {(fwd + bwd) / 2**20:>8.3f} "
                  f"{megatron / 2**20:>9.3f} {(fwd + bwd) / megatron:>6.3f} {other / 2**20:>10.4f}  {detail}")


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
    tensor_parallel_section(cfg)


if __name__ == "__main__":
    main()
