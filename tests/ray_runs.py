"""Shared pieces of the tests that run `launch` on a real local Ray (tests/ray, tests/faults): a 4-CPU
cluster, a run in a background thread, reading the JSON-lines files it writes, and waiting for them."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from raydist.config import Config
from raydist.driver.launcher import launch


def elastic_config(tiny_data, run_root, *extra) -> Config:
    """A 2-layer model on the tiny corpus, checkpoints every 10 steps under `run_root`: the elastic runs'."""
    return Config.load(None, [
        f"data.path={tiny_data}", "data.seq_len=32", "data.reader=arrow", "model.num_layers=2", "model.d_model=64",
        "model.ffn_hidden=128", "train.global_batch=8", "train.micro_batch=2", "train.eval_every=0",
        "train.log_every=2", "checkpoint.every_steps=10", "checkpoint.async_save=false",
        f"checkpoint.storage={run_root}", "ray.max_pending_s=60", "elastic.collective_timeout_s=60", *extra])


def jsonl(path) -> list[dict]:
    """The complete records of a JSON-lines file ([] while it does not exist yet). A run appends while a
    test polls, so the last line may be half written: only lines that end in a newline are records."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


def records(run_dir, name="metrics.jsonl") -> list[dict]:
    """A run directory's metrics (or another of its JSON-lines files, e.g. events.jsonl)."""
    return jsonl(os.path.join(run_dir, name))


def worker_pids(run_dir) -> list[int]:
    """The training workers' pids, from the newest start/restart event."""
    starts = [e for e in records(run_dir, "events.jsonl") if e["kind"] in ("start", "restart")]
    return [w["pid"] for w in starts[-1]["workers"]]


def wait_for(predicate, timeout_s, what, job=None, run_dir=None):
    """Polls `predicate` until it returns something true (returned). With `job` (a Background), a run that
    ended first fails at once; with `run_dir`, a failure lists the run's newest events."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ended = job is not None and not job.thread.is_alive()
        value = predicate()
        if value:
            return value
        if ended:
            raise AssertionError(f"the run ended (error: {job.error!r}) before {what}{_events_tail(run_dir)}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}{_events_tail(run_dir)}")


def _events_tail(run_dir, n=15) -> str:
    if run_dir is None:
        return ""
    events = records(run_dir, "events.jsonl")[-n:]
    keys = ("step", "world_size", "attempt", "reason", "error")
    return "; its newest events: " + " | ".join(
        " ".join([e.get("kind", "?")] + [f"{k}={e[k]}" for k in keys if k in e]) for e in events)


class Background:
    """`launch(cfg, **launch_kwargs)` in a thread; `join` returns its summary (`error` holds a failure)."""

    def __init__(self, cfg, **launch_kwargs):
        self.result = self.error = None
        self.thread = threading.Thread(target=self._run, args=(cfg, launch_kwargs), daemon=True)
        self.thread.start()

    def _run(self, cfg, launch_kwargs):
        try:
            self.result = launch(cfg, log=lambda *_: None, **launch_kwargs)
        except BaseException as exc:
            self.error = exc

    def join(self, timeout_s):
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "training did not finish"
        return self.result


class Throttle:
    """Holds a run's workers back (SIGSTOP for STOPPED_S, then SIGCONT for RUNNING_S, over and over) until
    `stop()`, so that what a test waits for while they train (a replacement that starts cold, warm spares
    importing torch) comes well before they run out of steps however loaded the machine is, and the run needs
    no steps spent only as a margin. A pause this short is no fault to anything in the run (torchft's heartbeats
    time out after seconds, a collective after elastic.timeout_floor_s at the least); they train on at a sixth
    of their pace. `stop()` always leaves them running."""

    STOPPED_S, RUNNING_S = 0.25, 0.05

    def __init__(self, pids: set[int]):
        self.pids, self.done = pids, threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _signal(self, sig) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, sig)
            except OSError:  # gone (a failed run)
                pass

    def _loop(self) -> None:
        try:
            while not self.done.is_set():
                self._signal(signal.SIGSTOP)
                time.sleep(self.STOPPED_S)
                self._signal(signal.SIGCONT)
                self.done.wait(self.RUNNING_S)
        finally:
            self._signal(signal.SIGCONT)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()  # (its loop's last act resumes them)


class SharedCluster:
    """The 4-CPU local cluster the Ray files' tests share (`ray_4cpu`), as raydist's own embedded cluster is
    set up: another local cluster's dashboard must not answer for this one, its processes inherit raydist's
    Ray Train settings (the controller's ones only reach it this way), and its job preloads warm spare
    processes.

    Starting and stopping a cluster costs 5-6 s of CPU here, and eight files started one each; now the
    first test that asks starts it and the tests after it that ask reuse it, one driver and one job, across
    files. It is shut down before the first test that does not ask (tests/conftest.py: a test that starts a
    Ray of its own, or no Ray; one local cluster at a time, tests/workers.py) and at the session's end. A
    file that needs a job of its own (`ray_4cpu_fresh`: its runs count the job's warm spares, which the runs
    of earlier files in a shared job leave behind) gets a new cluster, shut down when a test asks for the
    shared one again."""

    def __init__(self):
        self.owner: str | None = None  # None: shared; else the file whose own cluster this is
        self.env: pytest.MonkeyPatch | None = None  # set while a cluster is up

    def get(self, owner: str | None = None):
        import ray

        from raydist.elastic import warm
        from raydist.driver.ray_cluster import embedded_dashboard, train_env

        if self.env is not None and self.owner == owner and ray.is_initialized():
            return ray
        self.release()
        self.env, self.owner = pytest.MonkeyPatch(), owner
        for key, value in train_env(embedded=True).items():
            self.env.setenv(key, value)
        ray.init(address="local", num_cpus=4, logging_level="warning", runtime_env=warm.job_runtime_env(),
                 **embedded_dashboard())
        return ray

    def release(self) -> None:
        """Shuts the cluster down, if one is up, and restores the environment it was started with."""
        if self.env is None:
            return
        import ray

        try:
            ray.shutdown()
        finally:
            self.env.undo()
            self.env = self.owner = None


SHARED = SharedCluster()


@pytest.fixture
def ray_4cpu():
    """The shared 4-CPU local cluster (`SharedCluster`); the `ray` module."""
    return SHARED.get()


@pytest.fixture
def ray_4cpu_fresh(request):
    """A 4-CPU local cluster of this test file's own, a job no other file's runs touched (`SharedCluster`)."""
    return SHARED.get(owner=request.node.path.name)
