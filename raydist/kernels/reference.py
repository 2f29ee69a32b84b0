"""Plain-torch versions of every kernel: the oracle the tests compare against, and the CPU path.

They define the semantics the Triton kernels must reproduce, in the clearest form, computing in fp32 (or
fp64 when given fp64, for a tighter oracle) and returning the input dtype. Autograd through them gives the
reference gradients, including the gradient through the log-sum-exp.

Shapes: B batch, H query heads, K key/value heads (H a multiple of K), T query length, S key length,
E head dim; M, N, D matrix sizes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

ACTIVATIONS = ("none", "gelu", "silu")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_attention_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """ValueError naming the offending shape when q (B,H,T,E), k/v (B,K,S,E) do not fit together."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} has shape {tuple(x.shape)}; attention expects 4 dims "
                             f"(batch, heads, seq, head_dim), q (B,H,T,E) and k/v (B,K,S,E)")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    (b, h, t, e), (bk, kh, s, ek) = q.shape, k.shape
    if (b, e) != (bk, ek):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head_dim")
    if kh == 0 or h % kh:
        raise ValueError(f"query heads H={h} must be a multiple of key/value heads K={kh} (grouped-query)")
    if t == 0 or s == 0 or b == 0 or h == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}; every dimension must be >= 1")
    if causal and t != s:
        raise ValueError(f"causal attention needs equal query and key lengths, got T={t}, S={s}; "
                         "pass causal=False for a block of keys wholly before the queries")


def repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, K, S, E) -> (B, H, S, E): kv head j serves query heads j*H/K .. (j+1)*H/K - 1."""
    reps = num_heads // x.shape[1]
    return x if reps == 1 else x.repeat_interleave(reps, dim=1)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                        return_lse: bool = False, scale: float | None = None):
    """softmax(q k^T * scale + causal mask) v, materialising the (B, H, T, S) scores.

    Returns out (B, H, T, E) in q's dtype, and with return_lse also lse (B, H, T) = log sum_j exp(s_ij),
    natural log, fp32 (fp64 for fp64 input): what ring attention needs to merge partial results.
    """
    check_attention_shapes(q, k, v, causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    cd = _compute_dtype(q.dtype)
    kf, vf = repeat_kv(k, q.shape[1]).to(cd), repeat_kv(v, q.shape[1]).to(cd)
    scores = (q.to(cd) @ kf.transpose(-2, -1)) * scale  # (B, H, T, S)
    if causal:
        t = q.shape[2]
        future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, T)
    out = (torch.exp(scores - lse[..., None]) @ vf).to(q.dtype)
    return (out, lse) if return_lse else out


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Combine attention over two disjoint key sets (what ring attention does per step).

    lse = log(exp(lse_a) + exp(lse_b));  out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    out = torch.exp(lse_a - lse)[..., None] * out_a.float() + torch.exp(lse_b - lse)[..., None] * out_b.float()
    return out.to(out_a.dtype), lse


def activation_reference(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "none":
        return x
    if activation == "gelu":
        return F.gelu(x)  # exact (erf) GELU, as nn.GELU() by default
    if activation == "silu":
        return F.silu(x)
    raise ValueError(f"activation={activation!r} is not one of {', '.join(ACTIVATIONS)}")


def matmul_reference(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
                     activation: str = "none") -> torch.Tensor:
    """act(a @ b + bias): a (M, D), b (D, N), bias (N,); computed in fp32, returned in a's dtype."""
    cd = _compute_dtype(a.dtype)
    out = a.to(cd) @ b.to(cd)
    if bias is not None:
        out = out + bias.to(cd)
    return activation_reference(out, activation).to(a.dtype)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     activation: str = "none") -> torch.Tensor:
    """act(x W^T + b) over the last dim of x (..., D): nn.Linear's layout, weight (N, D)."""
    out = matmul_reference(x.reshape(-1, x.shape[-1]), weight.t(), bias, activation)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def swiglu_reference(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T): the SwiGLU product feeding the MLP's down projection (..., F)."""
    cd = _compute_dtype(x.dtype)
    xf = x.to(cd)
    return (F.silu(xf @ w_gate.to(cd).t()) * (xf @ w_up.to(cd).t())).to(x.dtype)
