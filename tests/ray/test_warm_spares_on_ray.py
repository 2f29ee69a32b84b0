"""Warm spare worker processes (raydist.elastic.warm) on a real local Ray: the Ray behaviour they rely on.

If a Ray upgrade changes how the raylet prestarts processes or matches an actor to an idle one, these tests
fail (restarts would then quietly start cold processes again)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from raydist.elastic import warm
import ray_runs
from ray_runs import wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]  # its own waits: 120 s each


# A local Ray whose job runs raydist's setup hook, as raydist's embedded cluster does: one of this file's own
# (a fixture; the tests count the job's spare processes, which other files' runs in the shared cluster's job
# leave behind), shared by its first three tests. The first sees the new cluster start no idle process, the
# second leaves none with the workers' runtime env, and the third counts those with the controller's.
ray_4cpu_fresh = ray_runs.ray_4cpu_fresh


def probe_class(ray):
    @ray.remote(num_cpus=1)
    class Probe:
        def ask(self, workers, controller_actors=0):
            return warm.request_spares(workers, controller_actors)

        def state(self):
            from raydist.training.ray_session import process_start_time

            return {"pid": os.getpid(), "started": process_start_time(), "preloaded": warm.preloaded_at,
                    "modules": set(sys.modules) & {*warm.PRELOAD, *warm.PRELOAD_CONTROLLER},
                    "raylet": os.environ["RAY_RAYLET_PID"]}

    return Probe


def two_spares(job, raylet):
    """Two idle spares that are ready (registered with the raylet and preloaded: warm.READY_TITLE), and no
    third starting; a spare only named `ray::IDLE` may not be registered yet, and an actor created then starts
    a new process."""
    def ready_two():
        pids = warm.spare_pids(job, raylet, ready_only=True)
        return pids if len(pids) == 2 and warm.spare_pids(job, raylet) == pids else None

    return wait_for(ready_two, 120, "two idle spares")


def idle_unmarked(raylet_pid: int) -> list[int]:
    """The raylet's worker processes that host nothing and are no spare (neither the workers' nor the
    controller's marker)."""
    markers = (f"{warm.SPARE_ENV_VAR}=".encode(), f"{warm.CONTROLLER_ENV_VAR}=".encode())
    return [pid for pid, env in warm.idle_processes(str(raylet_pid)) if not any(v.startswith(markers) for v in env)]


def test_a_new_cluster_starts_no_idle_worker_processes_for_its_driver(ray_4cpu_fresh):
    """An embedded cluster's raylet prestarts no worker process for the driver (raydist.driver.ray_cluster.
    EMBEDDED_RAY_ENV): by Ray's default it starts one per CPU, four here, which raydist's runs never use. (The
    file's first test: its cluster is new, nothing has asked it for a process yet.)"""
    ray = ray_4cpu_fresh
    raylet = ray._private.worker._global_node.all_processes["raylet"][0].process.pid
    deadline = time.monotonic() + 5  # by the default the four appear within about a second
    while time.monotonic() < deadline:
        assert idle_unmarked(raylet) == []
        time.sleep(0.25)


def test_an_actor_with_the_workers_runtime_env_starts_in_a_preloaded_spare(ray_4cpu_fresh):
    ray = ray_4cpu_fresh
    Probe = probe_class(ray)
    job = ray.get_runtime_context().get_job_id()
    first = Probe.options(runtime_env=warm.worker_runtime_env()).remote()
    raylet = ray.get(first.state.remote())["raylet"]
    assert ray.get(first.ask.remote(2)) == 2
    spares = two_spares(job, raylet)
    assert ray.get(first.ask.remote(2)) == 0  # enough are there: no more are started
    time.sleep(1)
    assert warm.spare_pids(job, raylet) == spares
    # an actor without the workers' marker takes none
    other = ray.get(Probe.remote().state.remote())
    assert other["pid"] not in spares and other["preloaded"] is None
    ray.kill(first)
    created = time.time()
    probes = [Probe.options(runtime_env=warm.worker_runtime_env()).remote() for _ in range(2)]
    states = ray.get([p.state.remote() for p in probes])
    assert sorted(s["pid"] for s in states) == spares, (states, spares)
    for state in states:  # the process was there before the actor, its imports done by the hook before it
        assert state["started"] < created and state["preloaded"] is not None  # took the actor
        assert state["modules"] >= set(warm.PRELOAD)
    assert warm.spare_pids(job, raylet) == []


def test_a_controllers_own_actors_start_in_spares_asked_for_by_its_worker(ray_4cpu_fresh):
    """As Ray Train's: the controller has its own runtime env, creates its workers with the marked worker env
    (which Ray merges into its own) and its SynchronizationActor with its env (two such actors here, to see
    the count honoured, not just one spare made)."""
    ray = ray_4cpu_fresh
    Probe = probe_class(ray)

    @ray.remote(num_cpus=0)
    class Controller:  # (runs in a worker: only what raydist and Ray provide, nothing of this test module)
        def run(self):
            worker = Probe.options(runtime_env=warm.worker_runtime_env()).remote()
            assert ray.get(worker.ask.remote(0, 2)) == 2  # two with the controller's env
            job, deadline = ray.get_runtime_context().get_job_id(), time.monotonic() + 120
            while len(spares := warm.spare_pids(job, controller=True, ready_only=True)) < 2:  # (as two_spares)
                assert time.monotonic() < deadline, "timed out waiting for two idle spares"
                time.sleep(0.1)
            created = time.time()
            own = [Probe.remote() for _ in range(2)]
            return spares, created, ray.get([p.state.remote() for p in own])

    controller = Controller.options(runtime_env={"env_vars": {warm.CONTROLLER_ENV_VAR: "0"}}).remote()
    spares, created, states = ray.get(controller.run.remote())
    assert sorted(s["pid"] for s in states) == spares, (states, spares)
    for state in states:
        assert state["started"] < created and state["preloaded"] is not None
        assert state["modules"] >= set(warm.PRELOAD_CONTROLLER) and "raydist.training.trainer" not in state["modules"]


def test_the_prestart_request_has_the_fields_raydist_sets():
    from ray.core.generated import node_manager_pb2

    fields = set(node_manager_pb2.PrestartWorkersRequest.DESCRIPTOR.fields_by_name)
    assert {"language", "job_id", "runtime_env_info", "keep_alive_duration_secs", "num_workers"} <= fields
    import ray

    assert warm.ray_supported(ray.__version__)


def test_a_worker_process_ended_by_the_hook_costs_one_group_start_not_the_run(tmp_path, monkeypatch):
    """The job's first Ray Train worker process fails its preload after loading torch._C (planted by
    tests/ray/warm_plant.py), as one did in CI. The hook ends it (raydist.elastic.warm._import): its actor
    dies before creation, and Ray Train starts the worker group again instead of failing the run when that
    worker unpickles TorchConfig (tests/unit/test_warm_spares.py shows that failure)."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raydist.driver.ray_cluster import embedded_dashboard, train_env
    from warm_plant import MARKER_ENV

    for key, value in train_env(embedded=True).items():
        monkeypatch.setenv(key, value)
    marker = tmp_path / "planted_pid"
    ray.init(address="local", num_cpus=4, logging_level="warning", **embedded_dashboard(),
             runtime_env={"worker_process_setup_hook": "warm_plant.preload",
                          "env_vars": {"PYTHONPATH": os.path.dirname(__file__), MARKER_ENV: str(marker),
                                       "TMPDIR": str(tmp_path)}})
    try:
        def train_fn():
            import ray.train

            rank = ray.train.get_context().get_world_rank()
            (tmp_path / f"rank{rank}").write_text(f"{os.getpid()} {warm.preloaded_at is not None}")

        result = TorchTrainer(train_fn, scaling_config=ScalingConfig(num_workers=1),
                              run_config=RunConfig(storage_path=str(tmp_path / "runs"), name="unfit",
                                                   worker_runtime_env=warm.worker_runtime_env())).fit()
    finally:
        ray.shutdown()
    assert result.error is None
    planted = marker.read_text()
    pid, preloaded = (tmp_path / "rank0").read_text().split()
    assert pid != planted and preloaded == "True", (planted, pid, preloaded)
    ended = list(tmp_path.glob("raydist-unfit-*"))
    assert len(ended) == 1 and ended[0].read_text().split() == [planted]
