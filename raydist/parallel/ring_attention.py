"""Ring attention: causal attention over a sequence sharded zig-zag across the cp ranks of a ring.

Sharding (context.py): T tokens are cut into 2*cp chunks of c = T / (2 cp); rank r holds chunks r and
2cp-1-r, in that order, as its 2c local tokens. Causally, query chunk i sees key chunk j fully when j < i,
with the triangular mask when j == i, not at all when j > i. At ring step s = 0 .. cp-1 rank r holds the
K/V of rank src = (r - s) mod cp (chunks src and 2cp-1-src) and computes:

    s = 0     : its own 2c keys, causal (its two chunks are in order, so the local triangle is the mask)
    src < r   : all 2c queries  x  key chunk src (c keys)                      no mask
    src > r   : query chunk 2cp-1-r (c queries)  x  all 2c keys                no mask

so every step is 2c^2 scores on every rank (step 0's causal 2c x 2c triangle holds 2c^2 + c): equal work,
which contiguous sharding would not give (rank cp-1 would do 2cp-1 times rank 0's work).

The partial results merge by the log-sum-exp rule (as kernels.reference.merge_attention):
    lse = log(e^lse_a + e^lse_b),   out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b.

Communication (per attention call, per rank; K/V sent in their dtype, gradients in fp32, fp64 for fp64):
    forward : K and V to the next rank cp-1 times, overlapped with the current block's attention;
    backward: K and V again cp-1 times, and the fp32 dK/dV accumulator of each K/V block travels with it,
              collecting every rank's share, cp times (the last send returns it to its owner).
Point-to-point through `dist.batch_isend_irecv`, which gloo (CPU) and NCCL (CUDA) both run asynchronously.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from raydist.parallel.attention_blocks import block_functions

_KV_TAG, _GRAD_TAG = 0, 1


class Exchange:
    """One ring shift in flight: `wait()` returns what the previous rank sent. Holds the sent tensor until
    then, so its memory is not reused while the backend may still read it."""

    def __init__(self, sent: torch.Tensor, received: torch.Tensor, works: list):
        self.sent, self.received, self.works = sent, received, works

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        self.sent = self.works = None
        return self.received


class Ring:
    """The cp process group as a ring: `shift(x)` sends x to the next rank and receives the previous one's."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.size))
        self.next = ranks[(self.rank + 1) % self.size]  # global ranks, as P2POp wants them
        self.prev = ranks[(self.rank - 1) % self.size]

    def shift(self, tensor: torch.Tensor, tag: int) -> Exchange:
        """Start sending `tensor` to the next rank and receiving the previous rank's (a ring of one: itself)."""
        if self.size == 1:
            return Exchange(tensor, tensor, [])
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        # c10d.isend/irecv, not dist.isend: P2POp accepts only these two functions, and a communication
        # counter may have wrapped the names in torch.distributed (it counts batch_isend_irecv instead).
        ops = [dist.P2POp(c10d.isend, tensor, self.next, self.group, tag),
               dist.P2POp(c10d.irecv, received, self.prev, self.group, tag)]
        return Exchange(tensor, received, dist.batch_isend_irecv(ops))


def block_plan(rank: int, src: int, chunk: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) that rank `rank` attends with the K/V of rank `src` (see above)."""
    every = slice(None)
    if src == rank:
        return every, every, True
    if src < rank:
        return every, slice(0, chunk), False
    return slice(chunk, 2 * chunk), every, False


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32/bf16/fp16 inputs, fp64 for fp64 (the tests' tight oracle)."""
    return torch.promote_types(dtype, torch.float32)


def _rows(x: torch.Tensor, rows: slice) -> torch.Tensor:
    """x[:, :, rows] for (B, H, T, ...) tensors."""
    return x[:, :, rows]


def _merge_into(out: torch.Tensor, lse: torch.Tensor, rows: slice, block_out: torch.Tensor,
                block_lse: torch.Tensor) -> None:
    """out[rows], lse[rows] <- their merge with a block over other keys, in the accumulators' dtype (the
    rule of kernels.reference.merge_attention, kept in fp64 for fp64 input)."""
    old_out, old_lse = _rows(out, rows), _rows(lse, rows)
    new_lse = torch.logaddexp(old_lse, block_lse.to(lse.dtype))
    merged = (torch.exp(old_lse - new_lse)[..., None] * old_out
              + torch.exp(block_lse.to(lse.dtype) - new_lse)[..., None] * block_out.to(out.dtype))
    out[:, :, rows], lse[:, :, rows] = merged, new_lse


class RingAttentionFunction(torch.autograd.Function):
    """(q, k, v) local zig-zag shards -> (out, lse) of causal attention over the whole ring's sequence."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, backend: str, scale):
        forward_block, _ = block_functions(backend)
        acc = _accumulation_dtype(q.dtype)
        chunk = q.shape[2] // 2
        kv = torch.stack((k, v))  # (2, B, K, 2c, E): one message per step
        out = lse = None
        for step in range(ring.size):
            if step + 1 < ring.size:
                next_kv = ring.shift(kv, _KV_TAG)  # in flight while this block computes
            rows, keys, causal = block_plan(ring.rank, (ring.rank - step) % ring.size, chunk)
            block_out, block_lse = forward_block(_rows(q, rows), _rows(kv[0], keys), _rows(kv[1], keys), causal, scale)
            if out is None:  # step 0 covers every query row (each sees at least itself)
                # fresh accumulators, merged into in place: never the block's own tensors, which selective
                # activation checkpointing may hold in its cache for the recompute
                out, lse = block_out.to(acc, copy=True), block_lse.to(acc, copy=True)
            else:
                _merge_into(out, lse, rows, block_out, block_lse)
            if step + 1 < ring.size:
                kv = next_kv.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.backend, ctx.scale = ring, backend, scale
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        _, backward_block = block_functions(ctx.backend)
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        acc = _accumulation_dtype(q.dtype)
        chunk = q.shape[2] // 2
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack((k, v))
        incoming = None  # the dK/dV accumulator of the block about to be used, on its way from the previous rank
        for step in range(ring.size):
            if step + 1 < ring.size:
                next_kv = ring.shift(kv, _KV_TAG)
            rows, keys, causal = block_plan(ring.rank, (ring.rank - step) % ring.size, chunk)
            dq_block, dk_block, dv_block = backward_block(
                _rows(grad_out, rows), _rows(q, rows), _rows(kv[0], keys), _rows(kv[1], keys),
                _rows(out, rows), _rows(lse, rows), causal, ctx.scale,
                None if grad_lse is None else _rows(grad_lse, rows))
            dq[:, :, rows] += dq_block.to(acc)
            dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)  # (2, B, K, 2c, E)
            dkv[0][:, :, keys], dkv[1][:, :, keys] = dk_block.to(acc), dv_block.to(acc)
            if incoming is not None:  # the ranks before us in the ring have added their shares
                dkv += incoming.wait()
            # Pass the accumulator on with its K/V block; after the last step it is back at its owner.
            incoming = ring.shift(dkv, _GRAD_TAG)
            if step + 1 < ring.size:
                kv = next_kv.wait()
        dkv = incoming.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, backend: str = "torch",
                   scale: float | None = None, return_lse: bool = False):
    """Causal attention of this rank's zig-zag shard against the whole ring's sequence.

    q (B, H, 2c, E), k/v (B, K, 2c, E) hold chunks (r, 2cp-1-r) of the sequence on rank r; returns out
    (B, H, 2c, E) for the same tokens (and lse (B, H, 2c) fp32 with return_lse). Under autocast the inputs
    are cast to the autocast dtype first, as autocast does for sdpa; the blocks themselves never autocast.
    """
    if q.shape[2] % 2:
        raise ValueError(f"ring attention needs an even local sequence (two zig-zag chunks), got {q.shape[2]} "
                         "tokens; make seq_len a multiple of 2 x cp")
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):
        cast = torch.get_autocast_dtype(device_type)
        q, k, v = q.to(cast), k.to(cast), v.to(cast)
    with torch.autocast(device_type, enabled=False):
        out, lse = RingAttentionFunction.apply(q, k, v, ring, backend, scale)
    return (out, lse) if return_lse else out
