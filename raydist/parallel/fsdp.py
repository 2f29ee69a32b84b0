"""FSDP2 (ZeRO-3) and HSDP: `fully_shard` per transformer block, then at the root.

Each block is one FSDP unit (Zhao et al. 2023, "PyTorch FSDP": the unit is the granularity of all-gather in
forward and of reduce-scatter in backward). An untied input embedding is a unit of its own, resharded after
its forward like a block (as TorchTitan does), and so is an untied output head, kept gathered from its
forward to its backward, which comes right after: the root unit's parameters are gathered when the model's
forward *starts*, so a head in the root would sit whole, with its all-gather buffer (FSDP2 keeps a unit's
buffer until the next unit's copy-out), beside the embedding and the first blocks through the whole forward:
two V x D matrices and two buffers at the forward's start (benchmarks/build_memory.py --trace at 953M
parameters, FSDP 4: peak 2231 -> 1981 MiB above the baseline). The root unit holds the final norm (and a tied
embedding and head, which must sit in the one unit that owns both uses). With a 2-D mesh (dp_replicate,
dp_shard_cp) this is HSDP: parameters are sharded inside a replica group and gradients are all-reduced
across groups.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def mixed_precision_policy(compute_dtype: torch.dtype) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 gradient reduction; fp32 parameters stay the master copy in the shards."""
    if compute_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


def _free_dim(param) -> int:
    """The first dim after the expert dim that no model-parallel split of `param` (a DTensor's Shard
    placements: tensor parallelism's) already takes: FSDP splitting the same dim again would be a strided
    split, whose pieces are not boxes."""
    taken = {p.dim for p in getattr(param, "placements", ()) if hasattr(p, "dim")}
    return next(d for d in range(1, param.dim()) if d not in taken)


def expert_placement(shards: int):
    """FSDP's placement for a parameter (`shard_placement_fn`): Shard(0), except for a mixture of experts'
    stacked weights (E, out, in) with fewer experts than shards, split along dim 1 instead so that no rank
    holds an empty shard (Mixtral's 8 experts over 16 ranks; torchtitan does the same), or dim 2 where tensor
    parallelism split dim 1 (`_free_dim`)."""
    from torch.distributed.tensor import Shard

    def place(param: torch.nn.Parameter):
        if param.dim() == 3 and param.shape[0] < shards:
            return Shard(_free_dim(param))
        return None  # the default, Shard(0)

    return place


def shard_experts(experts, ep_mesh: DeviceMesh, ep_tp_mesh: DeviceMesh) -> None:
    """Expert parallelism: replace each expert stack (E, out, in) of `experts` (a GroupedExperts) by a DTensor
    split along E over `ep_mesh` (Shard(0): this rank's E / R experts), keeping a tensor-parallel split
    (then a 2-D DTensor on `ep_tp_mesh`, (Shard(0), tp's placement)), and give the module the ep group for
    its all-to-all. Works on the meta device (the slice is a view of no storage) and on a real one (every rank
    built the same whole stack; it keeps its slice)."""
    from torch.distributed.tensor import DTensor, Shard

    ranks, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for holder in experts.stacks():
        whole = holder.weight
        if isinstance(whole, DTensor):  # split by tensor parallelism already
            local, mesh, placements = whole.to_local(), ep_tp_mesh, (Shard(0), *whole.placements)
        else:
            local, mesh, placements = whole, ep_mesh, (Shard(0),)
        local = local.detach().chunk(ranks, dim=0)[rank].clone()
        holder.weight = torch.nn.Parameter(DTensor.from_local(local, mesh, placements, run_check=False,
                                                              shape=whole.shape, stride=whole.stride()),
                                           requires_grad=whole.requires_grad)
    experts.ep_group = ep_mesh.get_group()


def _after_expert_dim(param: torch.nn.Parameter):
    from torch.distributed.tensor import Shard

    return Shard(_free_dim(param))


def apply_expert_fsdp(experts, mesh: DeviceMesh, mp: MixedPrecisionPolicy, reshard_after_forward: bool,
                      dp_size: int) -> None:
    """An expert-parallel stack's own FSDP unit on `mesh` (the data-parallel ranks outside ep: dp_shard / ep
    x cp, HSDP with dp_replicate). Split along dim 1 (out; dim 2 where tensor parallelism took dim 1), not
    0: the ep split already took dim 0, and FSDP's dim-0 split of it would be a strided one (`_StridedShard`)
    whose pieces are not boxes, which the keyed init, the checkpoint reader and the Hugging Face loader
    would each cut the slow general way.

    The reduction divides by `dp_size`, the whole data-parallel width (dp_replicate x dp_shard x cp), not by
    the unit's mesh: an expert's gradient already sums the tokens of all ep ranks (the all-to-all's
    backward), so it is the sum over every data-parallel rank, as a dense weight's is before its average.
    torch's factor uses NCCL's PREMUL_SUM, which gloo lacks: on a CPU mesh the reduction sums and divides after
    (`set_force_sum_reduction_for_comms`), except on a one-rank shard group, where FSDP skips the
    reduce-scatter and divides by the factor itself (torch 2.13 would divide twice with the sum forced)."""
    fully_shard(experts, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                shard_placement_fn=_after_expert_dim)
    experts.set_gradient_divide_factor(float(dp_size))
    shard_group = mesh[mesh.mesh_dim_names[-1]] if mesh.ndim > 1 else mesh
    if shard_group.size() > 1 and mesh.device_type != "cuda":  # cpu meshes run on gloo (raydist.parallel.runtime)
        experts.set_force_sum_reduction_for_comms(True)


def apply_fsdp(model, mesh: DeviceMesh, compute_dtype: torch.dtype, *, reshard_after_forward: bool = True,
               forward_prefetch: bool = True, expert_mesh: DeviceMesh | None = None, dp_size: int = 1) -> None:
    """`expert_mesh`: under expert parallelism (the experts already split over ep: `shard_experts`), the mesh
    each MoE block's experts are FSDP-sharded over, in a unit of their own (`apply_expert_fsdp`); `dp_size`
    the data-parallel width their reduction divides by."""
    mp = mixed_precision_policy(compute_dtype)
    blocks = list(model.layers.values())
    place = expert_placement(mesh.size(mesh.ndim - 1))  # the sharding dim (HSDP: the second)
    if expert_mesh is not None:
        from raydist.models.moe import moe_blocks

        for moe in moe_blocks(model):
            apply_expert_fsdp(moe.experts, expert_mesh, mp, reshard_after_forward, dp_size)
    embedding = model.embedding if model.embedding is not None and not model.tied else None
    if embedding is not None:
        fully_shard(embedding, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=place)
    head = model.head if model.head is not None and not model.tied else None
    if head is not None:  # used last in forward and first in backward: kept gathered in between
        fully_shard(head, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    # The root's parameters are used last in forward and first in backward: keeping them gathered after
    # forward avoids an all-gather right before backward needs them again.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    if forward_prefetch and embedding is not None and blocks:
        embedding.set_modules_to_forward_prefetch([blocks[0]])
        blocks[0].set_modules_to_backward_prefetch([embedding])
    if forward_prefetch and len(blocks) > 1:
        for current, following in zip(blocks, blocks[1:]):
            current.set_modules_to_forward_prefetch([following])
        for current, previous in zip(blocks[1:], blocks):
            current.set_modules_to_backward_prefetch([previous])
