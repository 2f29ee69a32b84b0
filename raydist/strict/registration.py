"""The strict backend's registration with torch.distributed: torch creates a `StrictProcessGroup`
(raydist.strict.group) for every group of the backend, and `batch_isend_irecv` hands a strict group's batch
to it whole, as one unit (NCCL's group call)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from raydist.strict.group import StrictProcessGroup
from raydist.strict.mode import BACKEND

_REGISTERED = False


def _create(options, backend_options=None) -> StrictProcessGroup:
    """torch's creator for the registered backend (extended API)."""
    return StrictProcessGroup(options.store, options.group_rank, options.group_size, options.timeout,
                              str(options.group_id), list(options.global_ranks_in_group))


def _batch_isend_irecv(p2p_op_list):
    c10d._check_p2p_op_list(p2p_op_list)
    group = p2p_op_list[0].group
    group = group if group is not None else c10d._get_default_group()
    if isinstance(group, StrictProcessGroup):
        return group.batch(p2p_op_list)
    return _ORIGINAL_BATCH(p2p_op_list)


_ORIGINAL_BATCH = c10d.batch_isend_irecv


def register() -> None:
    """The backend, and `batch_isend_irecv` taking a strict group's batch as one unit (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    c10d.batch_isend_irecv = _batch_isend_irecv
    dist.batch_isend_irecv = _batch_isend_irecv
    _REGISTERED = True
