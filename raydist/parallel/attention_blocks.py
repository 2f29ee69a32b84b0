"""Attention over one (query block, key block) pair, forward and backward, without autograd: what ring
attention runs at each ring step. Two backends with one signature:

    forward(q, k, v, causal, scale)                                    -> out (B,H,T,E), lse (B,H,T) fp32
    backward(dout, q, k, v, out, lse, causal, scale, grad_lse=None)    -> dq, dk, dv

- `triton`: raydist.kernels' flash attention (`attention_forward` / `attention_backward`), on CUDA or on CPU
  under TRITON_INTERPRET=1;
- `aten`: torch's own fused attention kernels that return the log-sum-exp and tile internally (memory
  linear in T, never a (T, S) matrix): CUDA's memory-efficient attention (`_scaled_dot_product_efficient_
  attention`, any head dim, fp32 too) and the CPU's flash attention (`_scaled_dot_product_flash_attention_
  for_cpu`); grouped kv heads are expanded (`repeat_kv`, O(S) copies) and their gradients summed back. Their
  backward takes the merged out and lse as the flash backward does, but has no dlse term: a backward given
  one (a caller differentiating through the returned lse) runs the torch blocks. Where the Triton kernel
  cannot run (context.ring_backend_for): the CPU, and head dims the kernel lacks on CUDA;
- `torch`: plain torch in fp32 (fp64 for fp64 input), one tile of KEY_TILE keys at a time (online softmax
  forward, tiled backward), so memory grows linearly with the block's length, never with T x S: the
  reference the others are tested against, and `aten`'s backward with a dlse term.

q (B, H, T, E), k/v (B, K, S, E), H a multiple of K. `backward` takes the *merged* out and lse of the query
rows (over every key block, not just this one): with them P_ij = exp(scale q_i.k_j - lse_i) is already the
final softmax, and delta_i = sum_e dO_ie O_ie - dlse_i makes each block's (dq, dk, dv) its exact share of the
full gradient (the flash-attention backward, FlashAttention-2 Alg. 2, applied block by block).
"""

from __future__ import annotations

import math

import torch

from raydist.kernels.reference import repeat_kv
from raydist.metrics.kernels import count_call

BACKENDS = ("torch", "triton", "aten")


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


KEY_TILE = 256  # keys per tile of the torch blocks: (B, H, T, KEY_TILE) scores at a time


def _tiles(s: int, tile: int):
    return ((j, min(j + tile, s)) for j in range(0, s, tile))


def _tile_scores(qf, k, j0: int, j1: int, h: int, cd, scale: float, causal: bool):
    """Scores (B, H, T, j1 - j0) of the queries against keys [j0, j1), causally masked (key j > query i)."""
    kt = repeat_kv(k[:, :, j0:j1], h).to(cd)
    scores = (qf @ kt.transpose(-2, -1)) * scale
    if causal:
        rows = torch.arange(qf.shape[2], device=qf.device)[:, None]
        cols = torch.arange(j0, j1, device=qf.device)[None, :]
        scores = scores.masked_fill(cols > rows, float("-inf"))
    return kt, scores


def torch_forward(q, k, v, causal: bool, scale: float | None = None, tile: int | None = None):
    """Online softmax over key tiles (FlashAttention's recurrence, Dao et al. 2022, in plain torch): peak
    memory (B, H, T, tile) scores, linear in T, never the block's (B, H, T, S). fp32 (fp64 for fp64 input)."""
    count_call("attention.torch")
    scale, tile = _scale(q, scale), tile or KEY_TILE
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    (b, h, t, e), s = q.shape, k.shape[2]
    if causal and t != s:
        raise ValueError(f"a causal block is square, got {t} queries and {s} keys")
    with torch.no_grad():
        qf = q.to(cd)
        m = torch.full((b, h, t), float("-inf"), dtype=cd, device=q.device)  # running max
        den = torch.zeros((b, h, t), dtype=cd, device=q.device)  # running sum of exp(score - m)
        acc = torch.zeros((b, h, t, e), dtype=cd, device=q.device)
        for j0, j1 in _tiles(s, tile):
            _, scores = _tile_scores(qf, k, j0, j1, h, cd, scale, causal)
            m_new = torch.maximum(m, scores.amax(-1))
            safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with no key yet
            p = torch.exp(scores - safe[..., None])
            alpha = torch.exp(m - safe)
            den = den * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ repeat_kv(v[:, :, j0:j1], h).to(cd)
            m = m_new
        out = acc / den[..., None]
        lse = m + torch.log(den)
    return out.to(q.dtype), lse


def torch_backward(dout, q, k, v, out, lse, causal: bool, scale: float | None = None, grad_lse=None,
                   tile: int | None = None):
    """dS = P * (dP - delta), dq = scale dS k, dk = scale dS^T q, dv = P^T dO (kv heads summed over their
    query-head group), one key tile at a time: (B, H, T, tile) at a time, as the forward."""
    scale, tile = _scale(q, scale), tile or KEY_TILE
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    (b, h, _, e), kv_heads, s = q.shape, k.shape[1], k.shape[2]
    qf, do, lse_c = q.to(cd), dout.to(cd), lse.to(cd)[..., None]
    delta = (do * out.to(cd)).sum(-1)  # (B, H, T)
    if grad_lse is not None:
        delta = delta - grad_lse.to(cd)
    dq = torch.zeros_like(qf)
    dk = torch.empty((b, kv_heads, s, e), dtype=cd, device=q.device)
    dv = torch.empty_like(dk)
    for j0, j1 in _tiles(s, tile):
        kt, scores = _tile_scores(qf, k, j0, j1, h, cd, scale, causal)
        p = torch.exp(scores - lse_c)  # the final softmax's entries for these keys
        ds = p * (do @ repeat_kv(v[:, :, j0:j1], h).to(cd).transpose(-2, -1) - delta[..., None])
        dq += (ds @ kt) * scale
        dk[:, :, j0:j1] = ((ds.transpose(-2, -1) @ qf) * scale).view(b, kv_heads, h // kv_heads, j1 - j0, e).sum(2)
        dv[:, :, j0:j1] = (p.transpose(-2, -1) @ do).view(b, kv_heads, h // kv_heads, j1 - j0, e).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def triton_forward(q, k, v, causal: bool, scale: float | None = None):
    from raydist.kernels import attention_forward, runtime

    runtime.count_call("attention.triton")
    return attention_forward(q, k, v, causal, scale)


def triton_backward(dout, q, k, v, out, lse, causal: bool, scale: float | None = None, grad_lse=None):
    from raydist.kernels import attention_backward

    return attention_backward(dout, q, k, v, out, lse, causal, scale, grad_lse)


def _expand(q, k, v):
    """q, k, v contiguous, k and v with a head per query head (the fused kernels take no grouped heads)."""
    h = q.shape[1]
    return q.contiguous(), repeat_kv(k, h).contiguous(), repeat_kv(v, h).contiguous()


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def aten_forward(q, k, v, causal: bool, scale: float | None = None):
    count_call("attention.aten")
    scale = _scale(q, scale)
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"a causal block is square, got {q.shape[2]} queries and {k.shape[2]} keys")
    q, k, v = _expand(q, k, v)
    if q.device.type == "cuda":
        # (out, lse (B, H, T rounded up to a multiple of 32), philox seed, offset); dropout 0
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)
        lse = lse[..., :q.shape[2]]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse.to(_lse_dtype(q))


def aten_backward(dout, q, k, v, out, lse, causal: bool, scale: float | None = None, grad_lse=None):
    if grad_lse is not None:  # the fused kernels' backward has no dlse term
        return torch_backward(dout, q, k, v, out, lse, causal, scale, grad_lse)
    scale = _scale(q, scale)
    (b, h, _, e), kv_heads, s = q.shape, k.shape[1], k.shape[2]
    q_, k_, v_ = _expand(q, k, v)
    dout, out = dout.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
    if q.device.type == "cuda":
        padded = -(-q.shape[2] // 32) * 32  # the forward's lse length (its kernel's row blocks)
        lse_ = torch.nn.functional.pad(lse.float(), (0, padded - q.shape[2])).contiguous()
        unused = torch.empty((), dtype=torch.long, device=q.device)  # philox seed and offset: no dropout
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q_, k_, v_, None, out, lse_, unused, unused, 0.0, [True, True, True, False], causal,
            scale=scale)
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q_, k_, v_, out, lse.to(_lse_dtype(q)).contiguous(), 0.0, causal, scale=scale)
    if kv_heads != h:  # each kv head's gradient: the sum over the query heads that read it
        dk = dk.view(b, kv_heads, h // kv_heads, s, e).sum(2)
        dv = dv.view(b, kv_heads, h // kv_heads, s, e).sum(2)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def block_functions(backend: str):
    """(forward, backward) of `backend` ('torch', 'triton' or 'aten')."""
    if backend == "torch":
        return torch_forward, torch_backward
    if backend == "triton":
        return triton_forward, triton_backward
    if backend == "aten":
        return aten_forward, aten_backward
    raise ValueError(f"attention block backend {backend!r} is not one of {', '.join(BACKENDS)}")
