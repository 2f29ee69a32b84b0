"""Activation checkpointing policies: same gradients as no checkpointing, less memory held for backward."""

import torch

from raydist.config import ModelConfig
from raydist.metrics.memory import LiveActivations, SavedActivations
from raydist.models.gpt import build_model
from raydist.models.loss import cross_entropy
from raydist.parallel.checkpointing import apply_activation_checkpointing, segment_size

CFG = ModelConfig(num_layers=4, d_model=64, num_heads=4, num_kv_heads=2, ffn_hidden=128, vocab_size=96)


def run(policy):
    model = build_model(CFG, 32, seed=0)
    apply_activation_checkpointing(model, policy)
    tokens = torch.randint(0, 96, (4, 33), generator=torch.Generator().manual_seed(0))
    saved = SavedActivations(exclude=model.parameters())
    with saved.hooks(), LiveActivations() as live:
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    held = live.live_bytes(exclude=(loss, *model.parameters(), *model.buffers()))
    hooked = saved.live
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, held, hooked


def test_sqrt_rule_segment():
    assert segment_size("every_k", 16) == 4 and segment_size("every_k", 4) == 2
    assert segment_size("every_k", 16, k=3) == 3 and segment_size("full", 16) == 1


def test_policies_keep_gradients_and_cut_memory():
    ref_loss, ref_grads, none_held, none_hooked = run("none")
    assert abs(none_held - none_hooked) / none_held < 0.01  # two measurements of the same thing agree
    held = {}
    for policy in ("full", "every_k", "selective"):
        loss, grads, held[policy], _ = run(policy)
        assert loss == ref_loss
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7)
    # every_k keeps L/k block inputs, full keeps L, selective also keeps the matmul outputs
    assert held["every_k"] < held["full"] < held["selective"] < none_held
