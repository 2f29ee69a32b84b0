"""Replica groups of k workers on Ray Train 2.60 (raydist.elastic.replica_groups), without a cluster: Ray's
own WorkerGroup, ReplicaGroup, BackendSetupCallback and torchft backend run against fake worker actors, so
the regrouping, the failing-group map, a replacement's numbering and the order "identity, then process
group, then train function" are checked on Ray's real code paths. The internals the module relies on are
also pinned by their source: a Ray whose code there changed fails here before it misbehaves in a run."""

from __future__ import annotations

import hashlib
import inspect
from types import SimpleNamespace

import pytest
import ray
import torchft  # noqa: F401  (the test extra installs it; missing, this is an error, not a skip)
from ray.train.torch.config import _TorchBackend
from ray.train.v2._internal.callbacks.backend_setup import BackendSetupCallback
from ray.train.v2._internal.execution.controller.controller import TrainController
from ray.train.v2._internal.execution.worker_group import ReplicaGroup, WorkerGroup
from ray.train.v2._internal.execution.worker_group.poll import WorkerGroupPollStatus, WorkerStatus
from ray.train.v2._internal.execution.worker_group.state import WorkerGroupState
from ray.train.v2._internal.execution.worker_group.worker import ActorMetadata, Worker
from ray.train.v2.torch.torchft_config import _TorchftBackend

from raydist.elastic.live import IDENTITY_ENV, ReplicaIdentity
from raydist.elastic.replica_groups import ReplicaGroupsConfig, check_ray_version, identities, regroup
from raydist.errors import ConfigError

# sha256 of the source of every Ray 2.60.0 function whose behaviour raydist.elastic.replica_groups relies on
PINNED = {
    "WorkerGroup._start_impl":
        "1f4c2b9acf4cc8d884da8335e18c7312dca4d5779bd51b2f3aaac5a1f9ba0be8",
    "WorkerGroup._replace_replica_group_impl":
        "e62b59261d3661c81bd9553dbdee2bd512232038cccb5492e4132e9ae6f3a9c2",
    "WorkerGroup.replace_replica_group":
        "b94be76cb3f99ff600e6b82a74ae670f7d14744581d5496dd8dff3732748e0a0",
    "WorkerGroup.poll_status":
        "c349bde66237b1f59fceab27d0684dd07828c5a8a22a5537299e11f88089f899",
    "WorkerGroup._get_poll_tasks":
        "82799561ff7667d3b3ad6e1043213c45557495ed465fcf546fd281dd0ce62787",
    "WorkerGroup._assign_worker_ranks":
        "4f828c8b47010e75a0704579c712275f896edaf09bf0cc1a68ec73e9b49e9f85",
    "WorkerGroupState.replace_workers":
        "4a1070544d401029edbd01027df8e568c4ce25e38f83a71e4801773e06f2e5c1",
    "WorkerGroupPollStatus.failing_replica_group_indices":
        "8f67d981a88599579c1046f346a725d035dfac95a67f9f5cc4f72cc7af9bfd8d",
    "ReplicaGroup.start_training":
        "30ed1e8802d87fcb5ff8af0f5d15779a5d6d0630d45ca1b2a231509f87fca484",
    "BackendSetupCallback.after_execution_group_start":
        "4a43a2ccaafcdce35e3f7df94177d337e3506a584bda14c6621894022a191c66",
    "TrainController._execute_resize_decision":
        "fdf9a7ba6fdfd5acfb8927772a95309b47cdee8cb735efc5a38a49e0a79a1a7d",
    "TrainController._replace_bad_workers":
        "b14700b21d925266755cb8a7df5044292b72479983e6a63dadbaa7528de558eb",
    "_TorchftBackend.on_start":
        "b3b0578dfdd967b7f610ccb096a72e07f37a701107b372fda7fb655d63ef48a4",
    "_TorchBackend.on_start":
        "2d82fd3c05311849d155e9342849f472910b3c3093fe9f3fc38c6f82d83984ab",
}


def _relied_upon():
    return {
        "WorkerGroup._start_impl": WorkerGroup._start_impl,
        "WorkerGroup._replace_replica_group_impl": WorkerGroup._replace_replica_group_impl,
        "WorkerGroup.replace_replica_group": WorkerGroup.replace_replica_group,
        "WorkerGroup.poll_status": WorkerGroup.poll_status,
        "WorkerGroup._get_poll_tasks": WorkerGroup._get_poll_tasks,
        "WorkerGroup._assign_worker_ranks": WorkerGroup._assign_worker_ranks,
        "WorkerGroupState.replace_workers": WorkerGroupState.replace_workers,
        "WorkerGroupPollStatus.failing_replica_group_indices": WorkerGroupPollStatus.failing_replica_group_indices.fget,
        "ReplicaGroup.start_training": ReplicaGroup.start_training,
        "BackendSetupCallback.after_execution_group_start": BackendSetupCallback.after_execution_group_start,
        "TrainController._execute_resize_decision": TrainController._execute_resize_decision,
        "TrainController._replace_bad_workers": TrainController._replace_bad_workers,
        "_TorchftBackend.on_start": _TorchftBackend.on_start,
        "_TorchBackend.on_start": _TorchBackend.on_start,
    }


def _digest(fn) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()


def test_the_ray_internals_relied_upon_are_those_of_ray_2_60():
    found = {name: _digest(fn) for name, fn in _relied_upon().items()}
    changed = sorted(name for name in PINNED if found[name] != PINNED[name])
    assert found.keys() == PINNED.keys() and not changed, (
        f"Ray {ray.__version__} changed {changed}: review raydist.elastic.replica_groups against them")


def test_another_ray_version_is_refused_with_one_error_line():
    check_ray_version("2.60.0")
    with pytest.raises(ConfigError, match=r"Ray 2\.61\.0 is installed; install ray==2\.60\.0 or set "
                                          r"elastic\.live_recovery=false"):
        check_ray_version("2.61.0")


# ---- Ray's worker group with fake actors -------------------------------------------------------------

class FakeActor:
    """Records every remote call (`actor.method.remote(...)`, `actor.execute.options(...).remote(fn, ...)`)."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def __getattr__(self, method: str):
        def remote(*args, **kwargs):
            what = args[0].__name__ if method == "execute" else None
            self.log.append((self.name, method, what, args[1:] if method == "execute" else ()))
        return SimpleNamespace(remote=remote, options=lambda **_: SimpleNamespace(remote=remote))


def _worker(name: str, log: list, node_ip: str = "10.0.0.1", bundle: int = 0) -> Worker:
    meta = ActorMetadata(hostname="h", node_id=node_ip, node_ip=node_ip, pid=0, accelerator_ids={})
    return Worker(FakeActor(name, log), meta, {"CPU": 1}, placement_group_bundle_index=bundle)


@pytest.fixture
def started(monkeypatch):
    """A WorkerGroup of 4 fake workers as Ray 2.60's `_start_impl` leaves it for a torchft backend (replica
    groups of one), Ray's BackendSetupCallback with raydist's config, and the log of every remote call."""
    log: list = []
    monkeypatch.setattr(ray, "get", lambda refs, **_: refs)
    monkeypatch.setattr(ray, "wait", lambda refs, **_: (refs, []))
    monkeypatch.setattr(ray, "kill", lambda actor, **_: log.append((actor.name, "kill", None, ())))
    monkeypatch.setattr(_TorchftBackend, "_maybe_create_lighthouse_actor", lambda self, cfg: "lighthouse:1")
    monkeypatch.setattr(_TorchBackend, "on_start",
                        lambda self, group, cfg: log.append(("process group", "on_start", None,
                                                                         tuple(w.actor.name for w in group.get_workers()))))
    callback = BackendSetupCallback(ReplicaGroupsConfig({}, 2, backend="gloo"))
    wg = WorkerGroup.__new__(WorkerGroup)
    workers = WorkerGroup._assign_worker_ranks([_worker(f"w{i}", log, bundle=i) for i in range(4)],
                                               replica_group_size=1)
    wg._worker_group_state = WorkerGroupState(start_time=0.0, placement_group_handle=SimpleNamespace(placement_group="pg"),
                                              workers=workers, sync_actor=FakeActor("sync", log))
    wg._worker_group_context = SimpleNamespace(resources_per_worker={"CPU": 1}, train_fn_ref="train_fn")
    wg._replica_group_callbacks = [callback]
    wg._replica_groups = [ReplicaGroup([w], {"CPU": 1}, [callback]) for w in workers]  # as _start_impl does
    wg._worker_rank_to_replica_group_rank = {w.distributed_context.world_rank: i for i, w in enumerate(workers)}
    wg._world_rank_to_ongoing_poll = {}
    return wg, callback, log


def _pushed(log: list, name: str) -> ReplicaIdentity:
    [env] = [args[0] for who, method, fn, args in log if who == name and fn == "_set_identity"]
    return ReplicaIdentity(**{field: int(env[var]) for field, var in IDENTITY_ENV.items()})


def test_the_whole_group_start_makes_groups_of_k_and_maps_a_failing_worker_to_its_group(started):
    wg, callback, log = started
    callback.after_worker_group_start(wg)  # what _start_impl runs before the train function
    assert [[w.actor.name for w in g.get_workers()] for g in wg.get_replica_groups()] == [["w0", "w1"], ["w2", "w3"]]
    assert all(g._callbacks == [callback] for g in wg.get_replica_groups())  # a replacement gets its setup too
    # Ray's torchft backend built one process group per replica group of 2
    assert [e[3] for e in log if e[0] == "process group"] == [("w0", "w1"), ("w2", "w3")]
    assert [_pushed(log, f"w{i}") for i in range(4)] == [ReplicaIdentity(r, j, 2, 2, j) for r in (0, 1) for j in (0, 1)]
    # the lighthouse address reached every worker
    assert sorted(who for who, _, fn, _ in log if fn == "_set_lighthouse_address") == ["w0", "w1", "w2", "w3"]
    # a poll where worker 3 failed: the controller replaces replica group 1 only
    statuses = {i: WorkerStatus(running=i != 3, error=RuntimeError("killed") if i == 3 else None) for i in range(4)}
    status = WorkerGroupPollStatus(statuses, wg._worker_rank_to_replica_group_rank)
    assert status.failing_replica_group_indices == {1} and status.all_replica_group_indices == {0, 1}


def test_a_replacement_takes_the_whole_group_gets_its_place_before_its_train_function(started, monkeypatch):
    wg, callback, log = started
    callback.after_worker_group_start(wg)
    survivors = wg.get_replica_groups()[0].get_workers()
    ray_numbering = []

    def create(num_workers, placement_group, resources_per_worker, placement_group_bundle_indices=None,
               starting_world_rank=0, world_size=None, replica_group_size=None):
        ray_numbering.append((starting_world_rank, world_size, replica_group_size))
        new = [_worker(f"n{b}", log, bundle=b) for b in placement_group_bundle_indices]
        return WorkerGroup._assign_worker_ranks(new, starting_world_rank, world_size, replica_group_size)

    monkeypatch.setattr(wg, "_create_workers", create)
    monkeypatch.setattr(wg, "_init_train_context", lambda workers, sync_actor: None)
    log.clear()
    wg.replace_replica_group(1)  # what the controller does for a failing group 1
    # Ray 2.60 numbers a replacement as if groups had one worker (index 1, world of 2 groups): corrected here
    assert ray_numbering == [(1, 2, 2)]
    assert [w.actor.name for w in wg.get_workers()] == [w.actor.name for w in survivors] + ["n2", "n3"]
    assert [w.distributed_context.world_rank for w in wg.get_workers()] == [0, 1, 2, 3]
    assert {w.distributed_context.world_size for w in wg.get_workers()} == {4}
    # both old workers were shut down; the survivors' group was left alone (only its result queue cleared)
    assert {who for who, method, _, _ in log if method == "kill"} == {"w2", "w3"}
    assert not [e for e in log if e[0] in ("w0", "w1") and e[1] != "clear_result_queue"]
    assert [_pushed(log, n) for n in ("n2", "n3")] == [ReplicaIdentity(1, 0, 2, 2, 0), ReplicaIdentity(1, 1, 2, 2, 1)]
    order = [(e[0], e[2] or e[3] or e[1]) for e in log if e[0] in ("n2", "n3", "process group")]
    pushed, group, trained = (order.index(("n2", "_set_identity")), order.index(("process group", ("n2", "n3"))),
                              order.index(("n2", "run_train_fn")))
    assert pushed < group < trained, order
    assert wg._worker_rank_to_replica_group_rank == {0: 0, 1: 0, 2: 1, 3: 1}


def test_local_ranks_count_a_groups_workers_per_node():
    log: list = []
    workers = [_worker(f"w{i}", log, node_ip=ip) for i, ip in enumerate(["a", "a", "a", "b", "b", "b"])]
    got = identities(workers, first_replica=0, size=3, replicas=2)
    assert [(i.replica, i.rank, i.local_rank) for i in got] == [(0, 0, 0), (0, 1, 1), (0, 2, 2),
                                                                  (1, 0, 0), (1, 1, 1), (1, 2, 2)]
    mixed = [_worker(f"w{i}", log, node_ip=ip) for i, ip in enumerate(["a", "a", "b", "a"])]
    assert [i.local_rank for i in identities(mixed, 0, 2, 2)] == [0, 1, 0, 0]


def test_regroup_refuses_a_count_that_is_no_multiple_of_the_group_size(started):
    wg, _, _ = started
    with pytest.raises(ValueError, match="4 workers do not form replica groups of 3"):
        regroup(wg, 3)


def test_only_replicas_of_several_workers_need_ray_2_60(monkeypatch):
    from raydist.config import Config
    from raydist.driver.launcher import check_live_recovery

    def live(dp_shard):
        return Config.load("workloads/gpt_tiny.toml", ["elastic.live_recovery=true", "parallel.dp_replicate=2",
                                                       f"parallel.dp_shard={dp_shard}", f"ray.num_workers={2 * dp_shard}"])

    monkeypatch.setattr(ray, "__version__", "2.61.0")
    check_live_recovery(live(1))  # Ray Train's own TorchftConfig: any Ray
    with pytest.raises(ConfigError, match="2.61.0"):
        check_live_recovery(live(2))
