"""Strict collectives: NCCL's rules enforced on a CPU run, so what would hang on GPUs fails here, named.

gloo forgives what NCCL does not. Under `RAYDIST_STRICT_COLLECTIVES=1` every device group (the default group
and every DeviceMesh group; raydist's HOST groups stay plain gloo, as they are on GPUs) is a
`StrictProcessGroup` (raydist.strict.group): a Python process group over gloo that runs its operations the
way ProcessGroupNCCL runs them on a device-bound (eagerly initialised) communicator:

- one stream per group and rank: operations, collectives and point-to-point alike, and each
  `batch_isend_irecv` as one unit, run one at a time in issue order; a later one does not start before an
  earlier one has completed (NCCL: one communicator, one stream; with a bound device even single
  send/recv use the group's communicator, torch PR #129147);
- a unit of point-to-point operations completes only when every operation in it is matched: a send
  completes only when its receive runs on the peer (gloo's TCP pairs do not buffer either), and messages
  match by issue order per peer pair, tags ignored (a sender's tag that differs from its receiver's is a
  bug NCCL would not see: the tensor lands in the wrong buffer);
- every member issues a group's collectives in the same order with the same kind, dtype, size and root
  (each collective first exchanges a fingerprint; a mismatch fails naming both operations);
- groups created from the bound default group (ncclCommSplit) must be created by every rank of the world,
  in the same order (raydist.strict.splits);
- a host tensor (made without a device) on a device group fails, as NCCL rejects CPU tensors
  (raydist.strict.audit marks them); so do reductions NCCL lacks (bitwise) and receives from any source;
- a collective that times out ends the process as NCCL's watchdog does (TORCH_NCCL_ASYNC_ERROR_HANDLING):
  no Python exception a training loop could catch;
- a deadlock (a cycle of ranks each waiting for an operation queued behind another's) is found by comparing
  every stalled rank's state through the store (raydist.strict.deadlock) and fails every rank in it within
  seconds, naming the ranks, operations and groups, instead of hanging until the timeout.

Switched on by the environment variable on the driver (raydist passes it to every worker and to
`raydist.parallel.runtime.spawn`'s ranks); `install()` registers the backend in a process before its process group
is created. It costs a thread hand-off and a fingerprint per collective: a checking mode for CPU runs and
tests, not for speed.
"""

from __future__ import annotations

import torch.distributed as dist

from raydist.strict import group, registration, runtime, splits
from raydist.strict.mode import BACKEND, ENV, StrictCollectiveError, device_backend, enabled

__all__ = ["BACKEND", "ENV", "StrictCollectiveError", "active", "bind", "device_backend", "enabled", "install"]


def active() -> bool:
    """Whether this process's world group is a strict one (the mode is on and the run is on CPU: GPU runs
    keep NCCL itself)."""
    if not dist.is_available() or not dist.is_initialized():
        return False
    return isinstance(dist.distributed_c10d._get_default_group(), group.StrictProcessGroup)


def install() -> str:
    """Register the strict backend and its torch.distributed hooks in this process (idempotent); returns
    the backend name to create the default process group with."""
    registration.register()
    splits.install()
    return BACKEND


def bind() -> bool:
    """Bind the strict world group to the rank's 'device' (CPU), as raydist binds the NCCL world group to the
    GPU: a collective of every world rank; from then on every new group must be created by all of them
    (raydist.strict.splits). False when this process has no strict world group."""
    state = runtime.current()
    if state is None or state.world_group is None:
        return False
    world = state.world_group
    splits.bind(state, world.size(), world.timeout.total_seconds())
    return True
