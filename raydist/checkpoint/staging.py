"""Staging for asynchronous checkpoint saves: a host copy of the state that the background writer reads
while training goes on. The copies are the only part of an async save that stalls training, so the buffers
are kept between saves and refilled in place, and CUDA tensors go to pinned memory with non-blocking copies."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor


def stage(tree: Any, pinned: bool = False, previous: dict | None = None, kept: dict | None = None,
           path: tuple = ()) -> Any:
    """A CPU copy of a nested state dict (DTensors stay DTensors, with CPU local shards).

    pinned: CUDA tensors are copied into page-locked host memory with non-blocking copies (DMA transfers,
    all in flight at once), and the caller waits once for them (`wait_for_copies`) before the writer
    thread reads them. Without it each tensor is a synchronous copy through pageable memory.
    previous: {key path: host tensor} of the previous staging, refilled in place where the layout is the
    same; `kept` receives this staging's buffers for the next one. A fresh allocation of that size is a
    fresh mmap whose every page faults (and is zeroed by the kernel) on first touch, about as slow again as
    the copy itself (TorchTitan keeps its pinned staging buffers between saves for the same reason)."""
    if isinstance(tree, dict):
        return {k: stage(v, pinned, previous, kept, path + (k,)) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        source = tree.detach()
        staged = (previous or {}).get(path)
        if staged is not None and _same_layout(staged, source):
            with torch.no_grad():
                _local(staged).copy_(_local(source), non_blocking=pinned and source.device.type == "cuda")
        elif pinned and source.device.type == "cuda":
            staged = _pinned_copy(source)
        else:
            staged = source.to("cpu", copy=True)
        if kept is not None:
            kept[path] = staged
        return staged
    return tree


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _same_layout(held: torch.Tensor, source: torch.Tensor) -> bool:
    """`held` (a staging buffer) can take `source`'s values in place: same kind, global and local shape,
    dtype and (for DTensors) mesh and placements."""
    if type(held) is not type(source) or held.shape != source.shape or held.dtype != source.dtype:
        return False
    if isinstance(source, DTensor):
        if held.device_mesh != source.device_mesh or held.placements != source.placements:
            return False
    h, s = _local(held), _local(source)
    return h.shape == s.shape and h.device.type == "cpu" and h.is_contiguous()


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (a CUDA tensor, or a DTensor with a CUDA local shard) copied to the host, not yet
    synchronised. A non-blocking CUDA-to-CPU `_to_copy` allocates its output in pinned memory, and on a
    DTensor it copies the local shard and keeps the mesh, placements and global shape (as the blocking
    path's `.to("cpu")` does; `DTensor.from_local` would move a CPU shard back to the mesh's device)."""
    return tensor.to("cpu", non_blocking=True, copy=True)


def cuda_devices(tree: Any) -> set[torch.device]:
    if isinstance(tree, dict):
        return set().union(*(cuda_devices(v) for v in tree.values()))
    return {tree.device} if isinstance(tree, torch.Tensor) and tree.device.type == "cuda" else set()


def wait_for_copies(devices: set[torch.device]) -> None:
    """The staged copies were queued on each device's current stream: wait for those streams (only the
    devices the state lives on, so no CUDA context is created on any other)."""
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
