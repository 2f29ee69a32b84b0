"""The Triton kernels compiled and run on a CUDA GPU: bf16/fp16 and larger shapes than the interpreter allows.

Each test also runs on the CPU, its body unchanged, on a small shape with the kernels under Triton's
interpreter (TRITON_INTERPRET=1, as tests/unit/test_kernels.py runs them), so that the GPU's test code is
proven to run; the CUDA cases are skipped without a GPU (tests/gpu/conftest.py). The oracle is the
plain-torch reference computed in fp32 on the same device from the same inputs; tolerances are normalised
max errors per dtype, as in tests/unit/test_kernels.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from raydist.kernels import runtime

pytestmark = pytest.mark.skipif(runtime.triton_import_error() is not None,
                                reason=f"triton not importable: {runtime.triton_import_error()}")
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
CUDA = pytest.mark.cuda


@pytest.fixture(autouse=True)
def triton_mode(request, monkeypatch):
    """The compiled kernels on CUDA, the interpreter on the CPU (where it can run them)."""
    if request.node.callspec.params["device"] == "cuda":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        reason = runtime.triton_unusable_reason("cpu")
        if reason is not None:
            pytest.skip(reason)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().float(), ref.detach().float()
    return float((x - ref).abs().max() / ref.abs().max())


def make(shape, dtype, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, device=device, dtype=torch.float32, generator=g).to(dtype).requires_grad_()


@pytest.mark.parametrize("device,b,h,k,t,s,e,causal,dtype", [
    ("cuda", 2, 8, 2, 1000, 1000, 64, True, torch.bfloat16),  # GQA 4:1, a tail at every block size
    ("cuda", 1, 4, 4, 2048, 2048, 128, True, torch.float16),
    ("cuda", 2, 8, 8, 777, 777, 32, False, torch.bfloat16),
    ("cuda", 1, 4, 2, 513, 1500, 128, False, torch.bfloat16),  # a ring block: T != S
    ("cuda", 1, 4, 1, 4096, 4096, 64, True, torch.bfloat16),
    ("cuda", 1, 2, 1, 300, 300, 64, True, torch.float32),  # fp32 in full precision (no TF32)
    ("cuda", 2, 4, 4, 129, 129, 16, True, torch.float16),
    ("cpu", 1, 4, 2, 33, 33, 32, True, torch.bfloat16),  # GQA 2:1, a masked tail
    ("cpu", 1, 2, 1, 17, 40, 32, False, torch.float16),  # T != S
])
def test_attention_cuda_matches_reference(device, b, h, k, t, s, e, causal, dtype):
    from raydist.kernels import attention_reference, flash_attention

    q, kk, v = (make(shape, dtype, i, device) for i, shape in enumerate([(b, h, t, e), (b, k, s, e), (b, k, s, e)]))
    w_out, w_lse = torch.randn(b, h, t, e, device=device), torch.randn(b, h, t, device=device)
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


@pytest.mark.parametrize("device", ["cuda"])  # CUDA's memory statistics: no CPU counterpart
def test_attention_cuda_memory_is_linear_in_sequence_length(device):
    """Extra memory of forward+backward at 2T is ~2x that at T (O(T)); the scores would make it 4x."""
    from raydist.kernels import flash_attention

    def extra_mb(t):
        q, k, v = (make((1, 8, t, 64), torch.bfloat16, i, device) for i in range(3))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = flash_attention(q, k, v, causal=True)
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    small, large = extra_mb(4096), extra_mb(8192)
    assert large / small < 2.5, (small, large)


LARGE_LINEAR, SMALL_LINEAR = (3, 1000, 1024, 1536), (2, 33, 64, 48)  # (batch, rows, in, out)


@pytest.mark.parametrize("device,shape,activation,dtype", [
    ("cuda", LARGE_LINEAR, "none", torch.bfloat16), ("cuda", LARGE_LINEAR, "gelu", torch.float16),
    ("cuda", LARGE_LINEAR, "silu", torch.bfloat16), ("cuda", LARGE_LINEAR, "gelu", torch.float32),
    ("cpu", SMALL_LINEAR, "gelu", torch.bfloat16), ("cpu", SMALL_LINEAR, "silu", torch.float32),
])
def test_linear_cuda_matches_reference(device, shape, activation, dtype):
    from raydist.kernels import linear, linear_reference

    b, m, k, n = shape
    x, w, bias = make((b, m, k), dtype, 0, device), make((n, k), dtype, 1, device), make((n,), dtype, 2, device)
    with torch.no_grad():
        w.mul_(1 / math.sqrt(k))
    out = linear(x, w, bias, activation)
    g = torch.randn_like(out, dtype=torch.float32)
    grads = torch.autograd.grad((out.float() * g).sum(), (x, w, bias))
    ref_in = [t.detach().float().requires_grad_() for t in (x, w, bias)]
    ref = linear_reference(*ref_in, activation=activation)
    ref_grads = torch.autograd.grad((ref * g).sum(), ref_in)
    assert rel_err(out, ref) < TOL[dtype]
    for name, grad, r in zip(("dx", "dw", "db"), grads, ref_grads):
        assert rel_err(grad, r) < TOL[dtype], name


@pytest.mark.parametrize("device,shape,dtype", [
    ("cuda", (2, 1023, 512, 1408), torch.bfloat16), ("cuda", (2, 1023, 512, 1408), torch.float16),
    ("cpu", (1, 33, 64, 96), torch.float16),
])
def test_swiglu_cuda_matches_reference(device, shape, dtype):
    from raydist.kernels import swiglu, swiglu_reference

    b, m, d, f = shape
    x, w1, w3 = make((b, m, d), dtype, 0, device), make((f, d), dtype, 1, device), make((f, d), dtype, 2, device)
    with torch.no_grad():
        w1.mul_(1 / math.sqrt(d))
        w3.mul_(1 / math.sqrt(d))
    out = swiglu(x, w1, w3)
    g = torch.randn_like(out, dtype=torch.float32)
    grads = torch.autograd.grad((out.float() * g).sum(), (x, w1, w3))
    ref_in = [t.detach().float().requires_grad_() for t in (x, w1, w3)]
    ref = swiglu_reference(*ref_in)
    ref_grads = torch.autograd.grad((ref * g).sum(), ref_in)
    assert rel_err(out, ref) < TOL[dtype]
    for name, grad, r in zip(("dx", "dw1", "dw3"), grads, ref_grads):
        assert rel_err(grad, r) < TOL[dtype], name


# The model tests: on CUDA at a size that autotunes real tiles, on the CPU a tiny model with the interpreted
# kernels; Triton asked for by name on both (`auto` means torch's kernels: kernels/select.py).
MODELS = {"cuda": (dict(num_layers=2, d_model=256, num_heads=4, num_kv_heads=2, ffn_hidden=704, vocab_size=512),
                   256, 4, ("triton", "triton")),
          "cpu": (dict(num_layers=1, d_model=64, num_heads=2, num_kv_heads=1, ffn_hidden=96, vocab_size=512),
                  16, 2, ("triton", "triton"))}  # (model, seq_len, batch, kernels)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_model_trains_on_cuda_with_triton_like_torch(device):
    """fp32, full-precision matmuls on both sides: the same losses within 1e-4 relative."""
    from raydist.config import KernelsConfig, ModelConfig
    from raydist.kernels import apply_kernels
    from raydist.metrics.kernels import kernel_calls, kernels_ran
    from raydist.models.gpt import build_model
    from raydist.models.loss import cross_entropy

    shape, seq_len, batch, triton = MODELS[device]
    cfg = ModelConfig(**shape)
    device = torch.device(device)

    def losses(kernels):
        model = build_model(cfg, seq_len, seed=0, device=device)
        chosen = apply_kernels(model, kernels, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        out, before = [], kernel_calls()
        for _ in range(3):
            tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=g).to(device)
            loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.item())
        return chosen, kernels_ran(since=before), out

    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        chosen, ran, triton_losses = losses(KernelsConfig(*triton))
        _, torch_ran, torch_losses = losses(KernelsConfig("sdpa", "torch"))
    finally:
        torch.set_float32_matmul_precision(precision)
    assert chosen == {"attention": "triton", "matmul": "triton", "loss": "fused"}
    assert set(ran["attention"]) == {"triton"} and set(ran["matmul"]) == {"triton"}, ran  # no fallback
    assert set(torch_ran["matmul"]) == {"torch"}, torch_ran
    for a, b in zip(triton_losses, torch_losses, strict=True):
        assert abs(a - b) <= 1e-4 * abs(b), (triton_losses, torch_losses)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_bf16_autocast_training_step_runs(device):
    """Under bf16 autocast (the default on CUDA) the kernels take bf16 operands and gradients reach fp32."""
    from raydist.config import KernelsConfig, ModelConfig
    from raydist.kernels import apply_kernels
    from raydist.metrics.kernels import kernel_calls, kernels_ran
    from raydist.models.gpt import build_model
    from raydist.models.loss import cross_entropy

    shape, seq_len, batch, _ = MODELS[device]
    cfg = ModelConfig(**{**shape, "num_heads": 2, "num_kv_heads": 1})
    model = build_model(cfg, seq_len, seed=0, device=device)
    apply_kernels(model, KernelsConfig("triton", "triton"), device)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), device=device)
    before = kernel_calls()
    with torch.autocast(device, dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
        loss = cross_entropy(logits, tokens[:, 1:])
    loss.backward()
    ran = kernels_ran(since=before)
    assert logits.dtype == torch.bfloat16  # the head ran in bf16
    assert set(ran["attention"]) == {"triton"} and set(ran["matmul"]) == {"triton"}, ran
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.5  # near-uniform at init


@pytest.mark.parametrize("device,rows,vocab,dtype", [
    ("cuda", 130, 128256, torch.bfloat16),  # a chunk of Llama 3's vocabulary, as the fused loss holds it
    ("cuda", 65, 50000, torch.float32),  # a vocabulary no multiple of the kernel's column block
    ("cpu", 5, 200, torch.bfloat16),
])
def test_loss_chunk_kernels_match_torch(device, rows, vocab, dtype):
    """kernels.loss = triton's chunk work (raydist.kernels.cross_entropy) against models.loss's torch chunk
    ops on the same logits: the log-sum-exp and target logit of each row (fp32), and the gradient
    (softmax - one-hot) * scale written over the logits in their dtype."""
    from raydist.kernels.cross_entropy import TRITON_CHUNKS
    from raydist.models.loss import TORCH_CHUNKS

    g = torch.Generator(device=device).manual_seed(4)
    z = (4 * torch.randn(rows, vocab, device=device, generator=g)).to(dtype)
    index = torch.randint(0, vocab, (rows,), device=device, generator=g)
    hit = torch.rand(rows, device=device, generator=g) < 0.8
    scale = torch.rand(rows, device=device, generator=g) / rows
    lse, picked = TRITON_CHUNKS.stats(z, index)
    want_lse, want_picked = TORCH_CHUNKS.stats(z, index)
    assert rel_err(lse, want_lse) < 1e-5 and rel_err(picked, want_picked) < 1e-6
    got = TRITON_CHUNKS.grad_(z.clone(), want_lse, index, hit, scale)
    want = TORCH_CHUNKS.grad_(z.clone(), want_lse, index, hit, scale)
    assert got.dtype == dtype and rel_err(got, want) < (1e-5 if dtype == torch.float32 else TOL[dtype])


@pytest.mark.parametrize("device,t,dtype", [("cuda", 1000, torch.bfloat16), ("cuda", 333, torch.float32),
                                            ("cpu", 33, torch.float32)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_aten_ring_blocks_match_the_torch_blocks(device, t, dtype, causal):
    """Ring attention's `aten` blocks (CUDA's memory-efficient attention; the CPU's flash attention) at head
    dim 80, which the Triton kernel lacks, 8 query heads on 2 kv heads, against the tiled torch blocks in
    fp32 on the same inputs: out and lse, and the backward from a merged out and lse (dq, dk, dv)."""
    from raydist.parallel.attention_blocks import aten_backward, aten_forward, torch_backward, torch_forward

    q, k, v, dout = (make(shape, dtype, seed, device).detach() for seed, shape in enumerate(
        [(2, 8, t, 80), (2, 2, t, 80), (2, 2, t, 80), (2, 8, t, 80)]))
    out, lse = aten_forward(q, k, v, causal)
    ref_out, ref_lse = torch_forward(*(x.float() for x in (q, k, v)), causal)
    assert out.dtype == dtype and lse.shape == ref_lse.shape
    assert rel_err(out, ref_out) < TOL[dtype] and rel_err(lse, ref_lse) < 1e-4
    grads = aten_backward(dout, q, k, v, ref_out.to(dtype), ref_lse, causal)
    want = torch_backward(dout.float(), *(x.float() for x in (q, k, v)), ref_out, ref_lse, causal)
    for got, expected in zip(grads, want):
        assert got.shape == expected.shape and rel_err(got, expected) < 2 * TOL[dtype]


@pytest.mark.parametrize("device", ["cuda"])  # CUDA's memory statistics: no CPU counterpart
def test_aten_ring_blocks_hold_memory_linear_in_the_sequence(device):
    """The fused blocks never hold a (T, S) matrix: doubling T at most about doubles the peak bytes allocated
    by a forward and backward (a (B, H, T, T) score matrix would quadruple them)."""
    from raydist.parallel.attention_blocks import aten_backward, aten_forward

    def peak(t):
        q, k, v, dout = (make(shape, torch.bfloat16, seed, device).detach() for seed, shape in enumerate(
            [(1, 8, t, 80), (1, 2, t, 80), (1, 2, t, 80), (1, 8, t, 80)]))  # (on `device`: cuda)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
        out, lse = aten_forward(q, k, v, True)
        aten_backward(dout, q, k, v, out, lse, True)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - held

    small, large = peak(4096), peak(8192)
    assert large < 2.5 * small, (small, large)


@pytest.mark.parametrize("device,kernel,tokens,dtype", [
    ("cuda", "triton", 4096, torch.bfloat16), ("cuda", "grouped_mm", 4096, torch.bfloat16),
    ("cuda", "triton", 777, torch.float32), ("cpu", "triton", 24, torch.float32),
])
def test_expert_kernels_match_the_loop(device, kernel, tokens, dtype):
    """A mixture of experts' expert SwiGLU (raydist.models.moe.expert_swiglu) through the Triton grouped GEMM
    and torch._grouped_mm (Hopper) against the loop over experts: output and the gradients of the rows and
    of the three stacked weights, on uneven counts with an expert that gets no token."""
    from raydist.kernels.grouped_mm import grouped_mm
    from raydist.models.moe import expert_swiglu

    g = torch.Generator(device=device).manual_seed(5)
    experts, d, f, k = 8, 256 if device == "cuda" else 32, 512 if device == "cuda" else 48, 2
    chosen = torch.randn(tokens, experts, device=device, generator=g).softmax(-1).topk(k, -1).indices
    chosen[chosen == 3] = 4  # expert 3 gets no token
    flat = chosen.reshape(-1).sort().values
    counts = torch.bincount(flat, minlength=experts)
    xs = torch.randn(tokens * k, d, device=device, generator=g).to(dtype)
    weights = [(torch.randn(experts, *shape, device=device, generator=g) / shape[1] ** 0.5).to(dtype)
               for shape in ((f, d), (f, d), (d, f))]
    results = {}
    for path in ("loop", kernel):
        leaves = [t.detach().clone().requires_grad_() for t in (xs, *weights)]
        y = expert_swiglu(leaves[0], counts, *leaves[1:], grouped_mm if path == "triton" else path)
        y.float().square().mean().backward()
        results[path] = [y, *(t.grad for t in leaves)]
    for got, want in zip(results[kernel], results["loop"]):
        assert rel_err(got, want) < TOL[dtype]
    assert results[kernel][1 + 1][3].abs().max() == 0  # w1's gradient for the expert without tokens


# ---- `kernels = auto`: the measured choice ---------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_auto_times_both_kernels_and_keeps_the_faster(device, tmp_path):
    """raydist.kernels.choice with its real CUDA-event timer on the GPU (on the CPU the same steps under the
    interpreter, timed by the wall clock): forward + backward of each candidate at an attention, a linear
    and a SwiGLU shape; the pick is the faster, both times land in the cache file, and a second chooser
    reads them instead of timing."""
    from raydist.kernels.choice import (AttentionShape, ChoiceCache, KernelChooser, MatmulShape, cuda_timer,
                                        wall_clock_timer)

    if device == "cuda":
        timer, name = cuda_timer(device), torch.cuda.get_device_name(device)
        t, e, m, dtype = 1024, 64, 2048, "bfloat16"
    else:
        timer, name = wall_clock_timer(), "cpu (interpreter)"
        t, e, m, dtype = 32, 16, 48, "float32"
    shapes = [AttentionShape(2, 4, 2, t, e, dtype), MatmulShape(m, 256, 512, dtype),
              MatmulShape(m, 256, 512, dtype, swiglu=True)]
    cache = ChoiceCache(tmp_path / "kernel_choices.json")
    chooser = KernelChooser(name, timer, cache, budget_s=300)
    picks = [chooser.choose(shape) for shape in shapes]
    for pick in picks:
        assert pick.source == "measured" and pick.triton_ms > 0 and pick.torch_ms > 0, pick
        assert pick.kernel == ("triton" if pick.triton_ms < pick.torch_ms else "torch"), pick
    assert 0 < chooser.spent_s <= 300

    def untimed(shape, candidate):
        raise AssertionError("read from the cache, not timed")

    again = KernelChooser(name, untimed, ChoiceCache(cache.path))
    assert [again.choose(shape).kernel for shape in shapes] == [p.kernel for p in picks]
