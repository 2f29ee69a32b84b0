"""`raydist status RUN_DIR`: a running (live lease), a completed, a failed and an interrupted run, read from
their run directories alone; an unknown directory is one `error:` line, exit status 2."""

from __future__ import annotations

import json
import time

import pytest

from fault_runs import small_config
from raydist.checkpoint.lease import RunLease
from raydist.cli import main
from raydist.config import Config, dump_toml
from raydist.driver.status import run_status
from raydist.testing import run_fit


def status(capsys, run_dir) -> tuple[dict, str]:
    assert main(["status", str(run_dir), "--json"]) == 0
    as_json = json.loads(capsys.readouterr().out)
    assert main(["status", str(run_dir)]) == 0
    return as_json, capsys.readouterr().out


def write_config(raw: dict, run_dir) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(dump_toml(Config.from_dict(raw).to_dict()))


def test_status_of_a_running_run(tiny_data, tmp_path, capsys):
    """Workers at step 6 of 10 (a checkpoint committed at 5) and a driver heartbeating the lease."""
    run_dir = tmp_path / "live"
    raw = small_config(tiny_data)
    write_config(raw, run_dir)
    assert run_fit(raw, 1, str(run_dir), crash_after_step=7) is None  # killed in step 7: files up to step 6
    with RunLease(str(run_dir), "live", log=lambda *_: None):
        s, text = status(capsys, run_dir)
    assert s["state"] == "running" and "lease heartbeat" in s["detail"]
    # the step the workers' files reached (their bookkeeping writes in the background: 5 or 6)
    assert s["step"] in (5, 6) and s["steps"] == 10
    assert s["loss"] > 0 and s["tokens_per_s"] > 0 and s["eta_s"] > 0
    assert s["checkpoint"]["step"] == 5 and s["restarts"] == 0 and s["last_error"] is None
    assert "state       running" in text and f"step        {s['step']} of 10  ({10 * s['step']}%)" in text
    assert "ETA " in text
    assert "checkpoint  step 5" in text


def test_status_of_a_completed_run(tiny_data, tmp_path, capsys, launch_without_ray):
    (tmp_path / "run.toml").write_text(dump_toml(small_config(tiny_data)))
    assert main(["train", str(tmp_path / "run.toml"), "--set", f"checkpoint.storage={tmp_path}",
                 "--set", "train.run_name=done", "--set", "ray.num_workers=1"]) == 0
    capsys.readouterr()
    s, text = status(capsys, tmp_path / "done")
    assert s["state"] == "completed" and (s["step"], s["steps"]) == (10, 10)
    assert s["checkpoint"]["step"] == 10 and s["eta_s"] is None and s["last_error"] is None
    assert s["lease"] is None  # released at the end
    assert "state       completed" in text and "step        10 of 10  (100%)" in text


def test_status_of_a_failed_run(tiny_data, tmp_path, capsys, launch_without_ray):
    """The workers got to step 6 (checkpoint 5), then the driver's training failed: the driver records it."""
    raw = small_config(tiny_data)
    run_dir = tmp_path / "broken"
    assert run_fit(raw, 1, str(run_dir), crash_after_step=7) is None
    (tmp_path / "run.toml").write_text(dump_toml(raw))
    launch_without_ray["fail"] = RuntimeError("worker 1 exploded\nsecond line")
    with pytest.raises(RuntimeError):
        from raydist.driver.launcher import launch

        launch(Config.load(tmp_path / "run.toml", [f"checkpoint.storage={tmp_path}", "train.run_name=broken",
                                                               "ray.num_workers=1"]),
               log=lambda *_: None)
    capsys.readouterr()
    s, text = status(capsys, run_dir)
    assert s["state"] == "failed" and s["step"] in (5, 6) and s["steps"] == 10
    assert s["checkpoint"]["step"] == 5
    assert s["last_error"]["source"] == "driver" and "worker 1 exploded" in s["last_error"]["message"]
    assert "second line" not in s["last_error"]["message"]
    assert "state       failed" in text and "last error" in text and "worker 1 exploded" in text


def test_a_driver_gone_without_cleanup_is_interrupted(tiny_data, tmp_path):
    raw = small_config(tiny_data)
    run_dir = tmp_path / "gone"
    write_config(raw, run_dir)
    assert run_fit(raw, 1, str(run_dir), crash_after_step=4) is None
    lease = RunLease(str(run_dir), "gone", log=lambda *_: None).acquire()  # never released or renewed
    assert run_status(str(run_dir))["state"] == "running"
    s = run_status(str(run_dir), now=time.time() + 60)  # past the stale limit
    assert s["state"] == "interrupted" and "stopped heartbeating" in s["detail"]
    assert s["step"] in (2, 3) and s["eta_s"] is None
    del lease


def test_unknown_directory_is_one_error_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "nowhere", tmp_path / "empty"):
        assert main(["status", str(target)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1
        assert err.startswith(f"error: {target} is not a run directory")
