"""Replica groups of k workers under Ray Train 2.60's torchft support, and each worker's place in them.

Ray Train 2.60's `TorchftConfig` (ray/train/v2/torch/torchft_config.py) runs torchft's Lighthouse, builds
one torch process group per replica group and, when a worker fails, replaces only its replica group while
the others keep training. Its worker group makes every replica group one worker (worker_group.py
`_start_impl`: `replica_group_size=1`, one `ReplicaGroup([worker])` per worker; "TODO: change after we
support replica groups of size > 1"). A replica with FSDP inside needs k >= 2 workers that share one
process group and are replaced together. `ReplicaGroupsConfig` is `TorchftConfig` with a backend (the public
seam `BackendConfig.backend_cls`) that, on the controller, regroups the started workers into groups of k
before Ray's torchft backend builds the process groups, and tells every worker its (replica, rank in the
replica) before its train function runs. Everything else stays Ray's: placement, the process group of each
replica group (its TCP store is also where the replica's torchft Manager meets, as under torchrun), polling,
the choice of which group failed, the replacement at the same placement-group bundles, the Lighthouse.

Ray 2.60 internals this relies on (checked by tests/unit/test_replica_groups.py; other versions refused):
1. `WorkerGroup._start_impl` sets `_replica_groups` (a list of `ReplicaGroup`) and
   `_worker_rank_to_replica_group_rank` ({position in `get_workers()`: group index}) before it runs the
   `after_worker_group_start` callbacks, among them `BackendSetupCallback`, which calls the backend's
   `on_start(worker_group)` (here: the regrouping), and only then `run_train_fn` on the workers.
2. `WorkerGroup.poll_status` keys worker statuses by position in `get_workers()`, and
   `WorkerGroupPollStatus.failing_replica_group_indices` maps them to groups through
   `_worker_rank_to_replica_group_rank`; the controller (`_execute_resize_decision` ->
   `_replace_bad_workers`) replaces only those groups, unless every group fails.
3. `WorkerGroup._replace_replica_group_impl(index)` shuts down every worker of `_replica_groups[index]`,
   starts as many at their bundles (`WorkerGroupState.replace_workers` keeps their positions), builds a
   `ReplicaGroup` with `_replica_group_callbacks`, stores it at `_replica_groups[index]`, and its
   `start_training` calls `on_start(replica_group)` before `run_train_fn`. It numbers the new workers
   `starting_world_rank=index`, `world_size=len(_replica_groups)` (right for groups of one only): the
   backend corrects the controller's `Worker.distributed_context` (whose `world_rank` drops the group's
   pending polls at its next replacement); the new workers' own train context keeps Ray's numbers, which
   is why workers read their place from `replica_identity()`, never from `ray.train.get_context()`.
4. `_TorchftBackend.on_start` (torchft_config.py) calls `_TorchBackend.on_start` once per replica group
   of `get_replica_groups()` (process-group rank = index inside the group, world size = its size) and sets
   `TORCHFT_LIGHTHOUSE` on the workers.
At the whole group's start Ray has numbered local ranks per (node, group of one): all 0. The identity
carries the local rank inside the k-worker group on its node (the device index on a GPU node).
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict

import ray

try:  # Ray Train 2.60's internals; under another Ray, check_ray_version (called below, at import) names the fix
    from ray.train.v2._internal.execution.worker_group import ReplicaGroup
    from ray.train.v2.torch.torchft_config import TorchftConfig, _TorchftBackend
except ImportError:
    ReplicaGroup = TorchftConfig = _TorchftBackend = None

from raydist.elastic.live import IDENTITY_ENV, ReplicaIdentity
from raydist.elastic.torch_backend import retried_if_port_taken
from raydist.errors import ConfigError

SUPPORTED_RAY = "2.60."  # the internals above were read from Ray 2.60.0


def check_ray_version(version: str | None = None) -> None:
    """A ConfigError unless the installed Ray is the one whose internals this module relies on."""
    version = ray.__version__ if version is None else version
    if not version.startswith(SUPPORTED_RAY):
        raise ConfigError(f"elastic.live_recovery=true relies on Ray Train {SUPPORTED_RAY}x's worker-group internals "
                          f"(raydist.elastic.replica_groups) but Ray {version} is installed; install ray=="
                          f"{SUPPORTED_RAY}0 or set elastic.live_recovery=false")


check_ray_version()  # importing this module refuses another Ray before its internals are touched


def _set_identity(env: dict[str, str]) -> None:
    os.environ.update(env)


def identities(workers: list, first_replica: int, size: int, replicas: int) -> list[ReplicaIdentity]:
    """The identities of `workers` (consecutive groups of `size`, the first being `first_replica`): local ranks
    count a group's workers per node, in order (as Ray numbers them for groups of that size)."""
    seen: dict[tuple[str, int], int] = defaultdict(int)
    out = []
    for position, worker in enumerate(workers):
        replica = first_replica + position // size
        key = (worker.metadata.node_ip, replica)
        out.append(ReplicaIdentity(replica, position % size, replicas, size, seen[key]))
        seen[key] += 1
    return out


def regroup(worker_group, size: int) -> None:
    """A started WorkerGroup's replica groups of one -> consecutive groups of `size` workers (internal 1)."""
    workers = worker_group.get_workers()  # sorted by world rank: position == world rank at the start
    if len(workers) % size:
        raise ValueError(f"{len(workers)} workers do not form replica groups of {size}")
    worker_group._replica_groups = [
        ReplicaGroup(workers[i:i + size], worker_group.get_resources_per_worker(),
                     worker_group._replica_group_callbacks)
        for i in range(0, len(workers), size)]
    worker_group._worker_rank_to_replica_group_rank = {position: position // size for position in range(len(workers))}


def renumber_replacement(worker_group, replica_group, size: int) -> int:
    """A replacement group's index, with its workers' world ranks on the controller made the positions they
    took (internal 3)."""
    index = next(i for i, g in enumerate(worker_group.get_replica_groups()) if g is replica_group)
    world_size = len(worker_group.get_workers())
    for j, worker in enumerate(replica_group.get_workers()):
        worker.distributed_context = dataclasses.replace(worker.distributed_context, world_rank=index * size + j,
                                                         world_size=world_size)
    return index


def _push_identities(group, first_replica: int, size: int, replicas: int) -> None:
    ray.get([group.execute_single_async(i, _set_identity, {IDENTITY_ENV[f]: str(v) for f, v in
                                                          dataclasses.asdict(ident).items()})
             for i, ident in enumerate(identities(group.get_workers(), first_replica, size, replicas))])


class _ReplicaGroupsBackend(_TorchftBackend):
    """`_TorchftBackend` over replica groups of `workers_per_replica` workers (runs on the controller)."""

    def __init__(self):
        super().__init__()
        self._worker_group = None  # the current whole group (a replacement's on_start sees its group only)

    def on_start(self, worker_group, backend_config):
        size = backend_config.workers_per_replica
        replacement = isinstance(worker_group, ReplicaGroup)
        if replacement:
            first = renumber_replacement(self._worker_group, worker_group, size)
        else:  # the whole group's start
            self._worker_group = worker_group
            regroup(worker_group, size)
            first = 0
        replicas = len(self._worker_group.get_replica_groups())
        _push_identities(worker_group, first, size, replicas)  # before the train function starts
        start = super().on_start  # the Lighthouse address, a process group per replica
        if replacement:  # (how Ray Train's replacement path handles a startup error is not tested here)
            start(worker_group, backend_config)
        else:  # each replica's store can lose its port as the default group's can
            retried_if_port_taken(start, worker_group, backend_config)


class ReplicaGroupsConfig(TorchftConfig):
    """Ray Train's TorchftConfig with replica groups of `workers_per_replica` workers."""

    def __init__(self, lighthouse_kwargs: dict, workers_per_replica: int, **kwargs):
        if workers_per_replica < 1:
            raise ValueError(f"workers_per_replica={workers_per_replica} must be >= 1")
        self.workers_per_replica = workers_per_replica
        super().__init__(lighthouse_kwargs=lighthouse_kwargs, **kwargs)

    @property
    def backend_cls(self):
        return _ReplicaGroupsBackend
