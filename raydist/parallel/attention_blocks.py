"""Attention over one (query block, key block) pair, forward and backward, without autograd: what ring
attention runs at each ring step. Two backends with one signature:

    forward(q, k, v, causal, scale)                                    -> out (B,H,T,E), lse (B,H,T) fp32
    backward(dout, q, k, v, out, lse, causal, scale, grad_lse=None)    -> dq, dk, dv

- `triton`: raydist.kernels' flash attention (`attention_forward` / `attention_backward`), on CUDA or on CPU
  under TRITON_INTERPRET=1;
- `torch`: plain torch in fp32 (fp64 for fp64 input), materialising the block's (B, H, T, S) scores: the CPU
  path, and the oracle the Triton backend is checked against.

q (B, H, T, E), k/v (B, K, S, E), H a multiple of K. `backward` takes the *merged* out and lse of the query
rows (over every key block, not just this one): with them P_ij = exp(scale q_i.k_j - lse_i) is already the
final softmax, and delta_i = sum_e dO_ie O_ie - dlse_i makes each block's (dq, dk, dv) its exact share of the
full gradient (the flash-attention backward, FlashAttention-2 Alg. 2, applied block by block).
"""

from __future__ import annotations

import math

import torch

from raydist.kernels.reference import attention_reference, repeat_kv
from raydist.metrics.kernels import count_call

BACKENDS = ("torch", "triton")


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def torch_forward(q, k, v, causal: bool, scale: float | None = None):
    count_call("attention.torch")
    with torch.no_grad():
        return attention_reference(q, k, v, causal=causal, return_lse=True, scale=scale)


def torch_backward(dout, q, k, v, out, lse, causal: bool, scale: float | None = None, grad_lse=None):
    """dS = P * (dP - delta), dq = scale dS k, dk = scale dS^T q, dv = P^T dO (kv heads summed over their
    query-head group)."""
    scale = _scale(q, scale)
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    (b, h, t, e), kv_heads, s = q.shape, k.shape[1], k.shape[2]
    qf, kf, vf = q.to(cd), repeat_kv(k, h).to(cd), repeat_kv(v, h).to(cd)
    scores = (qf @ kf.transpose(-2, -1)) * scale  # (B, H, T, S)
    if causal:
        future = torch.ones(t, s, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    p = torch.exp(scores - lse.to(cd)[..., None])  # the final softmax's entries for these keys
    do = dout.to(cd)
    delta = (do * out.to(cd)).sum(-1)  # (B, H, T)
    if grad_lse is not None:
        delta = delta - grad_lse.to(cd)
    ds = p * (do @ vf.transpose(-2, -1) - delta[..., None])  # (B, H, T, S)
    dq = (ds @ kf) * scale
    dk = ((ds.transpose(-2, -1) @ qf) * scale).view(b, kv_heads, h // kv_heads, s, e).sum(2)
    dv = (p.transpose(-2, -1) @ do).view(b, kv_heads, h // kv_heads, s, e).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def triton_forward(q, k, v, causal: bool, scale: float | None = None):
    from raydist.kernels import attention_forward, runtime

    runtime.count_call("attention.triton")
    return attention_forward(q, k, v, causal, scale)


def triton_backward(dout, q, k, v, out, lse, causal: bool, scale: float | None = None, grad_lse=None):
    from raydist.kernels import attention_backward

    return attention_backward(dout, q, k, v, out, lse, causal, scale, grad_lse)


def block_functions(backend: str):
    """(forward, backward) of `backend` ('torch' or 'triton')."""
    if backend == "torch":
        return torch_forward, torch_backward
    if backend == "triton":
        return triton_forward, triton_backward
    raise ValueError(f"attention block backend {backend!r} is not one of {', '.join(BACKENDS)}")
