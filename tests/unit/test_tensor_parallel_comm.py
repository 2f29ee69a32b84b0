"""Tensor-parallel communication counted at DTensor's collectives against Megatron's figure (2 gloo ranks).

Bytes per transformer block = (bytes with 2 blocks) - (bytes with 1 block), for one micro-batch's
forward and backward, so the embedding, head and loss cancel out."""

import pytest
import torch

from raydist.config import Config
from raydist.metrics.comm import CommCounter, megatron_block_bytes, sp_norm_gradient_bytes
from raydist.parallel.runtime import spawn
from raydist.testing import TINY_MODEL, tiny_config

TP = 2
MICRO = 2


def _count(raw: dict) -> dict:
    """{layers: {"forward"/"backward": {(kind, payload bytes): bytes sent}}} on this rank."""
    from torch.distributed.tensor import DTensor

    from raydist.training.trainer import Trainer

    out = {}
    for layers in (1, 2):
        cfg = Config.from_dict({**raw, "model": {**raw["model"], "num_layers": layers}})
        trainer = Trainer(cfg, torch.device("cpu"))
        micro = trainer.runner.micro_batches(trainer.next_batch()[0])[0]
        trainer.runner.forward_loss(micro).backward()  # warm-up (lazy initialisation)
        trainer.optimizer.zero_grad(set_to_none=True)
        phases = {}
        forward, backward = CommCounter(), CommCounter()
        with forward.patch():
            loss = trainer.runner.forward_loss(micro)
        with backward.patch():
            loss.backward()
        for phase, counter in (("forward", forward), ("backward", backward)):
            phases[phase] = {key: calls for key, calls in counter.sizes.items()}
        # without FSDP every gradient ends up in its parameter's layout (norm sums done in backward)
        for name, param in trainer.pm.model.named_parameters():
            assert isinstance(param.grad, DTensor) and param.grad.placements == param.placements, name
        trainer.close()
        out[layers] = phases
    return out


def _bytes(sizes: dict, keep) -> dict:
    """{kind: bytes one rank sends} over the (kind, payload) entries that `keep(payload)` selects."""
    from raydist.metrics.comm import _FACTORS

    totals: dict = {}
    for (kind, payload), calls in sizes.items():
        if keep(payload):
            totals[kind] = totals.get(kind, 0.0) + calls * _FACTORS[kind](TP) * payload
    return totals


@pytest.fixture(scope="module")
def counts(tiny_data):
    out = {}
    for sp in (False, True):
        raw = tiny_config(tiny_data, train={"micro_batch": MICRO, "global_batch": MICRO},
                          parallel={"tp": TP, "dp_replicate": 1, "sequence_parallel": sp})
        out[sp] = spawn(_count, TP, raw)[0]
    return out


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_block_bytes_match_megatron(counts, sp):
    d, seq = TINY_MODEL["d_model"], 32
    activation = MICRO * seq * d * 4  # (B, T, D) fp32
    expected = megatron_block_bytes(MICRO, seq, d, TP, sp)
    per_block = {}
    for phase in ("forward", "backward"):
        one, two = (_bytes(counts[sp][n][phase], lambda p: p == activation) for n in (1, 2))
        per_block[phase] = {k: two.get(k, 0.0) - one.get(k, 0.0) for k in set(one) | set(two)}
        # Megatron: half of the block's activation traffic in forward, half in backward
        assert per_block[phase] == pytest.approx({k: v / 2 for k, v in expected.items()}, rel=0, abs=0), phase
    # everything else a block adds: nothing without SP; the two norm-gradient sums with SP
    other = 0.0
    for phase in ("forward", "backward"):
        one, two = (_bytes(counts[sp][n][phase], lambda p: p != activation) for n in (1, 2))
        other += sum(two.values()) - sum(one.values())
    assert other == (sp_norm_gradient_bytes(d, TP) if sp else 0.0)


def test_loss_never_gathers_the_logits(counts):
    """The largest collective of the whole model is one (B, T, D) activation; the logits (B, T, V/tp per
    rank) never move: the loss moves 3 numbers per token."""
    activation = MICRO * 32 * TINY_MODEL["d_model"] * 4
    for sp in (False, True):
        for phase in ("forward", "backward"):
            payloads = [payload for _, payload in counts[sp][2][phase]]
            assert max(payloads) == activation, (sp, phase, sorted(set(payloads)))
    tokens = MICRO * 32
    loss_collectives = {key: calls for key, calls in counts[False][2]["forward"].items() if key[1] != activation}
    # the row max, then (sum of exp, target logit) together
    assert loss_collectives == {("all_reduce", 4 * tokens): 1, ("all_reduce", 4 * 2 * tokens): 1}
