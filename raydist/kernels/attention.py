"""Flash attention (Triton): forward and backward, causal or full, grouped-query heads, returning the LSE.

    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)

q (B, H, T, E), k and v (B, K, S, E) with H a multiple of K (query head h reads kv head h // (H/K));
out (B, H, T, E) in q's dtype; lse (B, H, T) fp32, natural log: lse_i = log sum_j exp(scale * q_i . k_j)
over the keys row i may see. Two partial results over disjoint key sets merge exactly with
`reference.merge_attention` (ring attention), and gradients flow through lse as well as out.

Supported: head dims 16/32/64/128; fp32, fp16, bf16 (q, k, v alike); any T and S >= 1 (tails are masked);
causal needs T == S. Anything else is a ValueError naming the value, never a silent wrong result.
Layout: any strides; a tensor whose head dim is not unit-stride is copied to contiguous first (the one
documented fallback; the model's (B, T, H, E)-viewed-as-(B, H, T, E) tensors need no copy).
fp32 inputs multiply in full fp32 precision unless torch.set_float32_matmul_precision allows TF32.

`flash_attention` calls the torch custom operator `raydist::flash_attention` (autograd formula registered,
backward `raydist::flash_attention_backward`): an operator, unlike an autograd.Function, is visible to
dispatcher-level machinery, so selective activation checkpointing keeps its output instead of re-running it.
`attention_forward` / `attention_backward` are the raw kernels without autograd, for ring attention's
own backward (which needs the backward with the *global* out and lse of each query block).
The kernels themselves live in triton_attention.py, imported on first call (see runtime.py).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from raydist.kernels import runtime
from raydist.kernels.reference import check_attention_shapes

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOG2E = 1.4426950408889634
MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension, which carries batch * heads
MAX_ELEMENTS = 2**31  # offsets inside the kernels are 32-bit


def check_flash_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """ValueError (naming the value and the fix) for anything the Triton kernel does not support."""
    check_attention_shapes(q, k, v, causal)
    head_dim = q.shape[-1]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim} is not supported by the Triton attention (supported: "
                         f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}); use kernels.attention=sdpa")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported by the Triton attention (supported: fp32, fp16, "
                         "bf16); cast the inputs or use raydist.kernels.reference.attention_reference")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices ({q.device}, {k.device}, {v.device})")
    runtime.check_tensor_device(q, "q")
    if max(q.numel(), k.numel()) >= MAX_ELEMENTS:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} hold >= 2^31 elements, beyond the kernel's "
                         "32-bit offsets; split the batch into smaller calls")
    if q.shape[0] * max(q.shape[1], k.shape[1]) > MAX_GRID_Y:
        raise ValueError(f"batch*heads={q.shape[0] * q.shape[1]} exceeds the kernel grid's {MAX_GRID_Y}; "
                         "split the batch into smaller calls")


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch_options(dtype: torch.dtype, kernels) -> dict:
    # TF32 only when the user allowed it for torch's own fp32 matmuls; fp16/bf16 ignore PRECISION.
    precision = "tf32" if torch.get_float32_matmul_precision() != "highest" else "ieee"
    return {"UPCAST": kernels.INTERPRETED and dtype == torch.bfloat16, "PRECISION": precision}


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                      scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B,H,T,E) contiguous, lse (B,H,T) fp32) without autograd."""
    check_flash_inputs(q, k, v, causal)
    kernels = runtime.load_kernel_module("triton_attention")
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    b, h, t, e = q.shape
    kv_heads, s = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(e) if scale is None else float(scale)
    out = torch.empty((b, h, t, e), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, t), dtype=torch.float32, device=q.device)

    def grid(meta):
        return (_cdiv(t, meta["BLOCK_M"]), b * h)

    kernels._attn_fwd[grid](q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                            h, h // kv_heads, t, s, scale * LOG2E,
                            HEAD_DIM=e, CAUSAL=bool(causal), **_launch_options(q.dtype, kernels))
    return out, lse


def attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, causal: bool = True, scale: float | None = None,
                       grad_lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) given the forward's out and lse (B,H,T) and the incoming grad_out (and grad_lse)."""
    check_flash_inputs(q, k, v, causal)
    if grad_out.shape != q.shape or lse.shape != q.shape[:3]:
        raise ValueError(f"grad_out {tuple(grad_out.shape)} must match q {tuple(q.shape)} and lse "
                         f"{tuple(lse.shape)} must be (B, H, T) = {tuple(q.shape[:3])}")
    kernels = runtime.load_kernel_module("triton_attention")
    q, k, v, grad_out = _unit_stride(q), _unit_stride(k), _unit_stride(v), _unit_stride(grad_out.to(q.dtype))
    b, h, t, e = q.shape
    kv_heads, s = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(e) if scale is None else float(scale)
    # delta_i = sum_e dO_ie O_ie - dlse_i: O(T) fp32, the only torch-side math of the backward.
    delta = (grad_out.float() * out.float()).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse.float()
    delta, lse = delta.contiguous(), lse.float().contiguous()
    dq = torch.empty((b, h, t, e), dtype=q.dtype, device=q.device)
    dk = torch.empty((b, kv_heads, s, e), dtype=k.dtype, device=k.device)
    dv = torch.empty_like(dk)
    options = _launch_options(q.dtype, kernels)

    def grid_kv(meta):
        return (_cdiv(s, meta["BLOCK_N"]), b * kv_heads)

    def grid_q(meta):
        return (_cdiv(t, meta["BLOCK_M"]), b * h)

    strides = (*q.stride(), *k.stride(), *v.stride(), *grad_out.stride())
    kernels._attn_bwd_dkdv[grid_kv](q, k, v, grad_out, lse, delta, dk, dv, *strides, *dk.stride(),
                                    h, kv_heads, h // kv_heads, t, s, scale, scale * LOG2E,
                                    HEAD_DIM=e, CAUSAL=bool(causal), **options)
    kernels._attn_bwd_dq[grid_q](q, k, v, grad_out, lse, delta, dq, *strides, *dq.stride(),
                                 h, h // kv_heads, t, s, scale, scale * LOG2E,
                                 HEAD_DIM=e, CAUSAL=bool(causal), **options)
    return dq, dk, dv


# ---- the kernels as torch custom operators -----------------------------------------------------------
# `raydist::flash_attention` (forward: out, lse) and `raydist::flash_attention_backward` (dq, dk, dv), with
# the autograd formula registered on the forward op. As operators (not autograd.Functions) they are what
# torch's dispatcher-level machinery sees: selective activation checkpointing's policy can keep their
# outputs (raydist.parallel.checkpointing.SAVE_OPS), and torch.compile treats them as opaque calls.
# Registration touches no device and imports no Triton: the kernels load on the first call.


@torch.library.custom_op("raydist::flash_attention", mutates_args=())
def _flash_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        scale: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_forward(q, k, v, causal, scale)


@_flash_attention_op.register_fake
def _(q, k, v, causal, scale):
    b, h, t, e = q.shape
    return q.new_empty((b, h, t, e)), q.new_empty((b, h, t), dtype=torch.float32)


@torch.library.custom_op("raydist::flash_attention_backward", mutates_args=())
def _flash_attention_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: Optional[float],
                                 grad_lse: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attention_backward(grad_out, q, k, v, out, lse, causal, scale, grad_lse)


@_flash_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, causal, scale, grad_lse):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    """Saves q, k, v, out and lse (O(T) beyond the inputs); the backward recomputes the probabilities.
    Gradients that no caller produced stay None (no zero tensors are materialised for them)."""
    q, k, v, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale = causal, scale
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = _flash_attention_backward_op(grad_out, q, k, v, out, lse, ctx.causal, ctx.scale, grad_lse)
    return dq, dk, dv, None, None


_flash_attention_op.register_autograd(_backward, setup_context=_setup_context)
FLASH_ATTENTION_OP = torch.ops.raydist.flash_attention.default  # what checkpointing policies look for


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    return_lse: bool = False, scale: float | None = None):
    """out (B,H,T,E), or (out, lse (B,H,T) fp32 natural log) with return_lse; differentiable in q, k, v.

    Under torch.autocast the inputs are cast to the autocast dtype first, as autocast does for sdpa.
    """
    cast = runtime.autocast_dtype(q.device.type)
    if cast is not None:
        q, k, v = q.to(cast), k.to(cast), v.to(cast)
    check_flash_inputs(q, k, v, causal)  # errors name the value here, not inside the operator
    runtime.count_call("attention.triton")
    out, lse = _flash_attention_op(q, k, v, bool(causal), None if scale is None else float(scale))
    return (out, lse) if return_lse else out


def triton_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The model's `attention_fn(q, k, v)` contract (causal) on the Triton kernel."""
    return flash_attention(q, k, v, causal=True)
