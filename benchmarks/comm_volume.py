"""Bytes each rank sends per optimizer step, counted at the collectives, beside the published figures.

DDP: a ring all-reduce of the gradients: 2 (p-1)/p x the parameter bytes (Patarasuk & Yuan 2009: "2x").
FSDP: all-gather in forward, all-gather again in backward (reshard after forward), reduce-scatter of the
gradients: 3 (p-1)/p x the parameter bytes (Rajbhandari et al. 2020, ZeRO-3: "about 3x"). One micro-batch per
step here; with gradient accumulation FSDP all-gathers again for every micro-batch.

Context parallelism (`--section cp`), per attention layer and rank, counted around one forward and one
backward of the layer's attention on its local shard (raydist.metrics.comm's formulas beside them):
ring: K/V to the next rank cp-1 times in forward; K/V cp-1 times plus the fp32 dK/dV accumulator cp times
in backward. Ulysses: all-to-all of q, k, v and out, (cp-1)/cp of each, in forward and again in backward.
Then one training step with cp (its FSDP over the cp ranks, the ring's sends) and the activation memory
each rank holds for backward, which falls as 1/cp: every activation is per token, and each rank holds T/cp.

    python benchmarks/comm_volume.py [--section dp|tp|cp|all]

TP (and TP + SP): bytes per transformer block per step, counted at DTensor's collectives as the bytes of a
model with 2 blocks minus those of 1 block, forward and backward apart, beside Megatron's figure
(`metrics.comm.megatron_block_bytes`: 2 all-reduces of the (B, T, D) activations forward, 2 backward;
with SP each becomes a reduce-scatter + an all-gather, the same bytes). "Other" is what a block adds
besides activations: the SP norm-gradient sums and, when num_kv_heads < tp, the replicated kv weights'
gradient sums.

    python benchmarks/comm_volume.py
"""

from __future__ import annotations

import argparse

import torch

from raydist.config import Config
from raydist.metrics.comm import (_FACTORS, CommCounter, megatron_block_bytes, ring_attention_bytes,
                                  ulysses_attention_bytes)
from raydist.parallel.runtime import spawn

WORLD = 4


def _count_on_rank(raw: dict) -> dict:
    from raydist.training.trainer import Trainer

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
    from raydist.training.trainer import Trainer

    out = {}
    for layers in (1, 2):
        trainer = Trainer(Config.from_dict({**raw, "model": {**raw["model"], "num_layers": layers}}),
                          torch.device("cpu"))
        micro = trainer.runner.micro_batches(trainer.next_batch()[0])[0]
        trainer.runner.forward_loss(micro).backward()  # warm-up
        trainer.optimizer.zero_grad(set_to_none=True)
        forward, backward = CommCounter(), CommCounter()
        with forward.patch():
            loss = trainer.runner.forward_loss(micro)
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


def data_parallel_section() -> Config:
    """DDP and FSDP bytes per step against the published figures; returns the config it used."""
    from raydist.driver.launcher import with_prepared_data
    from raydist.models.gpt import param_counts

    cfg = Config.load("workloads/gpt_tiny.toml", ["data.reader=arrow", "train.eval_every=0",
                                                  f"train.micro_batch={16 // WORLD}"])
    cfg = with_prepared_data(cfg)
    param_bytes = 4 * param_counts(cfg.model)["total"]
    p = WORLD
    print(f"parameter bytes (fp32): {param_bytes / 2**20:.3f} MiB, p = {p}\n")
    print(f"{'layout':<8} {'sent MiB/rank/step':>20} {'x param bytes':>14} {'theory':>12}  by collective")
    for name, layout, theory in (("DDP", (p, 1), 2 * (p - 1) / p), ("FSDP", (1, p), 3 * (p - 1) / p)):
        raw = cfg.to_dict()
        raw["parallel"].update(dp_replicate=layout[0], dp_shard=layout[1])
        result = spawn(_count_on_rank, p, raw)[0]
        detail = ", ".join(f"{k} {v / 2**20:.2f} MiB ({result['calls'][k]} calls)" for k, v in result["bytes"].items())
        print(f"{name:<8} {result['total'] / 2**20:>20.3f} {result['total'] / param_bytes:>14.3f} {theory:>12.3f}  {detail}")
    return cfg



# ---- context parallelism --------------------------------------------------------------------------------

CP_DEGREES = (2, 4)


def _attention_layer_on_rank(impl: str, batch: int, heads: int, kv_heads: int, seq_len: int, head_dim: int) -> dict:
    import torch.distributed as dist

    from raydist.metrics.comm import count_attention_layer
    from raydist.models.gpt import sdpa_attention
    from raydist.parallel.context import context_attention

    cp = dist.get_world_size()
    g = torch.Generator().manual_seed(dist.get_rank())
    q = torch.randn(batch, heads, seq_len // cp, head_dim, generator=g)
    k, v = (torch.randn(batch, kv_heads, seq_len // cp, head_dim, generator=g) for _ in range(2))
    return count_attention_layer(context_attention(impl, dist.group.WORLD, sdpa_attention, "torch"), q, k, v)


def _activations_on_rank(raw: dict) -> dict:
    """Bytes held for backward at the end of one forward on this rank's shard (no FSDP: parameters stay
    whole and are excluded), by saved-tensor hooks and by live op outputs."""
    from raydist.parallel.mesh import MeshSpec
    from raydist.metrics.memory import LiveActivations, SavedActivations
    from raydist.models.gpt import build_model
    from raydist.models.loss import cross_entropy

    cfg = Config.from_dict(raw)
    model = build_model(cfg.model, cfg.data.seq_len, seed=0)
    g = torch.Generator().manual_seed(0)  # the same rows on every rank
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.data.seq_len + 1), generator=g)
    inputs, targets, positions = tokens[:, :-1], tokens[:, 1:], None
    if cfg.parallel.cp > 1:
        from raydist.parallel.context import apply_context_parallel

        shard = apply_context_parallel(model, MeshSpec(cp=cfg.parallel.cp).build("cpu"), cfg.parallel.cp_impl)
        inputs, targets, positions = shard(inputs, targets)
    saved = SavedActivations(exclude=model.parameters())
    with saved.hooks(), LiveActivations() as live:
        loss = cross_entropy(model(inputs, positions), targets)
    result = {"saved": saved.live, "live": live.live_bytes(exclude=(loss, *model.parameters(), *model.buffers()))}
    loss.backward()
    return result


def context_parallel_section(seq_len: int) -> None:
    from raydist.driver.launcher import with_prepared_data

    cfg = Config.load("workloads/gpt_tiny.toml", ["data.reader=arrow", "train.eval_every=0", "train.micro_batch=8"])
    m, batch = cfg.model, cfg.train.micro_batch
    head_dim = m.head_size
    print(f"context parallel: bytes sent per rank per attention layer (B={batch}, T={seq_len}, H={m.num_heads}, "
          f"K={m.num_kv_heads}, E={head_dim}, fp32)")
    print(f"  {'impl':<8} {'cp':>3} {'fwd KiB':>9} {'theory':>9} {'bwd KiB':>9} {'theory':>9} {'x local qkv+o':>14}")
    for impl in ("ring", "ulysses"):
        for cp in CP_DEGREES:
            local = seq_len // cp
            counted = spawn(_attention_layer_on_rank, cp, impl, batch, m.num_heads, m.num_kv_heads, seq_len, head_dim)
            worst = {key: max(rank[key] for rank in counted) for key in ("forward", "backward")}
            if impl == "ring":
                theory = ring_attention_bytes(batch, m.num_kv_heads, local, head_dim, cp, 4)
            else:
                theory = ulysses_attention_bytes(batch, m.num_heads, m.num_kv_heads, local, head_dim, cp, 4)
            qkvo = 4 * batch * local * head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
            print(f"  {impl:<8} {cp:>3} {worst['forward'] / 2**10:>9.1f} {theory['forward'] / 2**10:>9.1f} "
                  f"{worst['backward'] / 2**10:>9.1f} {theory['backward'] / 2**10:>9.1f} "
                  f"{(worst['forward'] + worst['backward']) / qkvo:>14.2f}")

    print(f"\none training step, cp=2 (FSDP over the 2 cp ranks), {cfg.model.num_layers} layers, "
          f"{cfg.train.global_batch // batch} micro-batches of {batch} x {cfg.data.seq_len}: MiB sent per rank")
    cfg = with_prepared_data(cfg)
    layers_micro = cfg.model.num_layers * (cfg.train.global_batch // batch)
    for impl in ("ring", "ulysses"):
        raw = cfg.to_dict()
        raw["parallel"].update(dp_replicate=1, dp_shard=1, cp=2, cp_impl=impl)
        result = spawn(_count_on_rank, 2, raw)[0]
        local = cfg.data.seq_len // 2
        if impl == "ring":
            per_layer = ring_attention_bytes(batch, m.num_kv_heads, local, head_dim, 2, 4)
        else:
            per_layer = ulysses_attention_bytes(batch, m.num_heads, m.num_kv_heads, local, head_dim, 2, 4)
        expected = layers_micro * (per_layer["forward"] + per_layer["backward"])
        detail = ", ".join(f"{k} {v / 2**20:.3f}" for k, v in sorted(result["bytes"].items()))
        kind = "send" if impl == "ring" else "all_to_all"
        print(f"  {impl:<8} {detail}   ({kind}: layers x micro-batches x per-layer theory = {expected / 2**20:.3f})")

    print(f"\nactivations held for backward per rank, one micro-batch of {batch} x {seq_len} "
          f"({cfg.model.num_layers} layers, parameters excluded):")
    print(f"  {'impl':<8} {'cp':>3} {'saved MiB':>10} {'live MiB':>9} {'x cp=1':>7} {'1/cp':>6}")
    base = None
    for impl, cp in (("-", 1),) + tuple((impl, cp) for impl in ("ring", "ulysses") for cp in CP_DEGREES):
        raw = cfg.to_dict()
        raw["data"]["seq_len"] = seq_len
        raw["parallel"].update(dp_replicate=1, dp_shard=1, cp=cp, cp_impl="ring" if impl == "-" else impl)
        worst = max(spawn(_activations_on_rank, cp, raw), key=lambda r: r["live"])
        base = base or worst["live"]
        print(f"  {impl:<8} {cp:>3} {worst['saved'] / 2**20:>10.2f} {worst['live'] / 2**20:>9.2f} "
              f"{worst['live'] / base:>7.3f} {1 / cp:>6.3f}")
    print("  (Ulysses keeps one more attention-output-sized tensor per layer: the head-sharded output its\n"
          "   attention saves and the sequence-sharded input of wo after the all-to-all are two tensors, where\n"
          "   the single-process run's sdpa output and wo input share one storage)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=("dp", "tp", "cp", "all"), default="all")
    parser.add_argument("--cp-seq-len", type=int, default=512, help="sequence length of the cp attention and "
                        "activation measurements")
    args = parser.parse_args()
    if args.section in ("dp", "tp", "all"):
        cfg = data_parallel_section()
        if args.section in ("tp", "all"):
            tensor_parallel_section(cfg)
        print()
    if args.section in ("cp", "all"):
        context_parallel_section(args.cp_seq_len)


if __name__ == "__main__":
    main()
