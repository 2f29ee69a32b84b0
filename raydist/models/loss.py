"""The training loss, apart from any one model: next-token cross-entropy over logits (B, T, V) in fp32,
with IGNORE targets (prompt tokens of prompt/response data) counting as zero; and the head's matmul and
that loss together, a chunk of tokens at a time (`linear_cross_entropy`, vocabulary-parallel under tensor
parallelism). The vocabulary-parallel loss of given logits is raydist.parallel.vocab_loss; all divide by
the same count."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from raydist.schedule.split_backward import wanted

IGNORE = -100  # target id of a token that does not count (prompt tokens of prompt/response data)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token loss in fp32, logits (B, T, V), targets (B, T): the sum over counted targets / all B T
    targets, an IGNORE target counting as zero (the plain mean when every target counts). Dividing by all
    targets, not the counted ones, keeps every micro-batch's weight its share of the rows; the runners
    rescale by the step's targets / counted targets (raydist.data.sft)."""
    total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), ignore_index=IGNORE,
                            reduction="sum")
    return total / targets.numel()


# ---- the head's matmul and the loss together, chunk by chunk of tokens ---------------------------------

LOGITS_CHUNK_BYTES = 32 * 2**20  # fp32 logits of one chunk of tokens (V = 128256: 65 tokens, 32 MiB)


def chunk_rows(vocab: int, chunk_bytes: int = LOGITS_CHUNK_BYTES) -> int:
    """Tokens per chunk of `linear_cross_entropy`: as many as fit `chunk_bytes` of fp32 logits, at least one."""
    return max(1, chunk_bytes // (4 * vocab))


def matmul_dtype(h: torch.Tensor) -> torch.dtype:
    """What F.linear would compute in here: autocast's dtype where autocast is on, else the input's."""
    device = h.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype


class ChunkOps(NamedTuple):
    """The elementwise work on one chunk of logits z (rows, V_r), in the head matmul's dtype:
    `stats(z, index)` -> (log-sum-exp of each row, z at column index[row]), fp32; `grad_(z, lse, index, hit,
    scale)` -> (exp(z - lse) - one_hot(index) where hit) * scale per row, in z's dtype (may overwrite z).
    TORCH_CHUNKS here; Triton kernels in raydist.kernels.cross_entropy (`kernels.loss = triton`)."""

    stats: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    grad_: Callable[..., torch.Tensor]


def _torch_stats(z: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = z.float()  # as F.linear + .float() give the plain loss its logits
    return torch.logsumexp(z, dim=-1), z.gather(1, index[:, None]).squeeze(1)


def _torch_grad(z: torch.Tensor, lse: torch.Tensor, index: torch.Tensor, hit: torch.Tensor,
                scale: torch.Tensor) -> torch.Tensor:
    dz = z.float().sub_(lse[:, None]).exp_()  # the softmax, in place from here: one (rows, V_r) fp32 buffer
    dz.scatter_add_(1, index[:, None], -hit[:, None].float())  # minus the one-hot where this rank holds it
    return dz.mul_(scale[:, None]).to(z.dtype)  # in the logits' dtype, as the plain loss hands it on


TORCH_CHUNKS = ChunkOps(_torch_stats, _torch_grad)


class _LinearCrossEntropy(torch.autograd.Function):
    """cross_entropy(h W^T, targets) without the (N, V) logits: the forward keeps each token's log-sum-exp
    (N floats), the backward recomputes one chunk's logits at a time, turns them into the softmax minus the
    one-hot target (the gradient of the logits) and multiplies it straight into dh and dW. One more matmul
    than the plain loss (the logits twice), for (rows, V) fp32 at a time instead of (N, V) and its gradient
    (the chunked loss of Liger-Kernel, Hsu et al. 2024, with the recompute of FlashAttention's backward).

    Vocabulary-parallel with `group` (tensor parallelism): `weight` is this rank's rows [vocab_start,
    vocab_start + V_r) of the head and `h` every token's hidden state. Each rank keeps its columns'
    log-sum-exp of every token and the target's logit where it holds the target; two all-reduces of N
    floats combine them (the max, then the sums of exp(lse - max) and of the target logits), the 3N floats
    of Megatron-LM's vocabulary-parallel cross-entropy, never its (N, V_r) logits. The backward needs no
    communication: dW is this rank's rows' own, dh this rank's term of a sum over the group (the caller
    declares it partial). Each backward computes only the gradients the autograd engine will use
    (`split_backward.wanted`: a zero-bubble B asks for dh alone, its W for dW alone)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int, vocab_start: int,
                group, ops: ChunkOps) -> torch.Tensor:
        cd = matmul_dtype(h)
        n, v_local = h.shape[0], weight.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        picked = torch.empty(n, dtype=torch.float32, device=h.device)
        local = targets - vocab_start
        counted = targets != IGNORE
        hit = counted & (local >= 0) & (local < v_local)  # this rank holds the (counted) target's column
        index = local.clamp(0, v_local - 1)
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(cd)
            for s in range(0, n, rows):
                z = h[s:s + rows].to(cd) @ w.t()  # (rows, V_r), as F.linear gives them
                lse[s:s + rows], picked[s:s + rows] = ops.stats(z, index[s:s + rows])
        picked = torch.where(hit, picked, 0.0)
        if group is not None:  # the whole vocabulary's log-sum-exp and target logit, on every rank
            top = lse.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            sums = torch.stack([(lse - top).exp(), picked])
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            lse, picked = top + sums[0].log(), sums[1]
        ctx.save_for_backward(h, weight, index, hit, counted, lse)
        ctx.rows, ctx.cd, ctx.ops = rows, cd, ops
        return torch.where(counted, lse - picked, 0.0).sum() / n

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, weight, index, hit, counted, lse = ctx.saved_tensors
        rows, cd, n = ctx.rows, ctx.cd, h.shape[0]
        want_h, want_w = wanted(ctx, 0), wanted(ctx, 1)
        dh = torch.empty_like(h) if want_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        scale = torch.where(counted, grad.float() / n, 0.0)
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(cd)
            for s in range(0, n, rows) if want_h or want_w else ():
                hc, part = h[s:s + rows].to(cd), slice(s, s + rows)
                dz = ctx.ops.grad_(hc @ w.t(), lse[part], index[part], hit[part], scale[part])  # (rows, V_r)
                if want_h:
                    dh[part] = (dz @ w).to(h.dtype)
                if want_w and dz.dtype == dw.dtype:
                    dw.addmm_(dz.t(), hc)
                elif want_w:
                    dw += (dz.t() @ hc).float()
        return dh, None if dw is None else dw.to(weight.dtype), None, None, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         rows: int | None = None, ops: ChunkOps = TORCH_CHUNKS) -> torch.Tensor:
    """`cross_entropy(F.linear(h, weight), targets)` for h (B, T, D), weight (V, D), targets (B, T), with
    at most `rows` tokens' logits (default: `chunk_rows(V)`, 32 MiB of fp32) alive at once, in the forward
    and in the backward: the same loss and gradients (to fp32 rounding) without the (B, T, V) logits and
    their gradient. Under autocast the matmuls run in autocast's dtype, as F.linear's would. `ops`: the
    elementwise work on each chunk (`ChunkOps`: torch's, or the Triton kernels').

    Tensor parallelism's column-parallel head: `weight` a DTensor split over the vocabulary (Shard(0)) on a
    1-D mesh, `h` a DTensor replicated on it (what the head's input becomes); the loss is then
    vocabulary-parallel (`_LinearCrossEntropy`), the same value on every rank, and `h`'s gradient the sum of
    the ranks' parts (declared Partial, so the head's input layout reduces it: an all-reduce, or a
    reduce-scatter under sequence parallelism). Chunks are `rows` tokens of this rank's V / tp columns."""
    vocab_start, group = 0, None
    if isinstance(weight, DTensor):
        mesh = weight.device_mesh
        if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),) or not isinstance(h, DTensor) \
                or tuple(h.placements) != (Replicate(),):
            raise ValueError(f"the vocabulary-parallel fused loss takes a head weight split over the vocabulary "
                             f"(Shard(0)) on a 1-D mesh and a replicated input, got {weight.placements} on a "
                             f"{mesh.ndim}-D mesh and {getattr(h, 'placements', 'a plain tensor')}")
        h, weight = h.to_local(grad_placements=(Partial(),)), weight.to_local()
        vocab_start = mesh.get_local_rank() * weight.shape[0]  # an even split (validate.check_tensor_parallel)
        group = mesh.get_group()
    return _LinearCrossEntropy.apply(h.flatten(0, 1), weight, targets.flatten(0, 1),
                                     rows or chunk_rows(weight.shape[0]), vocab_start, group, ops)
