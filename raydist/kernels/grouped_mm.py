"""The experts' grouped GEMM (raydist.models.moe) through Triton, differentiable:

    grouped_mm(x, w, offsets)   rows x (M, K) sorted by expert, w (E, K, N), offsets (E,) int32 cumulative
                                row ends: expert e's rows x[offsets[e-1]:offsets[e]] @ w[e] -> (M, N)

The forward and dX = dY @ W[e]^T are one kernel (`_grouped_mm`; W[e]^T is a stride view, never copied),
dW[e] = X_e^T dY_e another (`_grouped_wgrad`), each launched only when the backward needs it. Nothing is
read back to the host: the offsets stay on the device (the loop over experts in `raydist.models.moe` reads
the counts). Supported: fp32, fp16, bf16 (one dtype for x and w). `grouped_mm_reference` is the plain torch
loop the tests compare with.
"""

from __future__ import annotations

import collections

import torch

from raydist.kernels import runtime

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LAUNCHES: collections.Counter = collections.Counter()  # kernel launches in this process: "grouped_mm", "wgrad"


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The definition, expert by expert in torch (fp32 accumulation where the inputs are lower)."""
    ends = offsets.tolist()
    starts = [0] + ends[:-1]
    out = [x[a:b].float() @ w[e].float() for e, (a, b) in enumerate(zip(starts, ends))]
    return torch.cat(out).to(x.dtype) if out else x.new_empty(0, w.shape[-1])


def _check(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_mm needs x (M, K) and w (E, K, N); got x {tuple(x.shape)}, w {tuple(w.shape)}")
    if offsets.shape != (w.shape[0],) or offsets.dtype != torch.int32:
        raise ValueError(f"offsets must be int32 of shape ({w.shape[0]},) (cumulative row ends per expert); got "
                         f"{offsets.dtype} {tuple(offsets.shape)}")
    for name, t in (("x", x), ("w", w)):
        if t.dtype not in SUPPORTED_DTYPES or t.dtype != x.dtype:
            raise ValueError(f"{name} is {t.dtype}; the grouped GEMM takes x and w in one of fp32, fp16, bf16")
        if t.device != x.device or offsets.device != x.device:
            raise ValueError(f"x, w and offsets must be on one device; got {x.device}, {w.device}, {offsets.device}")
        if t.numel() >= 2**31:
            raise ValueError(f"{name} {tuple(t.shape)} holds >= 2^31 elements, beyond the kernel's 32-bit offsets")
    runtime.check_tensor_device(x, "x")


def _precision() -> str:
    return "tf32" if torch.get_float32_matmul_precision() != "highest" else "ieee"


def _forward(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ w[e] (K, N) by groups -> (M, N); w may be any stride view (w.transpose(-2, -1))."""
    kernels = runtime.load_kernel_module("triton_grouped_mm")
    LAUNCHES["grouped_mm"] += 1
    (m, k), (e, _, n) = x.shape, w.shape
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y

    def grid(meta):  # an expert's rows get tiles of their own: at most ceil(M / BLOCK_M) + E row tiles
        return (triton_cdiv(m, meta["BLOCK_M"]) + e, triton_cdiv(n, meta["BLOCK_N"]))

    kernels._grouped_mm[grid](x, w, offsets, y, n, k, e, *x.stride(), *w.stride(), *y.stride(),
                              UPCAST=kernels.INTERPRETED and x.dtype == torch.bfloat16, PRECISION=_precision())
    return y


def _wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, experts: int) -> torch.Tensor:
    """dW (E, K, N): dW[e] = x[rows of e]^T @ dy[rows of e]; zeros for an expert without rows."""
    kernels = runtime.load_kernel_module("triton_grouped_mm")
    LAUNCHES["wgrad"] += 1
    (_, k), n = x.shape, dy.shape[1]
    dw = torch.empty(experts, k, n, dtype=x.dtype, device=x.device)

    def grid(meta):
        return (experts, triton_cdiv(k, meta["BLOCK_K"]), triton_cdiv(n, meta["BLOCK_N"]))

    kernels._grouped_wgrad[grid](x, dy, offsets, dw, n, k, experts, *x.stride(), *dy.stride(), *dw.stride(),
                                 UPCAST=kernels.INTERPRETED and x.dtype == torch.bfloat16, PRECISION=_precision())
    return dw


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets):
        ctx.save_for_backward(x, w, offsets)
        return _forward(x, w, offsets)

    @staticmethod
    def backward(ctx, dy):
        x, w, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _forward(dy, w.transpose(-2, -1), offsets) if ctx.needs_input_grad[0] else None
        dw = _wgrad(x, dy, offsets, w.shape[0]) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Expert e's rows x[offsets[e-1]:offsets[e]] (M, K) times w[e] (K, N), differentiable in x and w."""
    _check(x, w, offsets)
    return _GroupedMM.apply(x, w, offsets)


grouped_mm.kernel_name = "triton"  # what raydist.models.moe counts its calls as (`moe.triton`)
