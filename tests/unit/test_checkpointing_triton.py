"""`selective` activation checkpointing on the Triton path keeps the Triton kernels' outputs.

The kernels are torch custom operators (raydist::matmul, raydist::swiglu, raydist::flash_attention), so the
selective policy sees them as it sees aten.mm: their outputs are cached in forward and the kernels are not
re-run in backward, and the memory held for backward lies strictly between `none` and `full`. Runs the
kernels through Triton's CPU interpreter (TRITON_INTERPRET=1) on a small model.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from raydist.config import KernelsConfig, ModelConfig
from raydist.kernels import apply_kernels, runtime
from raydist.metrics.memory import LiveActivations
from raydist.models.gpt import build_model
from raydist.models.loss import cross_entropy
from raydist.parallel.checkpointing import apply_activation_checkpointing, keeps

pytestmark = pytest.mark.skipif(runtime.triton_import_error() is not None,
                                reason=f"triton not importable: {runtime.triton_import_error()}")
TINY = ModelConfig(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, ffn_hidden=176, vocab_size=128)


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def kernel_modules():
    """raydist.kernels.attention and .matmul (the package's `matmul` attribute is the function)."""
    return importlib.import_module("raydist.kernels.attention"), importlib.import_module("raydist.kernels.matmul")


def test_policy_keeps_the_triton_operators():
    attention, matmul = kernel_modules()

    assert keeps(attention.FLASH_ATTENTION_OP)
    assert all(keeps(op) for op in matmul.MATMUL_OPS)
    assert keeps(torch.ops.aten.mm.default) and not keeps(torch.ops.aten.mul.Tensor)
    assert not keeps(torch.ops.raydist.flash_attention_backward.default)


def run(policy: str, monkeypatch) -> tuple[float, dict, int, dict]:
    """(loss, gradients, bytes held for backward at the end of forward, kernel forward launches in forward
    and in backward)."""
    attention, matmul = kernel_modules()

    launches = {"attention": 0, "matmul": 0}
    real_attention, real_launch, real_plain = attention.attention_forward, matmul._launch, matmul._plain

    def counted_attention(*args, **kwargs):
        launches["attention"] += 1
        return real_attention(*args, **kwargs)

    def counted_launch(*args, **kwargs):
        launches["matmul"] += 1
        return real_launch(*args, **kwargs)

    def counted_plain(*args):  # the backward's gradient products: not forward launches
        launches["matmul"] -= 1
        return real_plain(*args)

    monkeypatch.setattr(attention, "attention_forward", counted_attention)
    monkeypatch.setattr(matmul, "_launch", counted_launch)
    monkeypatch.setattr(matmul, "_plain", counted_plain)
    model = build_model(TINY, 16, seed=0)
    assert apply_kernels(model, KernelsConfig("triton", "triton"), "cpu") == {"attention": "triton",
                                                                              "matmul": "triton", "loss": "fused"}
    apply_activation_checkpointing(model, policy)
    tokens = torch.randint(0, TINY.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3))
    with LiveActivations() as live:
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    held = live.live_bytes(exclude=(loss, *model.parameters(), *model.buffers()))
    forward = dict(launches)
    loss.backward()
    calls = {"forward_attention": forward["attention"], "forward_matmul": forward["matmul"],
             "backward_attention_forwards": launches["attention"] - forward["attention"],
             "backward_matmul_forwards": launches["matmul"] - forward["matmul"]}
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, held, calls


def test_selective_keeps_triton_outputs_between_none_and_full(monkeypatch):
    ref_loss, ref_grads, none_held, none_calls = run("none", monkeypatch)
    results = {policy: run(policy, monkeypatch) for policy in ("full", "selective")}
    for policy, (loss, grads, _, _) in results.items():
        assert loss == ref_loss, policy
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7,
                                       msg=lambda m, n=name, p=policy: f"{p}: gradient of {n}: {m}")
    full_held, sel_held = results["full"][2], results["selective"][2]
    assert full_held < sel_held < none_held, (full_held, sel_held, none_held)
    layers = TINY.num_layers
    per_block = 5  # wq, wk, wv, wo, w2 (w1 and w3 are one fused SwiGLU launch)
    forward = {"forward_attention": layers, "forward_matmul": layers * (per_block + 1) + 1}  # + the head
    assert none_calls == {**forward, "backward_attention_forwards": 0, "backward_matmul_forwards": 0}
    # full recomputes every block in backward: each block's forward kernels run again
    assert results["full"][3] == {**forward, "backward_attention_forwards": layers,
                                  "backward_matmul_forwards": layers * (per_block + 1)}
    # selective replays the blocks from its cache: the kernels' outputs are reused, no kernel runs again
    assert results["selective"][3] == {**forward, "backward_attention_forwards": 0, "backward_matmul_forwards": 0}
