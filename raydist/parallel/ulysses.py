"""Ulysses (DeepSpeed-Ulysses) attention: all-to-all from sequence shards to head shards and back.

Rank r holds tokens [r T/cp, (r+1) T/cp) of every head (contiguous sharding, context.py). One all-to-all
turns that into all T tokens of heads [r H/cp, (r+1) H/cp); the unchanged causal attention (sdpa, Triton,
eager: whatever the model had) runs on full sequences; a second all-to-all brings the output back to
sequence shards. Work is balanced by construction (every rank has all tokens of H/cp heads).

    q (B, H, T/cp, E), k/v (B, K, T/cp, E)  --a2a-->  (B, H/cp, T, E), (B, K'/cp, T, E)
    --attention--> (B, H/cp, T, E)  --a2a-->  (B, H, T/cp, E)

Grouped-query attention: the K kv heads must split over cp too. When cp does not divide K they are repeated
first to K' = lcm(K, cp) heads (which divides H, as both K and cp do), each kv head serving the same query
heads as before; that sends K'/K times more K/V bytes. q, k and v travel in one all-to-all (packed per
destination rank), so a layer costs two all-to-alls in forward and two in backward, each moving
(cp-1)/cp of the tensors: q+k+v then out in forward, their gradients in backward.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from raydist.kernels.reference import repeat_kv


class AllToAll(torch.autograd.Function):
    """x (cp, ...) -> y with y[i] on rank r = x[r] on rank i. Its adjoint is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        ctx.group = group
        x = x.contiguous()
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def kv_heads_for(num_kv_heads: int, cp: int) -> int:
    """kv heads after repetition so that cp divides them: K if cp | K, else lcm(K, cp)."""
    return num_kv_heads if num_kv_heads % cp == 0 else math.lcm(num_kv_heads, cp)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, inner: Callable) -> torch.Tensor:
    """`inner(q, k, v)` (causal, full sequence) on head shards; q (B, H, T/cp, E), k/v (B, K, T/cp, E) are
    contiguous sequence shards in rank order; returns (B, H, T/cp, E)."""
    cp = dist.get_world_size(group)
    b, h, t_local, e = q.shape
    if h % cp:
        raise ValueError(f"Ulysses needs the query heads on this rank ({h}) divisible by cp={cp}; change "
                         "parallel.cp (or tp), or use parallel.cp_impl=ring")
    kv_heads = kv_heads_for(k.shape[1], cp)
    k, v = repeat_kv(k, kv_heads), repeat_kv(v, kv_heads)
    hq, hk = h // cp, kv_heads // cp
    # (cp, B, hq + 2 hk, T/cp, E): slice i goes to rank i (its heads of q, k and v)
    packed = torch.cat([x.unflatten(1, (cp, -1)) for x in (q, k, v)], dim=2).transpose(0, 1)
    gathered = AllToAll.apply(packed, group)  # slice i: sequence shard i of this rank's heads
    # (B, heads, T, E) in sequence order, each in its own storage: attention saves q for backward, and a
    # view of one packed q|k|v tensor would keep k and v alive with it
    q_heads, k_heads, v_heads = (part.permute(1, 2, 0, 3, 4).flatten(2, 3)
                                 for part in gathered.split([hq, hk, hk], dim=2))
    out = inner(q_heads, k_heads, v_heads)  # (B, hq, T, E)
    back = out.unflatten(2, (cp, t_local)).permute(2, 0, 1, 3, 4)  # (cp, B, hq, T/cp, E): shard i to rank i
    back = AllToAll.apply(back, group)  # slice i: head group i of this rank's tokens
    return back.transpose(0, 1).flatten(1, 2)  # (B, H, T/cp, E)
