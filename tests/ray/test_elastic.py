"""Elasticity on real local Ray clusters: a killed worker, a lost node and a joining node.

Each test runs `raydist train`'s launcher in a thread against a cluster it starts and stops itself, and
acts on the cluster while the run trains (kill a worker process, remove a node, add a node)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from raydist.checkpoint import storage
from raydist.config import Config
from raydist.elastic import warm
from raydist.launcher import launch
from ray_runs import Background, ray_4cpu, records, wait_for  # noqa: F401  (ray_4cpu: a fixture)

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]  # the node-loss run: 2-5 min


def small(tiny_data, run_root, *extra):
    return Config.load(None, [
        f"data.path={tiny_data}", "data.seq_len=32", "data.reader=arrow", "model.num_layers=2", "model.d_model=64",
        "model.ffn_hidden=128", "train.global_batch=8", "train.micro_batch=2", "train.eval_every=0",
        "train.log_every=2", "checkpoint.every_steps=10", "checkpoint.async_save=false",
        f"checkpoint.storage={run_root}", "ray.max_pending_s=60", "elastic.collective_timeout_s=60", *extra])


def worker_pids(run_dir):
    """The training workers' pids, from the newest start/restart event."""
    starts = [e for e in records(run_dir, "events.jsonl") if e["kind"] in ("start", "restart")]
    return [w["pid"] for w in starts[-1]["workers"]]


def test_killed_worker_is_replaced_and_the_run_matches_an_uninterrupted_one(ray_4cpu, tiny_data, tmp_path):
    steps = 120  # the kill (at step >= 24, seen in metrics written in the background) lands well before the end
    reference = launch(small(tiny_data, tmp_path, f"train.steps={steps}", "train.run_name=ref"), log=lambda *_: None)
    run_dir = tmp_path / "killed"
    job = Background(small(tiny_data, tmp_path, f"train.steps={steps}", "train.run_name=killed",
                           "elastic.max_failures=3"))
    wait_for(lambda: any(r["step"] >= 24 for r in records(run_dir)), 240, "step 24", job, run_dir)
    # the first attempt's rank 0 asked for warm spare processes (raydist.elastic.warm): one per worker (the
    # two it also asks for the controller's own actors are not waited for: actors the controller starts and
    # ends during a run, at checkpoints, take them and the top-up replaces them, so their count at any moment
    # is a race; tests/ray/test_warm_spares_on_ray.py shows a controller's actors land in them)
    job_id = ray_4cpu.get_runtime_context().get_job_id()
    raylet = ray_4cpu.get(ray_4cpu.remote(lambda: os.environ["RAY_RAYLET_PID"]).remote())
    spares = wait_for(lambda: (lambda p: p if len(p) == 2 else None)(
        warm.spare_pids(job_id, raylet, ready_only=True)), 120, "two warm spares", job, run_dir)
    kill_time = time.time()
    os.kill(worker_pids(run_dir)[-1], signal.SIGKILL)  # a training worker dies mid-run
    # what storage holds at the kill (later commits prune these): a checkpoint counts from its COMMIT.json,
    # which can land before rank 0 logs its `checkpoint` event (the ranks agree on the newest commit first)
    committed = [s for s, uri in storage.list_step_dirs(str(run_dir / "checkpoints")) if storage.read_commit(uri)]
    summary = job.join(300)
    assert job.error is None, job.error
    assert summary["steps"] == steps and summary["restarts"] == 1
    events = records(run_dir, "events.jsonl")
    restart = next(i for i, e in enumerate(events) if e["kind"] == "restart")
    committed_before_kill = max(committed)
    assert events[restart]["resumed_step"] == committed_before_kill, (committed, events[restart])
    assert all(e["step"] <= committed_before_kill for e in events[:restart] if e["kind"] == "checkpoint")
    # the newest step the first attempt completed (logged or not: metrics are written every log_every steps)
    killed_at = events[restart]["previous_step"]
    assert killed_at >= max(r["step"] for r in records(run_dir) if r["attempt"] == 1)
    assert summary["steps_redone"] <= killed_at - committed_before_kill  # at most the steps since the commit
    assert abs(summary["final_loss"] - reference["final_loss"]) / reference["final_loss"] < 1e-3
    # the restarted workers are the spares, started before the kill, which imported torch, Ray Train and
    # raydist before the train function was entered; the restarted group's `launch` says where the restart
    # went (benchmarks/recovery.py splits the time so)
    assert sorted(w["pid"] for w in events[restart]["workers"]) == spares
    relaunch = next(e for e in events if e["kind"] == "launch" and e["time"] > kill_time)
    assert relaunch["process_started"] < kill_time < relaunch["entered"] <= relaunch["time"], (kill_time, relaunch)
    assert relaunch["process_started"] < relaunch["preloaded"] < relaunch["entered"]


def test_node_loss_shrinks_and_node_join_grows_the_run(tiny_data, tmp_path):
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
        ray.init(address=cluster.address, logging_level="warning")
        run_dir = tmp_path / "elastic"
        job = Background(small(tiny_data, tmp_path, "train.steps=300", "train.run_name=elastic",
                               "elastic.min_workers=2", "elastic.max_workers=4", "elastic.max_failures=5",
                               # Ray's default wait for a group's processes: the grown group's two new
                               # workers start cold on the new node, which a loaded 2-core machine may
                               # not finish in 30 s (a CI run once never saw the run grow again)
                               "elastic.resize_check_interval_s=5", "elastic.group_start_timeout_s=60"),
                     address=cluster.address)
        wait_for(lambda: any(r["step"] >= 12 and r["world_size"] == 4 for r in records(run_dir)), 300,
                 "training on 4 workers", job, run_dir)
        cluster.remove_node(nodes[1])  # two workers lost with their node
        wait_for(lambda: any(r["world_size"] == 2 for r in records(run_dir)), 300, "training on 2 workers",
                 job, run_dir)
        cluster.add_node(num_cpus=2)  # capacity returns: the run grows at the next resize check
        wait_for(lambda: any(r["world_size"] == 4 and r["attempt"] >= 3 for r in records(run_dir)), 300,
                 "training on 4 workers again", job, run_dir)
        summary = job.join(600)
        assert job.error is None, job.error
        events = records(run_dir, "events.jsonl")
        sizes = [e["world_size"] for e in events if e["kind"] in ("start", "restart")]
        assert sizes[:3] == [4, 2, 4], sizes
        meshes = [e["mesh"]["dp_replicate"] for e in events if e["kind"] in ("start", "restart")]
        assert meshes[:3] == [4, 2, 4]  # the layout was re-planned each time
        assert [e["kind"] for e in events].count("resize") >= 2
        assert summary["steps"] == 300 and summary["restarts"] >= 2
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_a_worker_that_fits_no_layout_stays_idle_and_the_run_completes(ray_4cpu, tiny_data, tmp_path):
    # 3 workers, global batch 8: dp 3 does not divide it, so dp 2 trains and the third worker idles,
    # following the active workers' reports to Ray Train (a barrier) until the end.
    summary = launch(small(tiny_data, tmp_path, "train.steps=12", "train.run_name=idle", "checkpoint.every_steps=4",
                           "elastic.min_workers=3", "elastic.max_workers=3"), log=lambda *_: None)
    assert summary["steps"] == 12 and summary["world_size"] == 2
    start = next(e for e in records(tmp_path / "idle", "events.jsonl") if e["kind"] == "start")
    assert start["idle_workers"] == 1 and "1 idle" in start["layout"]
    committed = [e["step"] for e in records(tmp_path / "idle", "events.jsonl") if e["kind"] == "checkpoint"]
    assert committed == [4, 8, 12]


def test_a_restart_after_a_node_loss_is_sized_from_the_alive_nodes():
    """raydist.elastic.fresh_view: the first ask after GCS marks a node dead already counts the workers the
    alive nodes hold. Ray Train's own policy answers from the coordinator's last 20 s tick and still counts
    the dead node's (measured: a restart asked for 4 workers on a 2-worker cluster and waited out
    elastic.group_start_timeout_s); this test fails with it unless a tick happens to land in between."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy import ResizeDecision

    from raydist.elastic.fresh_view import FreshViewScalingPolicy, fresh_view_supported

    assert fresh_view_supported()  # the pinned Ray has what the policy relies on
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
        ray.init(address=cluster.address, logging_level="warning")
        policy = FreshViewScalingPolicy(ScalingConfig(num_workers=(1, 4), resources_per_worker={"CPU": 1}))
        policy.after_controller_start(type("Run", (), {"run_id": "fresh-view"})())

        def decided():
            policy._latest_reserved_resources_query_time = float("-inf")  # past Ray's 1 s rate limit
            decision = policy.make_decision_for_non_running_worker_group()
            return decision.num_workers if isinstance(decision, ResizeDecision) else None

        assert wait_for(decided, 60, "a decision") == 4
        cluster.remove_node(nodes[1])
        wait_for(lambda: sum(n["Alive"] for n in ray.nodes()) == 2, 60, "GCS marking the node dead")
        assert decided() == 2
    finally:
        ray.shutdown()
        cluster.shutdown()
