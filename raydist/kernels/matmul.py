"""Triton matmul with a fused epilogue, as differentiable functions the model's linear layers call.

    matmul(a, b, bias=None, activation="none")   act(a @ b + bias), a (M, D), b (D, N)
    linear(x, weight, bias=None, activation=...)  act(x W^T + b) over the last dim, nn.Linear's layout
    swiglu(x, w_gate, w_up)                       silu(x W_gate^T) * (x W_up^T), one kernel, both products

The backward uses the same kernel (no epilogue) for dX = dZ W and dW = dZ^T X, each only when this backward
asks for it (`raydist.schedule.split_backward.wanted`: a zero-bubble schedule's B asks for dX alone and its
W for dW alone, so neither computes the other's GEMMs; `GEMMS` counts the launches); the activation's derivative
is applied in torch from the pre-activation the forward kernel stored alongside its output (SAVE_PRE), so
no matmul is recomputed. Supported: fp32, fp16, bf16 (all operands one dtype); activation none, gelu
(exact erf), silu. Any strides (a transposed weight is just a stride view, never copied). Under
torch.autocast the operands are cast to the autocast dtype first, as autocast does for F.linear.
The functions call the torch custom operators `raydist::matmul` and `raydist::swiglu` (autograd formulas
registered), so selective activation checkpointing sees and keeps their outputs.
"""

from __future__ import annotations

import collections
from typing import Optional

import torch
import torch.nn.functional as F

from raydist.kernels import runtime
from raydist.kernels.reference import ACTIVATIONS
from raydist.schedule.split_backward import wanted

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GEMMS: collections.Counter = collections.Counter()  # kernel launches in this process, "matmul" / "swiglu"


def _check(name_tensors: list[tuple[str, torch.Tensor]], activation: str = "none") -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not one of {', '.join(ACTIVATIONS)}")
    first_name, first = name_tensors[0]
    for name, x in name_tensors:
        if x.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} has dtype {x.dtype}; the Triton matmul supports fp32, fp16, bf16")
        if x.dtype != first.dtype:
            raise ValueError(f"{name} is {x.dtype} but {first_name} is {first.dtype}; cast them to one dtype")
        if x.device != first.device:
            raise ValueError(f"{name} is on {x.device} but {first_name} is on {first.device}")
        if x.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(x.shape)})")
        if x.numel() >= 2**31:
            raise ValueError(f"{name} {tuple(x.shape)} holds >= 2^31 elements, beyond the kernel's 32-bit "
                             "offsets; split it into smaller calls")
    runtime.check_tensor_device(first, first_name)


def _launch(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none",
            b2: torch.Tensor | None = None, save_pre: bool = False):
    """C = epilogue(a @ b) for a (..., D), b (D, N): C (..., N) contiguous, written in place by the kernel
    (not a reshaped view, which FSDP2 warns about on a module's output); plus the pre-activations (h1, h2)
    of the same shape when save_pre."""
    if a.dim() < 2 or b.dim() != 2 or a.shape[-1] != b.shape[0]:
        raise ValueError(f"matmul needs a (M, D) and b (D, N); got a {tuple(a.shape)}, b {tuple(b.shape)}")
    if b2 is not None and b2.shape != b.shape:
        raise ValueError(f"the SwiGLU up weight {tuple(b2.shape)} must match the gate weight {tuple(b.shape)}")
    if bias is not None and bias.shape != (b.shape[1],):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({b.shape[1]},) for N={b.shape[1]}")
    kernels = runtime.load_kernel_module("triton_matmul")
    GEMMS["swiglu" if b2 is not None else "matmul"] += 1
    a2 = a.reshape(-1, a.shape[-1])  # (M, D): a view when the leading dims are contiguous
    (m, d), n = a2.shape, b.shape[1]
    c = torch.empty((*a.shape[:-1], n), dtype=a.dtype, device=a.device)  # row-major: C[m, n] at m * N + n
    h1 = torch.empty_like(c) if save_pre else c  # unused pointers alias C (never written when not saving)
    h2 = torch.empty_like(c) if save_pre and b2 is not None else c
    b2_ = b if b2 is None else b2

    def grid(meta):
        return ((m + meta["BLOCK_M"] - 1) // meta["BLOCK_M"] * ((n + meta["BLOCK_N"] - 1) // meta["BLOCK_N"]),)

    kernels._matmul[grid](a2, b, b2_, bias if bias is not None else c, c, h1, h2, m, n, d,
                          *a2.stride(), *b.stride(), *b2_.stride(), n, 1,
                          HAS_BIAS=bias is not None, ACTIVATION=kernels.ACTIVATION_CODES[activation],
                          SWIGLU=b2 is not None, SAVE_PRE=save_pre,
                          UPCAST=kernels.INTERPRETED and a.dtype == torch.bfloat16,
                          PRECISION="tf32" if torch.get_float32_matmul_precision() != "highest" else "ieee")
    return c, (h1 if save_pre else None), (h2 if save_pre and b2 is not None else None)


def _activation_grad(grad: torch.Tensor, pre: torch.Tensor, activation: str) -> torch.Tensor:
    """dL/dz = dL/dy * act'(z), in fp32, returned in grad's dtype."""
    g, z = grad.float(), pre.float()
    if activation == "gelu":  # d/dz [z Phi(z)] = Phi(z) + z phi(z)
        cdf = 0.5 * (1.0 + torch.erf(z * 0.7071067811865476))
        pdf = torch.exp(-0.5 * z * z) * 0.3989422804014327
        g = g * (cdf + z * pdf)
    elif activation == "silu":  # d/dz [z s(z)] = s(z) (1 + z (1 - s(z)))
        s = torch.sigmoid(z)
        g = g * (s * (1.0 + z * (1.0 - s)))
    return g.to(grad.dtype)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])  # (..., K) -> (M, K)


# ---- the kernel as torch custom operators -------------------------------------------------------------
# `raydist::matmul` (act(a @ b + bias), and the pre-activation when asked) and `raydist::swiglu` (the fused
# SwiGLU product and both pre-activations), with their autograd formulas registered. As operators (not
# autograd.Functions) they are visible to torch's dispatcher-level machinery: selective activation
# checkpointing's policy keeps their outputs (raydist.parallel.checkpointing.SAVE_OPS) as it keeps aten.mm's,
# and torch.compile treats them as opaque calls. The backward calls `raydist::matmul` itself (no epilogue).
# Registration touches no device and imports no Triton: the kernel loads on the first call.


@torch.library.custom_op("raydist::matmul", mutates_args=())
def _matmul_op(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], activation: str,
               save_pre: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(a @ b + bias) (..., N), the pre-activation a @ b + bias (..., N), or an empty tensor unless
    save_pre) for a (..., D), b (D, N)."""
    out, pre, _ = _launch(a, b, bias, activation, save_pre=save_pre)
    return out, (pre if pre is not None else a.new_empty(0))


@_matmul_op.register_fake
def _(a, b, bias, activation, save_pre):
    shape = (*a.shape[:-1], b.shape[1])
    return a.new_empty(shape), a.new_empty(shape if save_pre else 0)


def _matmul_setup(ctx, inputs, output):
    a, b, bias, activation, save_pre = inputs
    pre = output[1]
    ctx.mark_non_differentiable(pre)  # an internal output: the backward's act'(z), never a result
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(a, b, pre if save_pre else None)
    ctx.activation, ctx.has_bias = activation, bias is not None


def _plain(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _matmul_op(a, b, None, "none", False)[0]


def _matmul_backward(ctx, grad, _grad_pre):
    if grad is None:
        return None, None, None, None, None
    a, b, pre = ctx.saved_tensors
    grad = grad if pre is None else _activation_grad(grad, pre, ctx.activation)
    grad_a = _plain(grad, b.t()) if wanted(ctx, 0) else None  # (..., N) @ (N, D)
    grad2 = _rows(grad)  # (M, N)
    grad_b = _plain(_rows(a).t(), grad2) if wanted(ctx, 1) else None  # (D, M) @ (M, N)
    grad_bias = grad2.float().sum(0).to(grad.dtype) if ctx.has_bias and wanted(ctx, 2) else None
    return grad_a, grad_b, grad_bias, None, None


_matmul_op.register_autograd(_matmul_backward, setup_context=_matmul_setup)


@torch.library.custom_op("raydist::swiglu", mutates_args=())
def _swiglu_op(x: torch.Tensor, w_gate_t: torch.Tensor, w_up_t: torch.Tensor,
               save_pre: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(silu(x @ w_gate_t) * (x @ w_up_t), x @ w_gate_t, x @ w_up_t) for x (..., D), w_*_t (D, F): each
    (..., F); the two pre-activations are empty tensors unless save_pre."""
    out, h1, h2 = _launch(x, w_gate_t, b2=w_up_t, save_pre=save_pre)
    if not save_pre:
        h1 = h2 = None
    return out, (h1 if h1 is not None else x.new_empty(0)), (h2 if h2 is not None else x.new_empty(0))


@_swiglu_op.register_fake
def _(x, w_gate_t, w_up_t, save_pre):
    shape = (*x.shape[:-1], w_gate_t.shape[1])
    pre = shape if save_pre else 0
    return x.new_empty(shape), x.new_empty(pre), x.new_empty(pre)


def _swiglu_setup(ctx, inputs, output):
    x, w_gate_t, w_up_t, save_pre = inputs
    _, h1, h2 = output
    if not save_pre:  # (the wrapper asks for them whenever a gradient can be needed)
        raise RuntimeError("raydist::swiglu was called with save_pre=False on inputs that need gradients")
    ctx.mark_non_differentiable(h1, h2)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, w_gate_t, w_up_t, h1, h2)


def _swiglu_backward(ctx, grad, _grad_h1, _grad_h2):
    if grad is None:
        return None, None, None, None
    x, w_gate_t, w_up_t, h1, h2 = ctx.saved_tensors
    g, z1, z2 = grad.float(), h1.float(), h2.float()
    s = torch.sigmoid(z1)
    grad_up = (g * z1 * s).to(grad.dtype)  # d/dz2 [silu(z1) z2] = silu(z1)
    grad_gate = (g * z2 * s * (1.0 + z1 * (1.0 - s))).to(grad.dtype)  # z2 silu'(z1)
    grad_x = _plain(grad_gate, w_gate_t.t()) + _plain(grad_up, w_up_t.t()) if wanted(ctx, 0) else None
    x_t = _rows(x).t()  # (D, M)
    grad_w_gate = _plain(x_t, _rows(grad_gate)) if wanted(ctx, 1) else None
    grad_w_up = _plain(x_t, _rows(grad_up)) if wanted(ctx, 2) else None
    return grad_x, grad_w_gate, grad_w_up, None


_swiglu_op.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)
MATMUL_OPS = (torch.ops.raydist.matmul.default, torch.ops.raydist.swiglu.default)  # for checkpointing policies


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _autocast(*tensors):
    cast = runtime.autocast_dtype(tensors[0].device.type)
    if cast is None:
        return tensors
    return tuple(t if t is None else t.to(cast) for t in tensors)


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str = "none") -> torch.Tensor:
    """act(a @ b + bias) with a (M, D), b (D, N), bias (N,) or None; differentiable."""
    if a.dim() != 2:
        raise ValueError(f"matmul needs a (M, D) and b (D, N); got a {tuple(a.shape)}, b {tuple(b.shape)}")
    a, b, bias = _autocast(a, b, bias)
    _check([("a", a), ("b", b)] + ([("bias", bias)] if bias is not None else []), activation)
    runtime.count_call("matmul.triton")
    save_pre = activation != "none" and _needs_grad(a, b, bias)  # z, for act'(z) in backward
    return _matmul_op(a, b, bias, activation, save_pre)[0]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str = "none") -> torch.Tensor:
    """act(x W^T + b): x (..., D), weight (N, D) -> (..., N), as F.linear (then the activation)."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)} (needs "
                         f"x[..., {weight.shape[-1]}])")
    x, weight, bias = _autocast(x, weight, bias)
    _check([("x", x), ("weight", weight)] + ([("bias", bias)] if bias is not None else []), activation)
    runtime.count_call("matmul.triton")
    save_pre = activation != "none" and _needs_grad(x, weight, bias)
    return _matmul_op(x, weight.t(), bias, activation, save_pre)[0]


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T): x (..., D), w_gate and w_up (F, D) -> (..., F), one fused kernel."""
    x, w_gate, w_up = _autocast(x, w_gate, w_up)
    if w_gate.dim() != 2 or w_gate.shape != w_up.shape or x.shape[-1] != w_gate.shape[1]:
        raise ValueError(f"swiglu: x {tuple(x.shape)}, w_gate {tuple(w_gate.shape)}, w_up {tuple(w_up.shape)} "
                         "must be (..., D), (F, D), (F, D)")
    _check([("x", x), ("w_gate", w_gate), ("w_up", w_up)])
    runtime.count_call("swiglu.triton")
    return _swiglu_op(x, w_gate.t(), w_up.t(), _needs_grad(x, w_gate, w_up))[0]


def torch_swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """The unfused torch path with the same contract (what FeedForward computes by default)."""
    return F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)
