"""Warm spare worker processes (raydist.elastic.warm) on a real local Ray: the Ray behaviour they rely on.

If a Ray upgrade changes how the raylet prestarts processes or matches an actor to an idle one, these tests
fail (restarts would then quietly start cold processes again)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from raydist.elastic import warm
from ray_runs import wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture
def ray_hooked():
    """A local Ray whose job runs raydist's setup hook, as raydist's embedded cluster does."""
    import ray

    from raydist.ray_cluster import embedded_dashboard

    ray.init(address="local", num_cpus=4, logging_level="warning", runtime_env=warm.job_runtime_env(),
             **embedded_dashboard())
    yield ray
    ray.shutdown()


def test_an_actor_with_the_workers_runtime_env_starts_in_a_preloaded_spare(ray_hooked):
    ray = ray_hooked

    @ray.remote(num_cpus=1)
    class Probe:
        def ask(self, wanted):
            return warm.request_spares(wanted)

        def state(self):
            from raydist.elastic.ray_session import process_start_time

            return (os.getpid(), process_start_time(), warm.preloaded_at, "raydist.trainer" in sys.modules,
                    "ray.train.torch" in sys.modules)

    job = ray.get_runtime_context().get_job_id()
    first = Probe.options(runtime_env=warm.worker_runtime_env()).remote()
    assert ray.get(first.ask.remote(2)) == 2
    spares = wait_for(lambda: (lambda p: p if len(p) == 2 else None)(warm.spare_pids(job, ready_only=True)), 120,
                      "two idle spares")
    assert ray.get(first.ask.remote(2)) == 0  # enough are there: no more are started
    time.sleep(1)
    assert warm.spare_pids(job) == spares
    # an actor without the workers' marker (as the Ray Train controller's SynchronizationActor) takes none
    other_pid, _, other_preloaded, _, _ = ray.get(Probe.remote().state.remote())
    assert other_pid not in spares and other_preloaded is None
    ray.kill(first)
    created = time.time()
    probes = [Probe.options(runtime_env=warm.worker_runtime_env()).remote() for _ in range(2)]
    states = ray.get([p.state.remote() for p in probes])
    assert sorted(s[0] for s in states) == spares, (states, spares)
    for pid, started, preloaded_at, trainer, train_torch in states:
        assert started < created  # the process was there before the actor (started on request, imports done
        assert preloaded_at is not None and trainer and train_torch  # by the hook before it took the actor)
    assert warm.spare_pids(job) == []


def test_the_prestart_request_has_the_fields_raydist_sets():
    from ray.core.generated import node_manager_pb2

    fields = set(node_manager_pb2.PrestartWorkersRequest.DESCRIPTOR.fields_by_name)
    assert {"language", "job_id", "runtime_env_info", "keep_alive_duration_secs", "num_workers"} <= fields
    import ray

    assert warm.ray_supported(ray.__version__)
