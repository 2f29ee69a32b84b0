"""Bytes context parallelism sends, counted at the communication calls (batch_isend_irecv's sends and
all_to_all_single), against raydist.metrics.comm's per-layer figures: one attention layer alone, and a whole
training step (every layer, every micro-batch, nothing else sent point-to-point)."""

import pytest
import torch
import torch.distributed as dist

from raydist.config import Config
from raydist.metrics.comm import CommCounter, count_attention_layer, ring_attention_bytes, ulysses_attention_bytes
from raydist.parallel.runtime import spawn
from raydist.testing import tiny_config


def _layer_bytes(impl, batch, heads, kv_heads, local_tokens, head_dim):
    from raydist.models.gpt import sdpa_attention
    from raydist.parallel.context import context_attention

    g = torch.Generator().manual_seed(dist.get_rank())
    q = torch.randn(batch, heads, local_tokens, head_dim, generator=g)
    k, v = (torch.randn(batch, kv_heads, local_tokens, head_dim, generator=g) for _ in range(2))
    return count_attention_layer(context_attention(impl, dist.group.WORLD, sdpa_attention, "torch"), q, k, v)


@pytest.mark.parametrize("impl,cp,kv_heads", [("ring", 2, 2), ("ring", 3, 1), ("ulysses", 2, 2), ("ulysses", 2, 1)],
                         ids=["ring-cp2", "ring-cp3", "ulysses-cp2", "ulysses-cp2-kv-repeated"])
def test_attention_layer_sends_the_predicted_bytes(impl, cp, kv_heads):
    batch, heads, local_tokens, head_dim = 2, 4, 6, 8
    if impl == "ring":
        expected = ring_attention_bytes(batch, kv_heads, local_tokens, head_dim, cp, dtype_bytes=4)
    else:
        expected = ulysses_attention_bytes(batch, heads, kv_heads, local_tokens, head_dim, cp, dtype_bytes=4)
    for counted in spawn(_layer_bytes, cp, impl, batch, heads, kv_heads, local_tokens, head_dim):
        assert counted == pytest.approx(expected, rel=1e-12), (counted, expected)
    kv = 2 * batch * kv_heads * local_tokens * head_dim * 4
    if impl == "ring":  # K/V cp-1 times forward; K/V cp-1 times and fp32 dK/dV cp times backward
        assert expected == {"forward": (cp - 1) * kv, "backward": (2 * cp - 1) * kv}


def _step_bytes(raw):
    from raydist.training.trainer import Trainer

    trainer = Trainer(Config.from_dict(raw), torch.device("cpu"))
    trainer.train_step()
    counter = CommCounter()
    batch = trainer.next_batch()
    with counter.patch():
        trainer.train_step(batch)
    trainer.close()
    return dict(counter.bytes)


@pytest.mark.parametrize("impl", ["ring", "ulysses"])
def test_training_step_sends_the_attention_bytes_of_every_layer_and_micro_batch(tiny_data, impl):
    raw = tiny_config(tiny_data, parallel={"cp": 2, "cp_impl": impl}, train={"micro_batch": 4})  # 2 micro-batches
    cfg = Config.from_dict(raw)
    m = cfg.model
    head_dim, local = m.head_size, cfg.data.seq_len // 2
    if impl == "ring":
        layer = ring_attention_bytes(4, m.num_kv_heads, local, head_dim, 2, 4)
    else:
        layer = ulysses_attention_bytes(4, m.num_heads, m.num_kv_heads, local, head_dim, 2, 4)
    expected = m.num_layers * 2 * (layer["forward"] + layer["backward"])
    for counted in spawn(_step_bytes, 2, raw):
        assert counted["send" if impl == "ring" else "all_to_all"] == expected
        assert ("all_to_all" if impl == "ring" else "send") not in counted
        assert counted["reduce_scatter"] > 0  # FSDP over the cp ranks averages their gradients
