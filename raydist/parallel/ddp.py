"""Pure data parallelism: DistributedDataParallel over the dp (x cp) ranks, all-reducing gradients in
buckets that overlap backward (seed 001: each rank keeps a full replica, gradients cost 2x the parameter
bytes per step in a ring all-reduce)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel


def apply_ddp(model: torch.nn.Module, mesh: DeviceMesh, device: torch.device) -> DistributedDataParallel:
    return DistributedDataParallel(
        model,
        process_group=mesh.get_group(),
        device_ids=[device.index] if device.type == "cuda" else None,
        forward_sync_buffers=False,  # the only buffers are the RoPE tables, identical everywhere
        gradient_as_bucket_view=True,
    )
