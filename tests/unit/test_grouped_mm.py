"""The Triton grouped GEMM (raydist.kernels.grouped_mm) against the torch loop, on CPU under
TRITON_INTERPRET=1: forward, dX and dW, an expert with no rows, row and column tails, fp32 and bf16; and a
mixture-of-experts layer computing its experts with it equal to the loop."""

from __future__ import annotations

import pytest
import torch

from raydist.kernels import runtime

pytestmark = pytest.mark.skipif(runtime.triton_import_error() is not None,
                                reason=f"triton not importable: {runtime.triton_import_error()}")

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reason = runtime.triton_unusable_reason("cpu")
    if reason is not None:
        pytest.skip(reason)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))


def case(counts, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), k, generator=g).to(dtype).requires_grad_()
    w = torch.randn(len(counts), k, n, generator=g).to(dtype).requires_grad_()
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    return x, w, offsets, torch.randn(sum(counts), n, generator=g).double()


def run(fn, x, w, offsets, weight):
    x.grad = w.grad = None
    y = fn(x, w, offsets)
    (y.double() * weight).sum().backward()
    return y.detach(), x.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("counts, k, n", [([10, 0, 27, 5], 24, 40), ([33], 16, 32), ([0, 7, 1], 40, 18)])
def test_grouped_mm_equals_the_loop_forward_and_backward(counts, k, n, dtype):
    from raydist.kernels.grouped_mm import LAUNCHES, grouped_mm, grouped_mm_reference

    x, w, offsets, weight = case(counts, k, n, dtype)
    before = dict(LAUNCHES)
    got = run(grouped_mm, x, w, offsets, weight)
    # the reference in fp64 on the same rounded inputs
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = run(grouped_mm_reference, xr, wr, offsets, weight)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert rel_err(a, b) < TOL[dtype], name
    assert LAUNCHES["grouped_mm"] - before.get("grouped_mm", 0) == 2  # forward and dX
    assert LAUNCHES["wgrad"] - before.get("wgrad", 0) == 1
    if 0 in counts:  # an expert without rows: zero gradient, not garbage
        assert got[2][counts.index(0)].abs().max() == 0


def test_a_wrong_group_boundary_is_caught():
    """The comparison above is not blind to the offsets: moving one boundary by a row fails it."""
    from raydist.kernels.grouped_mm import grouped_mm, grouped_mm_reference

    x, w, offsets, _ = case([10, 6, 9], 16, 32, torch.float32)
    shifted = offsets.clone()
    shifted[0] += 1
    with torch.no_grad():
        assert rel_err(grouped_mm(x, w, shifted), grouped_mm_reference(x, w, offsets)) > 1e-2


def test_bad_inputs_are_refused_by_name():
    from raydist.kernels.grouped_mm import grouped_mm

    x, w, offsets, _ = case([4, 4], 16, 16, torch.float32)
    with pytest.raises(ValueError, match="offsets must be int32"):
        grouped_mm(x, w, offsets.long())
    with pytest.raises(ValueError, match="x \\(M, K\\) and w \\(E, K, N\\)"):
        grouped_mm(x, w.transpose(-2, -1)[:, :8], offsets)


def test_moe_layer_with_the_triton_experts_equals_the_loop():
    from raydist.config import ModelConfig
    from raydist.models.moe import MoEFeedForward

    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=1, d_model=32, num_heads=2, num_kv_heads=1, ffn_hidden=48, vocab_size=64,
                      moe_experts=4, moe_top_k=2)
    layer = MoEFeedForward(cfg)
    x = torch.randn(2, 9, 32, requires_grad=True)
    outs = {}
    from raydist.kernels.grouped_mm import grouped_mm

    for backend in ("loop", "triton"):
        layer.experts.kernel = grouped_mm if backend == "triton" else "loop"
        layer.zero_grad()
        x.grad = None
        y = layer(x)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs[backend] = [y.detach(), x.grad.clone(), *(p.grad.clone() for p in layer.experts.parameters())]
    for a, b in zip(outs["triton"], outs["loop"]):
        assert rel_err(a, b) < 2e-5


def test_under_autocast_the_triton_experts_take_the_autocast_dtype():
    from raydist.kernels.grouped_mm import grouped_mm
    from raydist.models.moe import expert_swiglu

    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([5, 0, 7])
    xs = torch.randn(12, 32, generator=g)
    w1, w3 = torch.randn(3, 48, 32, generator=g) / 6, torch.randn(3, 48, 32, generator=g) / 6
    w2 = torch.randn(3, 32, 48, generator=g) / 7
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = expert_swiglu(xs, counts, w1, w3, w2, grouped_mm)
        want = expert_swiglu(xs, counts, w1, w3, w2, "loop")
    assert got.dtype == torch.bfloat16 and rel_err(got, want) < TOL[torch.bfloat16]


def test_kernels_matmul_triton_switches_the_experts_too():
    from raydist.config import ModelConfig
    from raydist.kernels.grouped_mm import grouped_mm
    from raydist.kernels.select import install_triton_matmul
    from raydist.models.gpt import build_model
    from raydist.models.moe import moe_blocks

    model = build_model(ModelConfig(num_layers=2, d_model=32, num_heads=2, num_kv_heads=1, ffn_hidden=48,
                                    vocab_size=64, moe_experts=4), max_seq_len=16, seed=0)
    assert {b.experts.kernel for b in moe_blocks(model)} == {"auto"}
    install_triton_matmul(model)
    assert {b.experts.kernel for b in moe_blocks(model)} == {grouped_mm}
