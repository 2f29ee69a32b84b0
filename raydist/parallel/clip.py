"""Gradient-norm clipping by the norm of the whole model's gradient, whatever the layout.

    ||g||^2 = sum over pipeline ranks of sum over this rank's gradient layouts of ||g_layout||^2

Gradients are grouped by layout (plain tensors, FSDP-sharded DTensors, TP-sharded DTensors of one mesh and
placements): each group's norm is a full norm (`full_tensor()` reduces a sharded DTensor's over its
shards), so mixed TP/FSDP layouts work, and every rank gets the number one process would. With a pipeline
the squares are summed over the pipeline group; a tied output copy on the last stage is clipped but not
counted (its matrix is the first stage's embedding, counted there).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: in-place updates land in the DTensor), a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _layout(t: torch.Tensor):
    return (t.device_mesh, tuple(t.placements)) if hasattr(t, "device_mesh") else None


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float, *, uncounted: Iterable = (),
                   pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip `params`' gradients to `max_norm` (0: only measure) by the global norm; returns that norm (a
    0-d fp32 tensor, the same on every rank). `uncounted`: parameters clipped but left out of the norm."""
    params = list(params)
    skip = {id(p) for p in uncounted}
    counted: dict = defaultdict(list)
    clipped: dict = defaultdict(list)
    for param in params:
        if param.grad is None:
            continue
        clipped[_layout(param.grad)].append(param)
        if id(param) not in skip:
            counted[_layout(param.grad)].append(param.grad)
    # the sum of squares lives on the training device: the pipeline group may be NCCL
    squared = torch.zeros((), dtype=torch.float32, device=params[0].device if params else None)
    for grads in counted.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        squared = squared + norm.float().to(squared.device) ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=pp_group)
    total = squared.sqrt()
    if max_norm > 0:
        # torch's clip_grads_with_norm_ arithmetic, on each gradient's local shard: a scale is the same on
        # every layout (Partial sums included), and DTensor's dispatch and first-use sharding propagation
        # for every gradient shape are skipped (see raydist.training.optim.ShardLocalAdamW)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        grads = [local_shard(p.grad) for group in clipped.values() for p in group]
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total
