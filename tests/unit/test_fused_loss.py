"""The fused loss (models.loss.linear_cross_entropy): the head's matmul and the cross-entropy chunk by chunk of
tokens. Against the plain path (F.linear, then loss.cross_entropy) in fp32: the same loss and the same
gradients of the hidden states and of the head's weight (1e-5), with chunks that do not divide the tokens,
IGNORE targets, a frozen weight and bf16 autocast; without the (N, V) logits (peak memory); and in the
training step where the layout allows it, to which the plain path stays equal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raydist.metrics.memory import LiveActivations
from raydist.models.loss import IGNORE, TORCH_CHUNKS, _LinearCrossEntropy, cross_entropy, linear_cross_entropy


def inputs(b=3, t=7, d=16, v=50, seed=0, ignore=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, t, d, generator=g, dtype=torch.float64).float().requires_grad_()
    w = (torch.randn(v, d, generator=g) / d ** 0.5).requires_grad_()
    targets = torch.randint(0, v, (b, t), generator=g)
    if ignore:
        targets[0, :3] = IGNORE  # a prompt's tokens
        targets[2, -1] = IGNORE
    return h, w, targets


def plain(h, w, targets):
    return cross_entropy(F.linear(h, w), targets)


def grads(loss_fn, h, w, targets):
    h, w = h.detach().clone().requires_grad_(h.requires_grad), w.detach().clone().requires_grad_(w.requires_grad)
    loss = loss_fn(h, w, targets)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def close(a, b, rtol=1e-5):
    assert (a - b).abs().max().item() <= rtol * b.abs().max().item(), (a - b).abs().max().item()


@pytest.mark.parametrize("rows", [1, 4, 5, 21, 1000])  # one token, dividing, not dividing 21, one chunk
def test_equals_the_plain_loss_and_its_gradients(rows):
    h, w, targets = inputs()
    want, got = grads(plain, h, w, targets), grads(lambda *a: linear_cross_entropy(*a, rows=rows), h, w, targets)
    for a, b in zip(got, want):
        close(a, b)
    assert got[1][0, :3].abs().max() == 0  # an IGNORE target's token gets no gradient


def test_a_frozen_head_and_every_target_ignored():
    h, w, targets = inputs()
    w.requires_grad_(False)
    loss, dh, dw = grads(lambda *a: linear_cross_entropy(*a, rows=4), h, w, targets)
    _, want_dh, _ = grads(plain, h, w, targets)
    assert dw is None
    close(dh, want_dh)
    none = torch.full_like(targets, IGNORE)
    loss, dh, _ = grads(lambda *a: linear_cross_entropy(*a, rows=4), h, w, none)
    assert loss.item() == 0 and dh.abs().max() == 0


def test_under_bf16_autocast_the_matmuls_run_as_f_linears_would():
    h, w, targets = inputs(d=32, v=64, ignore=False)

    def under_autocast(fn):
        def run(*a):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(*a)
        return run

    want = grads(under_autocast(plain), h, w, targets)
    got = grads(under_autocast(lambda *a: linear_cross_entropy(*a, rows=5)), h, w, targets)
    assert got[1].dtype == torch.float32 and got[2].dtype == torch.float32  # (the fp32 master weight's)
    for a, b in zip(got, want):
        close(a, b, rtol=2e-2)  # bf16 products; the plain loss's own gap to fp32 is of this size
    fp32 = grads(plain, h, w, targets)
    assert (got[0] - fp32[0]).abs() > 0  # the matmul did run in bf16


def test_a_planted_chunk_bug_is_caught():
    """The same comparison fails when the backward skips the last partial chunk (one token of 21)."""
    h, w, targets = inputs(ignore=False)

    class Skipping(_LinearCrossEntropy):
        @staticmethod
        def backward(ctx, grad):
            dh, dw, *_ = _LinearCrossEntropy.backward(ctx, grad)
            dh[-(dh.shape[0] % ctx.rows):] = 0
            return dh, dw, None, None, None, None, None

    want = grads(plain, h, w, targets)
    got = grads(lambda h, w, t: Skipping.apply(h.flatten(0, 1), w, t.flatten(0, 1), 5, 0, None, TORCH_CHUNKS),
                h, w, targets)
    with pytest.raises(AssertionError):
        close(got[1].view_as(want[1]), want[1])


def test_peak_memory_holds_a_chunk_not_the_logits():
    """V = 8192, 1024 tokens: fp32 logits of 32 MiB. The plain loss holds them and more; the fused one a
    chunk of 64 tokens (2 MiB) at a time, besides the weight's gradient (V x D) and dh (N x D)."""
    h, w, targets = inputs(b=1, t=1024, d=64, v=8192, ignore=False)
    logits_mib = 1024 * 8192 * 4 / 2**20
    peaks = {}
    for name, fn in (("plain", plain), ("fused", lambda *a: linear_cross_entropy(*a, rows=64))):
        hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        with LiveActivations(track_peak=True) as live:
            fn(hh, ww, targets).backward()
        peaks[name] = live.peak_bytes / 2**20
    assert peaks["plain"] > 2 * logits_mib, peaks
    grads_mib = (8192 * 64 + 1024 * 64) * 4 / 2**20
    assert peaks["fused"] < grads_mib + logits_mib / 4, peaks


# ---- in training ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("parallel, world, tied", [
    ({}, 1, True),
    ({"dp_shard": 2}, 2, False),  # the untied head is an FSDP unit of its own: its weight gathered in its forward
    ({"dp_replicate": 2}, 2, True),  # DDP
    ({"cp": 2}, 2, False),
    ({"tp": 2}, 2, True),  # vocabulary-parallel: the tied head shares the embedding's Shard(0) rows
    ({"tp": 2, "sequence_parallel": True}, 2, False),  # dh reduce-scattered back to the sequence shards
    ({"pp": 2, "pp_schedule": "1f1b"}, 2, True),  # the last stage's head: a copy of the embedding
    ({"pp": 2, "pp_schedule": "zbh1", "tp": 2, "sequence_parallel": True}, 4, False),  # B: dh, W: dW
], ids=["single", "fsdp2-untied", "ddp2", "cp2-untied", "tp2", "tp2-sp-untied", "pp2-1f1b", "pp2xtp2-sp-zbh1"])
def test_training_with_the_fused_loss_equals_the_plain_loss(tiny_data, parallel, world, tied):
    """kernels.loss = auto (fused) in each layout against the single process with the plain loss: losses
    and gradient norms every step, gradients before clipping and parameters after the last step on every
    rank (raydist.testing.assert_equivalent); the ranks holding the head ran the fused loss, every time."""
    from raydist.testing import assert_equivalent, run_layout, tiny_config

    def run(loss, parallel, world):
        raw = tiny_config(tiny_data, model={"tie_embeddings": tied}, kernels={"loss": loss},
                          parallel={"dp_replicate": 1, **parallel}, train={"steps": 4})
        return run_layout(raw, world, steps=4)

    [plain_single] = run("plain", {}, 1)
    assert "loss" not in plain_single.kernels
    ranks = run("auto", parallel, world)
    for rank in ranks:
        assert_equivalent(plain_single, rank)
    heads = [rank.kernels["loss"] for rank in ranks if "loss" in rank.kernels]
    assert heads and all(set(ran) == {"fused"} for ran in heads), [rank.kernels for rank in ranks]
    assert len(heads) == world // parallel.get("pp", 1)  # the last stage's ranks, every one of them


def test_the_fused_loss_is_what_runs_where_the_layout_allows_it():
    """ParallelModel.fused_loss: the default head (TorchLinear), not with kernels.loss = plain or a head of
    another class; the model's forward with targets is its loss."""
    from raydist.kernels.select import install_torch_matmul
    from raydist.models.gpt import build_model
    from raydist.parallel.layout import Layout
    from raydist.parallel.parallelize import parallelize
    from raydist.config_sections import ModelConfig

    class Mesh:  # (a single process's: parallelize asks the mesh nothing without TP, CP or a data-parallel wrap)
        pass

    def pm(fused, install=True):
        model = build_model(ModelConfig(num_layers=1, d_model=32, num_heads=2, num_kv_heads=1, ffn_hidden=64,
                                        vocab_size=64), 16, seed=0)
        if install:
            install_torch_matmul(model)
        return parallelize(model, Mesh(), Layout.of(), torch.device("cpu"), fused_loss=fused)

    assert pm(True).fused_loss and not pm(False).fused_loss and not pm(True, install=False).fused_loss
    model = pm(True)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    want = cross_entropy(model.module(tokens[:, :-1]), tokens[:, 1:])
    got = model.loss(tokens[:, :-1], None, tokens[:, 1:])
    close(got, want)


def test_a_split_backward_computes_each_gradient_once():
    """Zero-bubble's B (the input's gradient) and W (the weights') through the fused loss: B computes dh and
    not dW, W dW and not dh (`split_backward.wanted`); together one matmul more per chunk than a plain
    backward (the chunk's logits, recomputed by each), not the two wasted products of a backward that
    computes every gradient each time. The gradients equal the plain backward's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from raydist.schedule.split_backward import backward_input, backward_weight

    class CountMatmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(1)
    a0, w0 = torch.randn(8, 16, generator=g), torch.randn(50, 16, generator=g)
    x = torch.randn(21, 8, generator=g)
    targets = torch.randint(0, 50, (1, 21), generator=g)

    def forward():
        a, w = a0.clone().requires_grad_(), w0.clone().requires_grad_()
        xi = x.clone().requires_grad_()
        return a, w, xi, linear_cross_entropy((xi @ a)[None], w, targets, rows=5)  # 5 chunks

    a, w, xi, loss = forward()
    with CountMatmuls() as plain_count:
        loss.backward()
    want = (xi.grad, a.grad, w.grad)
    a, w, xi, loss = forward()
    with CountMatmuls() as b_count:
        dx, pending = backward_input(loss, None, xi)
    assert a.grad is None and w.grad is None
    with CountMatmuls() as w_count:
        backward_weight(pending)
    for got, expected in zip((dx, a.grad, w.grad), want):
        close(got, expected)
    assert b_count.count + w_count.count == plain_count.count + 5, (plain_count.count, b_count.count, w_count.count)


# ---- the chunks' elementwise work in Triton (kernels.loss = triton; the interpreter on CPU) ---------------

needs_triton = pytest.mark.skipif(__import__("raydist.kernels.runtime", fromlist=["x"]).triton_import_error()
                                  is not None, reason="triton is not importable here")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_chunk_kernels_equal_torchs(monkeypatch, dtype):
    """row_stats and softmax_grad_ against models.loss's torch chunk ops on 7 rows of V = 200 (not a multiple
    of the kernel's column block), targets held and not held, a row that does not count (scale 0)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from raydist.kernels.cross_entropy import TRITON_CHUNKS

    g = torch.Generator().manual_seed(3)
    z = (4 * torch.randn(7, 200, generator=g)).to(dtype)
    index = torch.randint(0, 200, (7,), generator=g)
    hit = torch.tensor([1, 1, 0, 1, 0, 1, 1], dtype=torch.bool)
    scale = torch.tensor([0.1, 0.2, 0.1, 0.0, 0.3, 0.1, 0.05])
    lse, picked = TRITON_CHUNKS.stats(z.clone(), index)
    want_lse, want_picked = TORCH_CHUNKS.stats(z.clone(), index)
    close(lse, want_lse, rtol=1e-6)
    close(picked, want_picked, rtol=1e-6)
    got = TRITON_CHUNKS.grad_(z.clone(), want_lse, index, hit, scale)
    want = TORCH_CHUNKS.grad_(z.clone(), want_lse, index, hit, scale)
    assert got.dtype == dtype and want.dtype == dtype
    close(got.float(), want.float(), rtol=1e-6 if dtype == torch.float32 else 1e-2)
    assert got[3].abs().max() == 0  # scale 0: a row that does not count


@needs_triton
def test_the_fused_loss_on_triton_chunks_equals_the_plain_loss(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from raydist.kernels.cross_entropy import TRITON_CHUNKS

    h, w, targets = inputs()
    want = grads(plain, h, w, targets)
    got = grads(lambda *a: linear_cross_entropy(*a, rows=5, ops=TRITON_CHUNKS), h, w, targets)
    for a, b in zip(got, want):
        close(a, b)


@needs_triton
def test_training_with_the_triton_loss_kernels_equals_the_plain_loss(tiny_data, monkeypatch):
    """kernels.loss = triton on pp 2 with a tied head (the last stage's copy of the embedding keeps the head's
    setting, GPT.give_head) against the single process's plain loss; the last stage ran the Triton kernels."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from raydist.testing import assert_equivalent, run_layout, tiny_config

    def run(loss, parallel, world):
        raw = tiny_config(tiny_data, kernels={"loss": loss}, parallel={"dp_replicate": 1, **parallel},
                          train={"steps": 3})
        return run_layout(raw, world, steps=3)

    [plain_single] = run("plain", {}, 1)
    ranks = run("triton", {"pp": 2, "pp_schedule": "1f1b"}, 2)
    for rank in ranks:
        assert_equivalent(plain_single, rank)
    assert [rank.kernels.get("loss") for rank in ranks] == [None, {"triton": ranks[1].kernels["loss"]["triton"]}]
    assert ranks[1].kernels["loss"]["triton"] > 0
