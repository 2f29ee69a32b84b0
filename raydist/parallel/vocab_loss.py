"""Vocabulary-parallel cross-entropy: the loss of logits sharded over the vocabulary, without gathering them.

Rank r holds columns [r V/tp, (r+1) V/tp) of the logits z (N tokens x V). With m = max_v z, the loss
of token n with target y is

    loss_n = log sum_v exp(z_nv - m_n) - (z_ny - m_n)

and every term is a sum over the vocabulary, so each rank sums its own columns and two all-reduces of N
numbers finish it: the max (for stability only; any shared m gives the same loss) and the pair
(sum of exp, target logit, which only its owner adds). That is 3N floats instead of the N V logits
an all-gather would move. The gradient needs no communication:

    d loss / d z_nv = (softmax_nv - [v == y_n]) / N      on the rank that holds column v

A target equal to `loss.IGNORE` (a prompt token of prompt/response data) adds zero to the sum and to the
gradient, and N stays the number of all targets: the same quantity as `loss.cross_entropy`, so the runners'
masked-loss scaling (raydist.data.sft) applies unchanged under tensor parallelism.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from raydist.models.loss import IGNORE, cross_entropy


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
        # logits (N, V_r): this rank's columns [vocab_start, vocab_start + V_r); targets (N,) global ids
        z = logits.float()
        row_max = z.max(dim=-1).values  # (N,)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = z - row_max[:, None]
        exp = shifted.exp()
        local_target = targets - vocab_start
        owned = (local_target >= 0) & (local_target < z.shape[-1])  # (N,) this rank holds the target column
        index = local_target.clamp(0, z.shape[-1] - 1)[:, None]
        target_logit = torch.where(owned, shifted.gather(1, index).squeeze(1), 0.0)
        sums = torch.stack([exp.sum(dim=-1), target_logit])  # (2, N): one all-reduce for both sums
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        sum_exp, target_logit = sums
        counted = (targets != IGNORE).to(z.dtype)  # (N,) 1 where the target counts
        ctx.save_for_backward(exp / sum_exp[:, None], index, owned, counted)
        ctx.logits_dtype = logits.dtype
        return ((sum_exp.log() - target_logit) * counted).sum() / targets.numel()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, index, owned, counted = ctx.saved_tensors
        grad_logits = softmax.scatter_add(1, index, -owned.to(softmax.dtype)[:, None])  # softmax - one-hot
        grad_logits *= (grad / softmax.shape[0]) * counted[:, None]
        return grad_logits.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token loss (fp32) of logits (B, T, V) sharded Shard(-1) over a 1-D tp mesh, targets (B, T): sum over
    counted (not IGNORE) targets / all targets, the same number on every tp rank. Plain (unsharded) logits fall
    back to `loss.cross_entropy`."""
    if not isinstance(logits, DTensor):
        return cross_entropy(logits, targets)
    mesh = logits.device_mesh
    [placement] = logits.placements
    if not (isinstance(placement, Shard) and placement.dim in (-1, logits.ndim - 1)):
        raise ValueError(f"vocab_parallel_cross_entropy needs logits sharded over the vocabulary (Shard(-1)), "
                         f"got {logits.placements}")
    local = logits.to_local()  # (B, T, V/tp); its gradient is rewrapped as Shard(-1)
    vocab_start = mesh.get_local_rank() * local.shape[-1]  # even split (validate.check_tensor_parallel)
    return _VocabParallelCrossEntropy.apply(local.flatten(0, 1), targets.flatten(0, 1), vocab_start,
                                            mesh.get_group())
