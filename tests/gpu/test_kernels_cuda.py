"""The Triton kernels compiled and run on a CUDA GPU: bf16/fp16 and larger shapes than the interpreter allows.

Skipped without CUDA. The oracle is the plain-torch reference computed in fp32 on the GPU from the same
inputs; tolerances are normalised max errors per dtype, as in tests/unit/test_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from raydist.kernels import runtime

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)"),
    pytest.mark.skipif(runtime.triton_import_error() is not None,
                       reason=f"triton not importable: {runtime.triton_import_error()}"),
]
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # run the compiled kernels, not the interpreter


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).abs().max() / ref.float().abs().max())


def make(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", dtype=torch.float32, generator=g).to(dtype).requires_grad_()


@pytest.mark.parametrize("b,h,k,t,s,e,causal,dtype", [
    (2, 8, 2, 1000, 1000, 64, True, torch.bfloat16),  # GQA 4:1, a tail at every block size
    (1, 4, 4, 2048, 2048, 128, True, torch.float16),
    (2, 8, 8, 777, 777, 32, False, torch.bfloat16),
    (1, 4, 2, 513, 1500, 128, False, torch.bfloat16),  # a ring block: T != S
    (1, 4, 1, 4096, 4096, 64, True, torch.bfloat16),
    (1, 2, 1, 300, 300, 64, True, torch.float32),  # fp32 in full precision (no TF32)
    (2, 4, 4, 129, 129, 16, True, torch.float16),
])
def test_attention_cuda_matches_reference(b, h, k, t, s, e, causal, dtype):
    from raydist.kernels import attention_reference, flash_attention

    q, kk, v = make((b, h, t, e), dtype, 0), make((b, k, s, e), dtype, 1), make((b, k, s, e), dtype, 2)
    w_out, w_lse = torch.randn(b, h, t, e, device="cuda"), torch.randn(b, h, t, device="cuda")
    out, lse = flash_attention(q, kk, v, causal=causal, return_lse=True)
    grads = torch.autograd.grad((out.float() * w_out).sum() + (lse * w_lse).sum(), (q, kk, v))
    ref_in = [x.detach().float().requires_grad_() for x in (q, kk, v)]
    ref, ref_lse = attention_reference(*ref_in, causal=causal, return_lse=True)
    ref_grads = torch.autograd.grad((ref * w_out).sum() + (ref_lse * w_lse).sum(), ref_in)
    assert rel_err(out, ref) < TOL[dtype]
    assert float((lse - ref_lse).abs().max()) < 1e-3
    for name, grad, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert grad.dtype == dtype
        assert rel_err(grad, r) < TOL[dtype], name


def test_attention_cuda_memory_is_linear_in_sequence_length():
    """Extra memory of forward+backward at 2T is ~2x that at T (O(T)); the scores would make it 4x."""
    from raydist.kernels import flash_attention

    def extra_mb(t):
        q, k, v = (make((1, 8, t, 64), torch.bfloat16, i) for i in range(3))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = flash_attention(q, k, v, causal=True)
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    small, large = extra_mb(4096), extra_mb(8192)
    assert large / small < 2.5, (small, large)


@pytest.mark.parametrize("activation,dtype", [("none", torch.bfloat16), ("gelu", torch.float16),
                                              ("silu", torch.bfloat16), ("gelu", torch.float32)])
def test_linear_cuda_matches_reference(activation, dtype):
    from raydist.kernels import linear, linear_reference

    x, w, bias = make((3, 1000, 1024), dtype, 0), make((1536, 1024), dtype, 1), make((1536,), dtype, 2)
    with torch.no_grad():
        w.mul_(1 / 32)
    out = linear(x, w, bias, activation)
    g = torch.randn_like(out, dtype=torch.float32)
    grads = torch.autograd.grad((out.float() * g).sum(), (x, w, bias))
    ref_in = [t.detach().float().requires_grad_() for t in (x, w, bias)]
    ref = linear_reference(*ref_in, activation=activation)
    ref_grads = torch.autograd.grad((ref * g).sum(), ref_in)
    assert rel_err(out, ref) < TOL[dtype]
    for name, grad, r in zip(("dx", "dw", "db"), grads, ref_grads):
        assert rel_err(grad, r) < TOL[dtype], name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swiglu_cuda_matches_reference(dtype):
    from raydist.kernels import swiglu, swiglu_reference

    x, w1, w3 = make((2, 1023, 512), dtype, 0), make((1408, 512), dtype, 1), make((1408, 512), dtype, 2)
    with torch.no_grad():
        w1.mul_(1 / 16)
        w3.mul_(1 / 16)
    out = swiglu(x, w1, w3)
    g = torch.randn_like(out, dtype=torch.float32)
    grads = torch.autograd.grad((out.float() * g).sum(), (x, w1, w3))
    ref_in = [t.detach().float().requires_grad_() for t in (x, w1, w3)]
    ref = swiglu_reference(*ref_in)
    ref_grads = torch.autograd.grad((ref * g).sum(), ref_in)
    assert rel_err(out, ref) < TOL[dtype]
    for name, grad, r in zip(("dx", "dw1", "dw3"), grads, ref_grads):
        assert rel_err(grad, r) < TOL[dtype], name


def test_model_trains_on_cuda_with_triton_like_torch():
    """fp32 on the GPU, full-precision matmuls on both sides: the same losses within 1e-4 relative."""
    from raydist.config import KernelsConfig, ModelConfig
    from raydist.kernels import apply_kernels
    from raydist.models.gpt import build_model, cross_entropy

    cfg = ModelConfig(num_layers=2, d_model=256, num_heads=4, num_kv_heads=2, ffn_hidden=704, vocab_size=512)
    device = torch.device("cuda")

    def losses(kernels):
        model = build_model(cfg, 256, seed=0, device=device)
        chosen = apply_kernels(model, kernels, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        out = []
        for _ in range(3):
            tokens = torch.randint(0, cfg.vocab_size, (4, 257), generator=g).to(device)
            loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.item())
        return chosen, out

    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        chosen, triton_losses = losses(KernelsConfig("auto", "auto"))
        _, torch_losses = losses(KernelsConfig("sdpa", "torch"))
    finally:
        torch.set_float32_matmul_precision(precision)
    assert chosen == {"attention": "triton", "matmul": "triton"}
    for a, b in zip(triton_losses, torch_losses):
        assert abs(a - b) <= 1e-4 * abs(b)


def test_bf16_autocast_training_step_runs():
    """Under bf16 autocast (the default on CUDA) the kernels take bf16 operands and gradients reach fp32."""
    from raydist.config import KernelsConfig, ModelConfig
    from raydist.kernels import apply_kernels
    from raydist.models.gpt import build_model, cross_entropy

    cfg = ModelConfig(num_layers=2, d_model=256, num_heads=2, num_kv_heads=1, ffn_hidden=704, vocab_size=512)
    model = build_model(cfg, 128, seed=0, device="cuda")
    apply_kernels(model, KernelsConfig("triton", "triton"), "cuda")
    tokens = torch.randint(0, cfg.vocab_size, (2, 129), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    assert abs(loss.item() - torch.log(torch.tensor(512.0)).item()) < 0.5  # near-uniform at init
