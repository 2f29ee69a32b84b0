"""Warm spares without a cluster: which processes count as this job's spares, the Ray version gate, the hook
in processes that host no Ray Train worker, and where the settings reach Ray (tests/ray/test_warm_spares_on_ray.py
has the raylet's side)."""

from __future__ import annotations

import pytest

from raydist.config import Config
from raydist.elastic import warm


def fake_proc(root, processes):
    for pid, (title, env) in processes.items():
        d = root / str(pid)
        d.mkdir()
        (d / "cmdline").write_bytes(title.encode() + b"\0--flag\0")
        (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")
    (root / "self").mkdir()
    return str(root)


def test_spares_are_this_jobs_marked_processes_that_host_nothing_yet(tmp_path):
    job = {"RAY_JOB_ID": "01000000", "RAY_RAYLET_PID": "7"}
    mark, ctl = {**job, warm.SPARE_ENV_VAR: "1"}, {**job, warm.CONTROLLER_ENV_VAR: "0"}
    proc = fake_proc(tmp_path, {
        11: (warm.READY_TITLE, mark),                               # idle, preloaded
        10: ("ray::IDLE", mark),                                    # idle, still preloading
        12: ("/venv/bin/python", mark),                             # still starting
        13: ("ray::RayTrainWorker.run_train_fn", mark),             # hosts a worker
        14: ("ray::IDLE", job),                                     # another idle process of the job
        15: ("ray::IDLE", {warm.SPARE_ENV_VAR: "1", "RAY_JOB_ID": "02000000"}),  # another job's spare
        16: ("ray::IDLE", ctl),                                     # a spare of the controller's env
        17: ("ray::SynchronizationActor", ctl),                     # hosts the controller's actor
        18: (warm.READY_TITLE, {**mark, warm.CONTROLLER_ENV_VAR: "0"}),  # a worker's (workers have both)
        19: ("ray::IDLE", {**mark, "RAY_RAYLET_PID": "8"}),         # another cluster's, whose first job too
    })
    assert warm.spare_pids("01000000", "7", proc=proc) == [10, 11, 12, 18]
    assert warm.spare_pids("01000000", "7", ready_only=True, proc=proc) == [11, 18]
    assert warm.spare_pids("01000000", "7", controller=True, proc=proc) == [16]
    assert warm.spare_pids("01000000", "7", proc=str(tmp_path / "none")) == []


def test_the_controllers_runtime_env_is_a_workers_without_the_marker():
    controller = '{"env_vars":{"A":"1","RAY_TRAIN_X":"0"},"worker_process_setup_hook":"h"}'
    for worker in ('{"env_vars":{"A":"1","RAYDIST_SPARE_WORKER":"1","RAY_TRAIN_X":"0"},"worker_process_setup_hook":"h"}',
                   '{"env_vars":{"RAYDIST_SPARE_WORKER":"1","A":"1","RAY_TRAIN_X":"0"},"worker_process_setup_hook":"h"}'):
        assert warm.controller_runtime_env(worker) == controller
    assert warm.controller_runtime_env(controller) is None


def test_the_version_gate():
    assert warm.ray_supported("2.60.0")
    assert not warm.ray_supported("2.39.1") and not warm.ray_supported("3.0.0") and not warm.ray_supported("x")


def test_an_unchecked_ray_version_asks_for_nothing_and_says_so(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "__version__", "9.1.0")
    lines = []
    assert warm.request_spares(2, log=lines.append) is None
    assert len(lines) == 1 and "Ray 9.1.0" in lines[0] and "cold" in lines[0]


def test_a_failed_request_is_one_warning_not_an_error(monkeypatch):
    monkeypatch.delenv("RAY_RAYLET_PID", raising=False)
    lines = []  # no Ray worker in this process: the request cannot be made
    assert warm.request_spares(2, log=lines.append) is None
    assert len(lines) == 1 and lines[0].startswith("warning: could not start warm spare workers")


def test_the_hook_preloads_only_in_a_workers_or_the_controllers_processes(monkeypatch):
    """And titles a Ray worker process READY_TITLE when done (what `spare_pids(ready_only=True)` looks for)."""
    import sys

    import ray._raylet

    titles = []
    monkeypatch.setattr(ray._raylet, "setproctitle", titles.append)
    monkeypatch.setenv("RAY_RAYLET_PID", "7")
    monkeypatch.delenv(warm.SPARE_ENV_VAR, raising=False)
    monkeypatch.delenv(warm.CONTROLLER_ENV_VAR, raising=False)
    monkeypatch.setattr(warm, "preloaded_at", None)
    warm.preload()
    assert warm.preloaded_at is None and titles == []
    monkeypatch.setenv(warm.CONTROLLER_ENV_VAR, "0")
    warm.preload()
    assert warm.preloaded_at is not None and set(warm.PRELOAD_CONTROLLER) <= set(sys.modules)
    assert titles == [warm.READY_TITLE]
    monkeypatch.setattr(warm, "preloaded_at", None)
    monkeypatch.setenv(warm.SPARE_ENV_VAR, "1")
    warm.preload()
    assert warm.preloaded_at is not None and set(warm.PRELOAD) <= set(sys.modules)
    assert titles == [warm.READY_TITLE] * 2
    monkeypatch.delenv("RAY_RAYLET_PID")  # not a Ray worker (this test's process): its title stays
    warm.preload()
    assert titles == [warm.READY_TITLE] * 2


def test_the_hook_is_the_module_function_ray_loads():
    from ray._common.utils import load_class

    assert load_class(warm.HOOK) is warm.preload


@pytest.mark.parametrize("on", [True, False])
def test_the_setting_reaches_the_job_and_the_workers_runtime_env(monkeypatch, on):
    import ray

    from raydist.driver import ray_cluster

    cfg = Config.load(None, [f"elastic.warm_spares={str(on).lower()}"])
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.delenv("RAY_JOB_ID", raising=False)
    ray_cluster.connect_ray(cfg, None, 2)  # embedded
    ray_cluster.connect_ray(cfg, "127.0.0.1:6379", 2)  # joined by this driver: its env vars too
    assert calls[0].get("runtime_env") == (warm.job_runtime_env() if on else None)
    assert ("worker_process_setup_hook" in calls[1]["runtime_env"]) is on
    assert "env_vars" in calls[1]["runtime_env"]


def test_live_recovery_runs_without_spares(monkeypatch):
    """Live recovery with spares on did not reach its first steps (replicas of several workers): off there."""
    import ray

    from raydist.driver import ray_cluster

    cfg = Config.load(None, ["elastic.live_recovery=true", "parallel.dp_replicate=2", "ray.num_workers=2"])
    assert cfg.elastic.warm_spares and not warm.enabled(cfg)
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    ray_cluster.connect_ray(cfg, None, 2)
    assert calls[0].get("runtime_env") is None


# A spare process whose torch import fails once, after torch._C was loaded (torch.library too): the failure
# a Ray Train worker met in CI, where the swallowed first failure made its own import of torch fail with
# "partially initialized module 'torch' has no attribute 'library'".
_FAILING_ONCE = """
import sys

sys.path.insert(0, {plants!r})
from warm_plant import plant_torch_failure

plant = plant_torch_failure()
from raydist.elastic import warm
try:
    warm.preload()
except RuntimeError as exc:
    print("ENDED:", exc)
    raise SystemExit(0)
finally:
    print("PLANT FIRED:", not plant.armed)
try:
    import ray.train.torch
    print("LATER IMPORT: ok")
except Exception as exc:
    print("LATER IMPORT:", type(exc).__name__, exc)
"""


def _spare_process(tmp_path, job):
    import os
    import subprocess
    import sys

    env = {**os.environ, warm.SPARE_ENV_VAR: "1", "RAY_RAYLET_PID": "7", "RAY_JOB_ID": job,
           "TMPDIR": str(tmp_path)}
    env.pop(warm.CONTROLLER_ENV_VAR, None)
    plants = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ray")  # warm_plant
    return subprocess.run([sys.executable, "-c", _FAILING_ONCE.format(plants=plants)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_spare_that_cannot_import_torch_again_is_ended_before_it_hosts_a_worker(tmp_path):
    out = _spare_process(tmp_path, "01000000")
    assert "PLANT FIRED: True" in out.stdout, out.stdout + out.stderr
    assert "ENDED: raydist ends this spare worker: importing torch failed (MemoryError: planted)" in out.stdout
    # the first failure is named, with where it happened
    assert "warning: raydist could not preload torch in a spare worker (MemoryError: planted at " in out.stdout
    assert (tmp_path / "raydist-unfit-7-01000000").read_text().count("\n") == 1


def test_past_its_bound_the_hook_leaves_the_process_to_fail_where_it_imports(tmp_path):
    """UNFIT_ENDS processes of this node and job were ended: the next is left alone, and then fails as in CI
    (what the hook's end prevents, shown here)."""
    (tmp_path / "raydist-unfit-7-02000000").write_text("1\n" * warm.UNFIT_ENDS)
    out = _spare_process(tmp_path, "02000000")
    assert "PLANT FIRED: True" in out.stdout and "ENDED" not in out.stdout, out.stdout + out.stderr
    assert "cannot import torch again" in out.stdout
    assert "LATER IMPORT: AttributeError partially initialized module 'torch' has no attribute 'library'" in out.stdout


def test_a_pure_python_import_that_failed_is_undone_so_that_a_later_one_succeeds(tmp_path, monkeypatch, capsys):
    import importlib
    import sys

    pkg = tmp_path / "rd_fails_once"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from rd_fails_once import first, second\n")
    (pkg / "first.py").write_text("VALUE = 1\n")
    marker = tmp_path / "failed"
    (pkg / "second.py").write_text(f"import os\nif not os.path.exists({str(marker)!r}):\n"
                                   f"    open({str(marker)!r}, 'w').close()\n    raise OSError('planted')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(warm, "PRELOAD", ("rd_fails_once",))
    monkeypatch.setattr(warm, "PRELOAD_OPTIONAL", ())
    monkeypatch.setattr(warm, "preloaded_at", None)
    monkeypatch.setenv(warm.SPARE_ENV_VAR, "1")
    try:
        warm.preload()
        assert warm.preloaded_at is None and "rd_fails_once.first" not in sys.modules
        assert "could not preload rd_fails_once in a spare worker (OSError: planted at " in capsys.readouterr().out
        module = importlib.import_module("rd_fails_once")  # without the undo: no attribute 'first'
        assert module.first.VALUE == 1
    finally:
        for name in [m for m in sys.modules if m.startswith("rd_fails_once")]:
            del sys.modules[name]


def test_where_the_count_cannot_be_kept_no_process_is_ended(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    assert warm._count_unfit_end() > warm.UNFIT_ENDS
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert [warm._count_unfit_end() for _ in range(2)] == [1, 2]
