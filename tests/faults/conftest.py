"""Shared pieces of the fault tests: the small run they all train, its uninterrupted reference, and a
driver that runs `launch` without Ray (its workers are `run_fit`'s gloo processes)."""

from __future__ import annotations

import sys

import pytest

from fault_runs import small_config
from raydist.testing import run_fit


@pytest.fixture(scope="session")
def reference(tiny_data, tmp_path_factory):
    """Per-step losses of an uninterrupted run (checkpointing does not change the arithmetic)."""
    [result] = run_fit(small_config(tiny_data), 1, str(tmp_path_factory.mktemp("reference") / "run"))
    return result.losses


class _SpawnTrainer:
    """Stands in for Ray Train's TorchTrainer: `fit()` runs the workers as gloo processes."""

    def __init__(self, lp, fail: BaseException | None):
        self.lp, self.fail = lp, fail

    def fit(self):
        if self.fail is not None:
            raise self.fail
        raw = self.lp.cfg.to_dict()  # (the harness takes one config: the data path the driver resolved in it)
        raw["data"]["path"] = self.lp.facts.data_path
        run_fit(raw, self.lp.cfg.ray.num_workers, self.lp.facts.run_dir, imports=("faults_fs",))


@pytest.fixture
def launch_without_ray(monkeypatch):
    """Patches the launcher so `launch` (and `raydist train`) run everything but Ray: returns a dict
    whose "fail" entry, when set, is raised by the trainer instead of training."""
    from raydist.driver import launcher

    control: dict = {"fail": None, "trainers": 0}

    def build_trainer(lp, use_gpu, start_time, record_samples=False):
        control["trainers"] += 1
        return _SpawnTrainer(lp, control["fail"])

    monkeypatch.setattr(launcher, "connect_ray", lambda *a, **k: False)
    monkeypatch.setattr(launcher, "_warn_local_paths", lambda *a, **k: None)
    monkeypatch.setattr(launcher, "resolve_use_gpu", lambda cfg: False)
    monkeypatch.setattr(launcher, "wait_for_capacity", lambda *a, **k: 1)
    monkeypatch.setattr(launcher, "build_trainer", build_trainer)
    # Progress's default stream is the sys.stderr of import time, which pytest's capture may have closed.
    progress = launcher.Progress
    monkeypatch.setattr(launcher, "Progress",
                        lambda run_dir, total, **kw: progress(run_dir, total, stream=sys.stderr, **kw))
    yield control
    import ray

    # a launch "without Ray" that started one anyway (ray.get_runtime_context() auto-initialises) would
    # make every later test's ray.init fail; fail here, where it happened
    assert not ray.is_initialized(), "the launcher started Ray although the test patched it out"


@pytest.fixture
def no_ray(monkeypatch):
    """Fails the test if the launcher tries to start or join Ray."""
    from raydist.driver import launcher

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(launcher, "connect_ray", refuse)
