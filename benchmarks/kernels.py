"""The Triton kernels against torch, measured side by side in one run: TFLOP/s and attention memory.

On CUDA, for sequence lengths 512 .. 16k:
- attention: `flash_attention` vs `F.scaled_dot_product_attention` (torch's fused kernels), causal, forward
  and forward+backward TFLOP/s, and the ratio. FLOPs are model FLOPs: forward 4 B H T^2 E (QK^T and PV),
  halved when causal; forward+backward 3x that (the backward's recomputation of QK^T is not counted,
  as MFU does not count it), the same count for both sides so the ratio is a ratio of times.
- memory: peak extra CUDA memory of one forward+backward beyond the inputs, flash vs sdpa vs the eager
  formula (which materialises B H T^2 scores; skipped where it does not fit), and the growth factor per
  doubling of T: ~2 for O(T) memory, ~4 for O(T^2).
- matmul: one MLP of a 4096-wide model over T tokens: `linear` (x W^T, 4096 -> 4096) vs torch.matmul,
  and the fused SwiGLU product silu(x W1^T) * (x W3^T) (4096 -> 11008) vs its unfused torch form.

Times are medians of triton.testing.do_bench (CUDA events, L2 flushed between runs).

`--llama`: the Llama 3 shapes (Dubey et al., "The Llama 3 Herd of Models", 2024) instead of the sweeps:
attention with head dim 128, 32 (8B) / 64 (70B) query heads and 8 kv heads (grouped-query: the Triton kernel
reads the shared kv heads, sdpa gets `enable_gqa=True`), causal, T = 2k, 4k, 8k; the MLP GEMMs of 8B
(d 4096, ffn 14336) and 70B (d 8192, ffn 28672) over 8192 tokens, Triton `linear` vs `torch.matmul`, the
up projection (T, d) x (d, ffn) and the down projection (T, ffn) x (ffn, d). Each row also holds the
Triton output's max error relative to torch's (a fast wrong kernel must not pass). benchmarks/gpu_suite.py
runs this.

On a machine without CUDA it says so and measures correctness only: the kernels run through Triton's CPU
interpreter (TRITON_INTERPRET=1), whose speed says nothing about a GPU, on a few small shapes against
the plain-torch reference.

    python benchmarks/kernels.py [--seq-lens 512,1024,2048,4096,8192,16384] [--dtype bf16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def attention_flops(b: int, h: int, t: int, e: int, causal: bool) -> float:
    return 4.0 * b * h * t * t * e * (0.5 if causal else 1.0)


def bench_ms(fn, device: str = "cuda") -> float:
    """Median ms of fn(): triton.testing.do_bench (CUDA events) on CUDA; on the CPU (only to exercise this
    code under TRITON_INTERPRET=1: the figure means nothing) the median of 3 timed calls."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100)
    import statistics
    import time

    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


# Llama 3 (Dubey et al., 2024): attention heads and the MLP's GEMM shapes, by model.
LLAMA_ATTENTION = {"llama3-8b": {"heads": 32, "kv_heads": 8, "head_dim": 128},
                   "llama3-70b": {"heads": 64, "kv_heads": 8, "head_dim": 128}}
LLAMA_GEMMS = {"llama3-8b": {"d_model": 4096, "ffn": 14336}, "llama3-70b": {"d_model": 8192, "ffn": 28672}}


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().float(), ref.detach().float()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def _sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, device: str):
    """(causal sdpa over grouped-query heads, how): on CUDA restricted to the fused backends (flash, cuDNN,
    memory-efficient) so that it never silently falls back to the math backend's T x T scores; with
    `enable_gqa` where a fused backend takes it, else with the kv heads repeated (what models.gpt does)."""
    def gqa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    if device != "cuda":
        return gqa, "enable_gqa"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from raydist.kernels.reference import repeat_kv

    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]

    def fused_gqa():
        with sdpa_kernel(fused):
            return gqa()

    def fused_repeated():
        with sdpa_kernel(fused):
            return F.scaled_dot_product_attention(q, repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1]),
                                                  is_causal=True)

    try:
        fused_gqa()
        return fused_gqa, "enable_gqa"
    except RuntimeError:  # no fused backend takes enable_gqa for these inputs
        return fused_repeated, "repeat_kv"


def llama_attention_rows(seq_lens: list[int], dtype: torch.dtype, tokens: int, device: str = "cuda",
                         shapes: dict | None = None) -> list[dict]:
    """Causal GQA attention, forward and forward+backward: Triton flash attention vs sdpa (enable_gqa), at
    B = max(1, tokens // T) sequences of T; TFLOP/s on model FLOPs (forward 2 B H T^2 E causal, backward 2x)."""
    from raydist.kernels import flash_attention

    rows = []
    for model, shape in (shapes or LLAMA_ATTENTION).items():
        h, kv, e = shape["heads"], shape["kv_heads"], shape["head_dim"]
        for t in seq_lens:
            b = max(1, tokens // t)
            g = torch.Generator(device=device).manual_seed(0)
            q = torch.randn(b, h, t, e, device=device, dtype=dtype, generator=g).requires_grad_()
            k, v = (torch.randn(b, kv, t, e, device=device, dtype=dtype, generator=g).requires_grad_()
                    for _ in range(2))
            grad = torch.randn_like(q)
            sdpa, sdpa_gqa = _sdpa_gqa(q, k, v, device)
            fns = {"triton": lambda: flash_attention(q, k, v, causal=True), "sdpa": sdpa}
            flops = attention_flops(b, h, t, e, causal=True)
            row = {"model": model, "T": t, "B": b, "H": h, "KV": kv, "E": e, "sdpa_gqa": sdpa_gqa,
                   "max_rel_err": _rel_err(fns["triton"](), fns["sdpa"]())}
            for name, fn in fns.items():
                row[f"{name}_fwd_ms"] = bench_ms(fn, device)
                row[f"{name}_fwdbwd_ms"] = bench_ms(lambda: torch.autograd.grad(fn(), (q, k, v), grad), device)
                row[f"{name}_fwd_tflops"] = flops / row[f"{name}_fwd_ms"] / 1e9
                row[f"{name}_fwdbwd_tflops"] = 3 * flops / row[f"{name}_fwdbwd_ms"] / 1e9
            row["fwd_ratio"] = row["sdpa_fwd_ms"] / row["triton_fwd_ms"]  # > 1: Triton faster
            row["fwdbwd_ratio"] = row["sdpa_fwdbwd_ms"] / row["triton_fwdbwd_ms"]
            rows.append(row)
            print(f"attention {model:10s} T={t:5d} B={b:2d} H={h}/{kv} E={e}  fwd+bwd TFLOP/s triton "
                  f"{row['triton_fwdbwd_tflops']:7.1f} sdpa {row['sdpa_fwdbwd_tflops']:7.1f} "
                  f"(triton x{row['fwdbwd_ratio']:.2f})  fwd x{row['fwd_ratio']:.2f}  err {row['max_rel_err']:.1e}",
                  flush=True)
            del q, k, v, grad
    return rows


def llama_gemm_rows(tokens: int, dtype: torch.dtype, device: str = "cuda", shapes: dict | None = None) -> list[dict]:
    """The MLP GEMMs over `tokens` rows: up (T, d) x (d, ffn) and down (T, ffn) x (ffn, d), as nn.Linear
    stores them (W (out, in), x W^T): Triton `linear` vs `torch.matmul(x, W.t())`, forward and
    forward+backward (dX and dW: 3x the forward FLOPs)."""
    from raydist.kernels import linear

    rows = []
    for model, shape in (shapes or LLAMA_GEMMS).items():
        d, f = shape["d_model"], shape["ffn"]
        for proj, (n_in, n_out) in (("up", (d, f)), ("down", (f, d))):
            g = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(tokens, n_in, device=device, dtype=dtype, generator=g).requires_grad_()
            w = (torch.randn(n_out, n_in, device=device, dtype=dtype, generator=g) / math.sqrt(n_in)).requires_grad_()
            grad = torch.randn(tokens, n_out, device=device, dtype=dtype, generator=g)
            fns = {"triton": lambda: linear(x, w), "torch": lambda: torch.matmul(x, w.t())}
            flops = 2.0 * tokens * n_in * n_out
            row = {"model": model, "proj": proj, "M": tokens, "K": n_in, "N": n_out,
                   "max_rel_err": _rel_err(fns["triton"](), fns["torch"]())}
            for name, fn in fns.items():
                row[f"{name}_fwd_ms"] = bench_ms(fn, device)
                row[f"{name}_fwdbwd_ms"] = bench_ms(lambda: torch.autograd.grad(fn(), (x, w), grad), device)
                row[f"{name}_fwd_tflops"] = flops / row[f"{name}_fwd_ms"] / 1e9
                row[f"{name}_fwdbwd_tflops"] = 3 * flops / row[f"{name}_fwdbwd_ms"] / 1e9
            row["fwd_ratio"] = row["torch_fwd_ms"] / row["triton_fwd_ms"]
            row["fwdbwd_ratio"] = row["torch_fwdbwd_ms"] / row["triton_fwdbwd_ms"]
            rows.append(row)
            print(f"gemm      {model:10s} {proj:4s} {tokens}x{n_in}x{n_out}  fwd TFLOP/s triton "
                  f"{row['triton_fwd_tflops']:7.1f} torch {row['torch_fwd_tflops']:7.1f} (triton x{row['fwd_ratio']:.2f})"
                  f"  fwd+bwd x{row['fwdbwd_ratio']:.2f}  err {row['max_rel_err']:.1e}", flush=True)
            del x, w, grad
    return rows


# Llama 3's blocks (Dubey et al., 2024) for what `kernels = auto` picks: the model dims above, 128k vocabulary.
LLAMA_MODELS = {"llama3-8b": {"d_model": 4096, "num_heads": 32, "num_kv_heads": 8, "ffn_hidden": 14336},
                "llama3-70b": {"d_model": 8192, "num_heads": 64, "num_kv_heads": 8, "ffn_hidden": 28672}}


def llama_auto_rows(seq_len: int, micro_batch: int = 1, device: str = "cuda", budget_s: float = 40.0,
                    models: dict | None = None, vocab_size: int = 128256) -> list[dict]:
    """What `kernels = auto` picks at one block of each Llama 3 shape (one GPU, no tensor parallelism,
    bf16, `micro_batch` sequences of `seq_len`): the run's own decision path (`select.choose_auto` with the
    CUDA-event timer, forward + backward), without the cache file so that every shape is measured here. One
    row per distinct shape: the pick, both times, and why a shape was not measured (the fused-loss head;
    the measuring budget `budget_s`, shared by the models, once spent). On a CPU (tests) the Triton
    candidate runs under the interpreter, timed by the wall clock."""
    from raydist.config import KernelsConfig, ModelConfig
    from raydist.kernels.choice import KernelChooser, cuda_timer, wall_clock_timer
    from raydist.kernels.select import Workload, choose_auto
    from raydist.models.gpt import GPT

    if torch.device(device).type == "cuda":
        chooser = KernelChooser(torch.cuda.get_device_name(device), cuda_timer(device), None, budget_s=budget_s)
    else:
        chooser = KernelChooser(str(device), wall_clock_timer(device), None, budget_s=budget_s)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    workload = Workload(micro_batch, seq_len, dtype)
    rows = []
    for model, dims in (models or LLAMA_MODELS).items():
        with torch.device("meta"):  # shapes only: the timer makes its own inputs
            gpt = GPT(ModelConfig(num_layers=1, vocab_size=vocab_size, **dims), seq_len)
        choices = choose_auto(gpt, KernelsConfig(), workload, chooser)
        modules: dict[str, list[str]] = {}
        for name, pick in choices.modules.items():
            modules.setdefault(pick.shape, []).append(name.removeprefix("layers.0."))
        for pick in choices.picks():
            row = {"model": model, **pick.record(), "modules": modules.get(pick.shape, [])}
            if pick.triton_ms and pick.torch_ms:
                row["triton_speedup"] = pick.torch_ms / pick.triton_ms  # > 1: Triton faster
            rows.append(row)
            times = (f"triton {pick.triton_ms:8.3f} ms  torch {pick.torch_ms:8.3f} ms" if pick.triton_ms is not None
                     and pick.torch_ms is not None else pick.source)
            print(f"auto      {model:10s} {pick.shape:58s} -> {pick.kernel:6s} {times}", flush=True)
    return rows


def attention_rows(seq_lens: list[int], dtype: torch.dtype, heads: int, head_dim: int, tokens: int) -> list[dict]:
    """TFLOP/s of flash vs sdpa; the batch keeps B*T = tokens (at least 1 sequence)."""
    from raydist.kernels import flash_attention

    rows = []
    for t in seq_lens:
        b = max(1, tokens // t)
        q, k, v = (torch.randn(b, heads, t, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn_like(q)
        flops = attention_flops(b, heads, t, head_dim, causal=True)
        row = {"T": t, "B": b, "H": heads, "E": head_dim}
        for name, fn in (("triton", lambda: flash_attention(q, k, v, causal=True)),
                         ("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))):
            fwd_ms = bench_ms(fn)
            both_ms = bench_ms(lambda: torch.autograd.grad(fn(), (q, k, v), grad))
            row[f"{name}_fwd_tflops"] = flops / fwd_ms / 1e9
            row[f"{name}_fwdbwd_tflops"] = 3 * flops / both_ms / 1e9
        row["fwd_ratio"] = row["triton_fwd_tflops"] / row["sdpa_fwd_tflops"]
        row["fwdbwd_ratio"] = row["triton_fwdbwd_tflops"] / row["sdpa_fwdbwd_tflops"]
        rows.append(row)
        print(f"attention T={t:6d} B={b:3d}  fwd TFLOP/s triton {row['triton_fwd_tflops']:7.1f} "
              f"sdpa {row['sdpa_fwd_tflops']:7.1f} (x{row['fwd_ratio']:.2f})   fwd+bwd triton "
              f"{row['triton_fwdbwd_tflops']:7.1f} sdpa {row['sdpa_fwdbwd_tflops']:7.1f} (x{row['fwdbwd_ratio']:.2f})",
              flush=True)
        del q, k, v, grad
    return rows


def peak_extra_mb(fn, inputs: list[torch.Tensor]) -> float | None:
    """Peak CUDA memory of fn() + backward beyond what is allocated before it; None when it runs out."""
    for x in inputs:
        x.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        out = fn()
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        return None
    finally:
        for x in inputs:
            x.grad = None
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def memory_rows(seq_lens: list[int], dtype: torch.dtype, heads: int, head_dim: int) -> list[dict]:
    from raydist.kernels import flash_attention
    from raydist.models.gpt import eager_attention

    rows = []
    for t in seq_lens:
        q, k, v = (torch.randn(1, heads, t, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                   for _ in range(3))
        row = {"T": t}
        for name, fn in (("triton", lambda: flash_attention(q, k, v, causal=True)),
                         ("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
                         ("eager", lambda: eager_attention(q, k, v))):
            too_big = name == "eager" and 4.0 * heads * t * t * 3 > 0.5 * torch.cuda.mem_get_info()[0]
            row[f"{name}_mb"] = None if too_big else peak_extra_mb(fn, [q, k, v])
        rows.append(row)
        del q, k, v
    for prev, row in zip(rows, rows[1:]):  # growth per step of T: linear memory gives T ratio, quadratic T^2
        for name in ("triton", "sdpa", "eager"):
            a, b = prev[f"{name}_mb"], row[f"{name}_mb"]
            row[f"{name}_growth"] = b / a if a and b else None
    for row in rows:
        cells = "  ".join(f"{n} {_mb(row[f'{n}_mb'])} (x{_num(row.get(f'{n}_growth'))})"
                          for n in ("triton", "sdpa", "eager"))
        print(f"memory    T={row['T']:6d}  fwd+bwd extra MiB: {cells}", flush=True)
    return rows


def _mb(x):
    return "   n/a" if x is None else f"{x:8.1f}"


def _num(x):
    return "-" if x is None else f"{x:.2f}"


def matmul_rows(seq_lens: list[int], dtype: torch.dtype, d_model: int = 4096, ffn: int = 11008) -> list[dict]:
    from raydist.kernels import linear, swiglu
    from raydist.kernels.matmul import torch_swiglu

    rows = []
    for t in seq_lens:
        x = torch.randn(t, d_model, device="cuda", dtype=dtype, requires_grad=True)
        w = (torch.randn(d_model, d_model, device="cuda", dtype=dtype) / math.sqrt(d_model)).requires_grad_()
        w1, w3 = ((torch.randn(ffn, d_model, device="cuda", dtype=dtype) / math.sqrt(d_model)).requires_grad_()
                  for _ in range(2))
        row = {"T": t}
        cases = {
            "linear": (2.0 * t * d_model * d_model, (x, w),
                       {"triton": lambda: linear(x, w), "torch": lambda: torch.matmul(x, w.t())}),
            "swiglu": (4.0 * t * d_model * ffn, (x, w1, w3),
                       {"triton": lambda: swiglu(x, w1, w3), "torch": lambda: torch_swiglu(x, w1, w3)}),
        }
        for case, (flops, params, fns) in cases.items():
            for name, fn in fns.items():
                out = fn()
                grad = torch.randn_like(out)
                fwd_ms = bench_ms(fn)
                both_ms = bench_ms(lambda: torch.autograd.grad(fn(), params, grad))
                row[f"{case}_{name}_fwd_tflops"] = flops / fwd_ms / 1e9
                row[f"{case}_{name}_fwdbwd_tflops"] = 3 * flops / both_ms / 1e9
            fwd = [row[f"{case}_{n}_fwd_tflops"] for n in ("triton", "torch")]
            both = [row[f"{case}_{n}_fwdbwd_tflops"] for n in ("triton", "torch")]
            print(f"{case:9s} T={t:6d}  fwd TFLOP/s triton {fwd[0]:7.1f} torch {fwd[1]:7.1f} "
                  f"(x{fwd[0] / fwd[1]:.2f})   fwd+bwd triton {both[0]:7.1f} torch {both[1]:7.1f} "
                  f"(x{both[0] / both[1]:.2f})", flush=True)
        rows.append(row)
        del x, w, w1, w3
    return rows


def cpu_correctness() -> dict:
    """Max normalised errors of the kernels vs the fp64 reference on small shapes, under the interpreter."""
    os.environ["TRITON_INTERPRET"] = "1"
    from raydist.kernels import (attention_reference, flash_attention, linear, linear_reference, swiglu,
                                 swiglu_reference)

    g = torch.Generator().manual_seed(0)

    def err(x, ref):
        return float((x.double() - ref.double()).abs().max() / ref.double().abs().max())

    results = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        q = torch.randn(1, 4, 33, 64, generator=g).to(dtype)
        k, v = (torch.randn(1, 2, 33, 64, generator=g).to(dtype) for _ in range(2))
        out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
        ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), causal=True, return_lse=True)
        x = torch.randn(45, 72, generator=g).to(dtype)
        w, w3 = (torch.randn(40, 72, generator=g).div(8).to(dtype) for _ in range(2))
        name = str(dtype).removeprefix("torch.")
        results[name] = {
            "attention_out": err(out, ref), "attention_lse_abs": float((lse - ref_lse).abs().max()),
            "linear_gelu": err(linear(x, w, activation="gelu"),
                               linear_reference(x.double(), w.double(), activation="gelu")),
            "swiglu": err(swiglu(x, w, w3), swiglu_reference(x.double(), w.double(), w3.double())),
        }
        print(f"{name:9s} max error / max |ref|: " + ", ".join(f"{k} {v:.1e}" for k, v in results[name].items()))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=16384, help="B*T per attention call (B >= 1)")
    parser.add_argument("--json", default="", help="also write the rows here")
    parser.add_argument("--llama", action="store_true",
                        help="Llama 3 8B/70B attention (T 2k-8k) and MLP GEMM shapes instead of the sweeps")
    args = parser.parse_args(argv)
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    if args.llama and torch.cuda.is_available():
        dtype = DTYPES[args.dtype]
        print(f"{torch.cuda.get_device_name()}, {args.dtype}, Llama 3 shapes")
        results = {"device": torch.cuda.get_device_name(), "dtype": args.dtype,
                   "attention": llama_attention_rows([2048, 4096, 8192], dtype, args.tokens),
                   "gemm": llama_gemm_rows(8192, dtype)}
    elif not torch.cuda.is_available():
        print("No CUDA device: this run measures CORRECTNESS ONLY, not speed. The Triton kernels run on CPU "
              "through Triton's interpreter (TRITON_INTERPRET=1), whose timings mean nothing; TFLOP/s and "
              "memory need a GPU.")
        results = {"device": "cpu", "correctness": cpu_correctness()}
    else:
        dtype = DTYPES[args.dtype]
        name = torch.cuda.get_device_name()  # (the sweeps)
        print(f"{name}, {args.dtype}, causal attention H={args.heads} E={args.head_dim}, B*T={args.tokens}")
        results = {"device": name, "dtype": args.dtype,
                   "attention": attention_rows(seq_lens, dtype, args.heads, args.head_dim, args.tokens),
                   "memory": memory_rows(seq_lens, dtype, args.heads, args.head_dim),
                   "matmul": matmul_rows(seq_lens, dtype)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
