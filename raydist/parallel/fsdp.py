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


def expert_placement(shards: int):
    """FSDP's placement for a parameter (`shard_placement_fn`): Shard(0), except for a mixture of experts'
    stacked weights (E, out, in) with fewer experts than shards, split along dim 1 instead so that no rank
    holds an empty shard (Mixtral's 8 experts over 16 ranks; torchtitan does the same)."""
    from torch.distributed.tensor import Shard

    def place(param: torch.nn.Parameter):
        return Shard(1) if param.dim() == 3 and param.shape[0] < shards else None  # None: the default, Shard(0)

    return place


def apply_fsdp(model, mesh: DeviceMesh, compute_dtype: torch.dtype, *, reshard_after_forward: bool = True,
               forward_prefetch: bool = True) -> None:
    mp = mixed_precision_policy(compute_dtype)
    blocks = list(model.layers.values())
    place = expert_placement(mesh.size(mesh.ndim - 1))  # the sharding dim (HSDP: the second)
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
