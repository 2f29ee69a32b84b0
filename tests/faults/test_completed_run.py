"""`raydist train` on a run that already finished: one line, exit 0, and nothing started or written."""

import dataclasses
import os

import pytest

from fault_runs import files_under, small_config
from raydist.config import Config, dump_toml
from raydist.testing import run_fit


@pytest.fixture(scope="module")
def finished(tiny_data, tmp_path_factory):
    """A completed 5-step run made by run_fit, and a TOML config of it."""
    root = tmp_path_factory.mktemp("finished")
    raw = small_config(tiny_data, steps=5)
    run_fit(raw, 1, str(root / "runs" / "done"))
    (root / "run.toml").write_text(dump_toml(raw))
    return root


def test_rerun_of_a_completed_run_does_nothing(finished, capsys, no_ray):
    from raydist.cli import main

    run_dir = finished / "runs" / "done"
    before = files_under(run_dir)
    args = ["train", str(finished / "run.toml"), "--set", f"checkpoint.storage={finished}/runs",
            "--set", "train.run_name=done"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"run done already completed at step 5 ({run_dir}); nothing to do"]
    assert err == ""
    assert files_under(run_dir) == before  # no lease, no config.toml, no probe: nothing touched
    assert sorted(os.listdir(finished / "runs")) == ["done"]


def test_more_steps_or_a_torn_summary_is_not_completed(finished, tmp_path):
    from raydist.driver.launcher import completed_summary

    lines = []
    cfg = Config.load(finished / "run.toml", [f"checkpoint.storage={finished}/runs", "train.run_name=done"])
    assert completed_summary(cfg, lines.append)["steps"] == 5
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=8))  # asked to go further: resumes
    assert completed_summary(cfg, lines.append) is None
    torn = tmp_path / "runs" / "done"
    torn.mkdir(parents=True)
    (torn / "summary.json").write_text((run := (finished / "runs" / "done" / "summary.json").read_text())[:len(run) // 2])
    cfg = Config.load(finished / "run.toml", [f"checkpoint.storage={tmp_path}/runs", "train.run_name=done"])
    with pytest.warns(RuntimeWarning, match="summary.json is not valid JSON"):
        assert completed_summary(cfg, lines.append) is None
    assert len(lines) == 1
