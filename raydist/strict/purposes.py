"""Each process group's purpose, and the backend it gets from it.

A HOST group carries CPU tensors (bookkeeping: batch plans, flags, object gathers) and is gloo everywhere;
a DEVICE group carries the model's tensors and is NCCL on CUDA, gloo on CPU, or the strict backend on
CPU under the strict-collectives mode (raydist.strict), which refuses what NCCL would refuse. The strict
audit (raydist.strict.audit) reads a group's purpose to tell a host tensor in a DEVICE group from one in
a HOST group.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from raydist import strict

HOST, DEVICE = "host", "device"
_HOST_GROUPS: set[str] = set()  # group names of the HOST groups this process created


def group_backend(purpose: str, device_type: str) -> str:
    """gloo for HOST groups; NCCL for DEVICE groups on CUDA, gloo on CPU, or the strict backend on CPU under
    the strict-collectives mode (raydist.strict)."""
    if purpose == HOST:
        return "gloo"
    return strict.device_backend(device_type)


def new_group(ranks: list[int], purpose: str, device_type: str, timeout_s: float | None = None,
              use_local_synchronization: bool = True) -> dist.ProcessGroup:
    """A group of `ranks` for `purpose`; `use_local_synchronization` lets ranks outside it (idle workers)
    skip the call."""
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    group = dist.new_group(ranks=ranks, timeout=timeout, backend=group_backend(purpose, device_type),
                           use_local_synchronization=use_local_synchronization)
    if purpose == HOST and group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
        _HOST_GROUPS.add(group.group_name)
    return group


def purpose_of(group: dist.ProcessGroup | None) -> str:
    group = group if group is not None else dist.group.WORLD
    return HOST if group.group_name in _HOST_GROUPS else DEVICE
