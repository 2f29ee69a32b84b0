"""A mixture of experts' expert SwiGLU (raydist.models.moe.expert_swiglu) three ways, side by side in one run:
the loop over experts (one matmul per expert, the counts read on the host), torch._grouped_mm, and raydist's
Triton grouped GEMM (raydist.kernels.grouped_mm); forward + backward time, TFLOP/s and the ratio to the loop,
and each path's max error relative to the loop's output (a fast wrong kernel must not pass).

On CUDA the shapes are Qwen3-30B-A3B's (Qwen team 2025: d_model 2048, 128 experts of 768, 8 per token) and
Mixtral 8x7B's (d_model 4096, 8 experts of 14336, 2 per token) over 8192 tokens in bf16, the routing drawn
from a softmax over random logits (uneven counts, as a router gives). FLOPs: 3 matmuls of 2 T k D F forward,
twice that backward. torch._grouped_mm needs Hopper (sm90+); on older GPUs its column says so.

On a machine without CUDA it says so and checks correctness only: the Triton kernels through Triton's CPU
interpreter (TRITON_INTERPRET=1) on a small shape against the loop; its times mean nothing.

    python benchmarks/grouped_gemm.py [--tokens 8192] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

MODELS = {"qwen3-30b-a3b": dict(d_model=2048, experts=128, top_k=8, hidden=768),
          "mixtral-8x7b": dict(d_model=4096, experts=8, top_k=2, hidden=14336)}


def routed(tokens: int, d_model: int, experts: int, top_k: int, hidden: int, device, dtype, seed: int = 0):
    """Rows sorted by expert (tokens x top_k of them), their counts, and the three stacked weights."""
    g = torch.Generator(device=device).manual_seed(seed)
    chosen = torch.randn(tokens, experts, device=device, generator=g).softmax(-1).topk(top_k, -1).indices
    counts = torch.bincount(chosen.reshape(-1), minlength=experts)
    xs = torch.randn(tokens * top_k, d_model, device=device, generator=g).to(dtype)
    w1, w3 = (torch.randn(experts, hidden, d_model, device=device, generator=g).to(dtype) / d_model ** 0.5
              for _ in range(2))
    w2 = torch.randn(experts, d_model, hidden, device=device, generator=g).to(dtype) / hidden ** 0.5
    return xs, counts, w1, w3, w2


def run_path(kernel: str, xs, counts, w1, w3, w2, repeats: int):
    """(median seconds of forward + backward, the output): `kernel` loop, grouped_mm or triton."""
    from raydist.kernels.grouped_mm import grouped_mm
    from raydist.models.moe import expert_swiglu

    cuda = xs.is_cuda
    kernel = grouped_mm if kernel == "triton" else kernel

    def once():
        x, a, b, c = (t.detach().requires_grad_() for t in (xs, w1, w3, w2))
        y = expert_swiglu(x, counts, a, b, c, kernel)
        y.float().square().mean().backward()
        return y.detach()

    out = once()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        once()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def rows_for(name: str, shape: dict, tokens: int, device, dtype, repeats: int) -> list[dict]:
    xs, counts, w1, w3, w2 = routed(tokens, **shape, device=device, dtype=dtype)
    flops = 3 * (3 * 2 * tokens * shape["top_k"] * shape["d_model"] * shape["hidden"])  # fwd + 2x bwd
    base_s, base = run_path("loop", xs, counts, w1, w3, w2, repeats)
    rows = []
    for kernel in ("loop", "grouped_mm", "triton"):
        row = {"model": name, "tokens": tokens, **shape, "dtype": str(dtype).removeprefix("torch."), "path": kernel}
        try:
            seconds, out = (base_s, base) if kernel == "loop" else run_path(kernel, xs, counts, w1, w3, w2, repeats)
        except Exception as exc:  # e.g. torch._grouped_mm before Hopper
            rows.append({**row, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
            continue
        err = float((out.float() - base.float()).abs().max() / base.float().abs().max())
        rows.append({**row, "seconds": seconds, "tflops": flops / seconds / 1e12,
                     "speedup_vs_loop": base_s / seconds, "max_rel_err_vs_loop": err})
    return rows


def cpu_rows() -> list[dict]:
    """Correctness through the interpreter on a small shape (times meaningless)."""
    os.environ["TRITON_INTERPRET"] = "1"
    shape = dict(d_model=32, experts=4, top_k=2, hidden=48)
    xs, counts, w1, w3, w2 = routed(24, **shape, device=torch.device("cpu"), dtype=torch.float32)
    _, base = run_path("loop", xs, counts, w1, w3, w2, 1)
    _, out = run_path("triton", xs, counts, w1, w3, w2, 1)
    err = float((out - base).abs().max() / base.abs().max())
    return [{"model": "tiny (interpreter)", "tokens": 24, **shape, "path": "triton", "max_rel_err_vs_loop": err,
             "note": "no CUDA: correctness only, times not measured"}]


def gpu_rows(tokens: int = 8192, repeats: int = 5) -> list[dict]:
    """The GPU suite's `moe` part."""
    rows = []
    for name, shape in MODELS.items():
        rows += rows_for(name, shape, tokens, torch.device("cuda"), torch.bfloat16, repeats)
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="also print one JSON line of every figure")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    if torch.cuda.is_available():
        rows = gpu_rows(args.tokens, args.repeats)
    else:
        print("no CUDA GPU: checking the Triton grouped GEMM's correctness under the interpreter only")
        rows = cpu_rows()
    for row in rows:
        figures = ", ".join(f"{k} {row[k]:.3g}" for k in ("seconds", "tflops", "speedup_vs_loop",
                                                          "max_rel_err_vs_loop") if k in row)
        print(f"{row['model']} {row['path']}: {figures or row.get('error')}")
    if args.json:
        print(json.dumps({"benchmark": "grouped_gemm", "rows": rows}))
    ok = all(row.get("max_rel_err_vs_loop", 0.0) < 3e-2 for row in rows if "error" not in row)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
