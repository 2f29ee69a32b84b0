"""Elasticity on a real local Ray cluster: a killed worker, and a worker no layout can use (a lost and a
joining node: tests/ray/test_node_loss.py).

Each test runs `raydist train`'s launcher in a thread against the file's own 4-CPU cluster and acts on it
while the run trains."""

from __future__ import annotations

import os
import signal
import time

import pytest

from raydist.checkpoint import storage
from raydist.driver.launcher import launch
from raydist.elastic import warm
from raydist.testing import run_fit
import ray_runs
from ray_runs import Background, Throttle, elastic_config as small, records, wait_for, worker_pids

# A cluster of this file's own (a fixture): the kill test counts the job's warm spares, which the runs of other
# files in the shared cluster's job leave behind.
ray_4cpu_fresh = ray_runs.ray_4cpu_fresh

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(400)]


def test_killed_worker_is_replaced_and_the_run_matches_an_uninterrupted_one(ray_4cpu_fresh, tiny_data, tmp_path):
    # the kill (at step >= 24, seen in metrics written in the background, once two warm spares are up) lands
    # before the end: unhindered, a fast run of 120 steps (14 s) once ended while the spares started, and a
    # worker died after the last checkpoint (the restart then resumed at the last step; its summary takes the
    # loss from there). So from step 24 the workers are held back (`Throttle`) until the spares are up, and the
    # run needs no more steps than the kill's and a resumed stretch after it (120 until 2026-11-30).
    steps = 60
    # the uninterrupted run: the same 2-worker fit on gloo without Ray Train (run_fit's spawned ranks run the
    # same training loop, whose summary gives final_loss; test_stopped_rank_hang.py compares them to 1e-4)
    [reference, _] = run_fit(small(tiny_data, tmp_path, f"train.steps={steps}", "train.run_name=ref").to_dict(), 2,
                             str(tmp_path / "ref"))
    run_dir = tmp_path / "killed"
    job = Background(small(tiny_data, tmp_path, f"train.steps={steps}", "train.run_name=killed",
                           "elastic.max_failures=3"))
    wait_for(lambda: any(r["step"] >= 24 for r in records(run_dir)), 240, "step 24", job, run_dir)
    throttle = Throttle(set(worker_pids(run_dir)))
    # the first attempt's rank 0 asked for warm spare processes (raydist.elastic.warm): one per worker (the
    # two it also asks for the controller's own actors are not waited for: actors the controller starts and
    # ends during a run, at checkpoints, take them and the top-up replaces them, so their count at any moment
    # is a race; tests/ray/test_warm_spares_on_ray.py shows a controller's actors land in them)
    job_id = ray_4cpu_fresh.get_runtime_context().get_job_id()
    raylet = ray_4cpu_fresh.get(ray_4cpu_fresh.remote(lambda: os.environ["RAY_RAYLET_PID"]).remote())
    try:
        spares = wait_for(lambda: (lambda p: p if len(p) == 2 else None)(
            warm.spare_pids(job_id, raylet, ready_only=True)), 120, "two warm spares", job, run_dir)
    finally:
        throttle.stop()
    kill_time = time.time()
    os.kill(worker_pids(run_dir)[-1], signal.SIGKILL)  # a training worker dies mid-run
    # what storage holds just after the kill (later commits prune these): a checkpoint counts from its
    # COMMIT.json, which can land before rank 0 logs its `checkpoint` event (the ranks agree on the newest
    # commit first). Rank 0 may still commit one more after the kill: the killed rank can have written its
    # shards of a step before it died, and a checkpoint whose every shard is written is whole (CI saw the
    # restart resume from step 40 with 30 the newest commit listed here).
    committed = [s for s, uri in storage.list_step_dirs(str(run_dir / "checkpoints")) if storage.read_commit(uri)]
    summary = job.join(300)
    assert job.error is None, job.error
    assert summary["steps"] == steps and summary["restarts"] == 1
    events = records(run_dir, "events.jsonl")
    restart = next(i for i, e in enumerate(events) if e["kind"] == "restart")
    resumed = events[restart]["resumed_step"]
    # the newest step the first attempt completed (logged or not: metrics are written every log_every steps)
    killed_at = events[restart]["previous_step"]
    assert killed_at >= max(r["step"] for r in records(run_dir) if r["attempt"] == 1)
    print(f"\nkilled at step {killed_at} of {steps}, resumed at {resumed}")
    assert killed_at < steps, f"the first attempt ended (step {killed_at}) before the kill: not a kill mid-run"
    # the newest commit (every 10 steps): none older than storage held at the kill, none past the first attempt
    assert max(committed) <= resumed <= killed_at and resumed % 10 == 0, (committed, events[restart])
    assert all(e["step"] <= resumed for e in events[:restart] if e["kind"] == "checkpoint")
    assert summary["steps_redone"] <= killed_at - resumed  # at most the steps since the commit
    assert reference.summary["steps"] == steps
    assert abs(summary["final_loss"] - reference.summary["final_loss"]) / reference.summary["final_loss"] < 1e-3
    # the restarted workers are the spares, started before the kill, which imported torch, Ray Train and
    # raydist before the train function was entered; the restarted group's `launch` says where the restart
    # went (benchmarks/recovery.py splits the time so)
    assert sorted(w["pid"] for w in events[restart]["workers"]) == spares
    relaunch = next(e for e in events if e["kind"] == "launch" and e["time"] > kill_time)
    assert relaunch["process_started"] < kill_time < relaunch["entered"] <= relaunch["time"], (kill_time, relaunch)
    assert relaunch["process_started"] < relaunch["preloaded"] < relaunch["entered"]


def test_a_worker_that_fits_no_layout_stays_idle_and_the_run_completes(ray_4cpu_fresh, tiny_data, tmp_path):
    # 3 workers, global batch 8: dp 3 does not divide it, so dp 2 trains and the third worker idles,
    # following the active workers' reports to Ray Train (a barrier) until the end.
    summary = launch(small(tiny_data, tmp_path, "train.steps=12", "train.run_name=idle", "checkpoint.every_steps=4",
                           "elastic.min_workers=3", "elastic.max_workers=3"), log=lambda *_: None)
    assert summary["steps"] == 12 and summary["world_size"] == 2
    start = next(e for e in records(tmp_path / "idle", "events.jsonl") if e["kind"] == "start")
    assert start["idle_workers"] == 1 and "1 idle" in start["layout"]
    committed = [e["step"] for e in records(tmp_path / "idle", "events.jsonl") if e["kind"] == "checkpoint"]
    assert committed == [4, 8, 12]
