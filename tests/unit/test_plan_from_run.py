"""The plan for a run against what it measured (raydist/planner/from_run.py): `raydist plan --from-run RUN_DIR`,
`--calibrate --from-run` and `raydist report`'s section, on a real run's files (2 ranks, data-parallel) and on
records written to show what the reader must do (a restart, a run on a GPU, a config edited after the run)."""

from __future__ import annotations

import json
import os
import statistics

import pytest

from raydist.cli import main
from raydist.config import Config, ConfigError
from raydist.planner.from_run import calibrate_from_run, compare_run, measured_figures, run_device
from raydist.testing import run_fit, tiny_config

STEPS = 8


@pytest.fixture(scope="module")
def run_dir(tiny_data, tmp_path_factory) -> str:
    """A data-parallel run of 2 ranks, with the config.toml the driver writes."""
    root = str(tmp_path_factory.mktemp("from-run") / "dp2")
    raw = tiny_config(tiny_data, train={"steps": STEPS, "log_every": 2}, parallel={"dp_replicate": 2},
                      ray={"num_workers": 2})
    run_fit(raw, 2, root)
    with open(os.path.join(root, "config.toml"), "w") as f:
        f.write(Config.from_dict(raw).to_toml())
    return root


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYDIST_CACHE", str(tmp_path / "cache"))  # no calibration but the test's own
    return tmp_path / "cache"


def _records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_a_runs_plan_is_its_own_layout_against_its_measured_steps(run_dir, cache):
    c = compare_run(run_dir)
    assert c.device == "cpu" and c.world_size == 2
    assert c.estimate.layout.degrees()["dp_replicate"] == 2 and c.estimate.layout.world_size == 2
    timed = [r for r in _records(run_dir) if r.get("step_time_s") is not None][1:]  # the first interval warms up
    assert c.measured["intervals"] == len(timed) == STEPS // 2 - 1
    assert c.measured["step_time_s"] == pytest.approx(statistics.median(r["step_time_s"] for r in timed))
    assert c.measured["mfu"] is None  # a CPU run reports no MFU (raydist.metrics.flops)
    errors = c.errors()
    assert errors["mfu"] is None
    assert errors["step_time_s"] == pytest.approx(c.estimate.step_time_s / c.measured["step_time_s"] - 1)


def test_a_config_edited_after_the_run_is_refused(run_dir, tmp_path, cache):
    import shutil

    edited = str(tmp_path / "edited")
    shutil.copytree(run_dir, edited)
    text = open(os.path.join(edited, "config.toml")).read()
    text = text.replace("dp_replicate = 2", "dp_replicate = 1").replace("\ntp = 1\n", "\ntp = 2\n")
    with open(os.path.join(edited, "config.toml"), "w") as f:
        f.write(text)
    with pytest.raises(ConfigError, match="was the config edited after the run"):
        compare_run(edited)


def test_the_figures_are_the_last_attempts_after_its_first_interval():
    def rec(step, t, world=2):
        return {"step": step, "step_time_s": t, "tokens_per_s": 100.0 / t, "world_size": world,
                "mesh": {"dp_replicate": world}, "mem_peak_mb": 100.0 * step}
    records = [{"step": 0, "val_loss": 5.0}, rec(2, 9.0), rec(4, 1.0), rec(6, 1.0),  # the first attempt
               rec(4, 8.0, 1), rec(6, 2.0, 1), rec(8, 3.0, 1), rec(10, 4.0, 1)]  # resumed at step 4 on 1 worker
    m = measured_figures(records)
    assert (m["world_size"], m["steps"], m["intervals"], m["step_time_s"]) == (1, [6, 10], 3, 3.0)
    assert m["mem_peak_gb"] == pytest.approx(1000.0 * 2**20 / 1e9)
    with pytest.raises(ConfigError, match="no logged training step"):
        measured_figures([{"step": 0, "val_loss": 5.0}])


@pytest.mark.parametrize("source, row", [("table:NVIDIA H100 80GB HBM3", "h100"), ("table:NVIDIA H200", "h200"),
                                         ("table:NVIDIA A100-SXM4-80GB", "a100"),
                                         ("none:cpu (no peak FLOP/s holds on a shared CPU)", "cpu")])
def test_the_runs_device_comes_from_its_records(source, row):
    assert run_device([{"step": 1, "mfu_peak_source": source}]) == row


def test_a_gpu_the_planner_has_no_row_for_is_named():
    with pytest.raises(ConfigError, match="'NVIDIA L4'.*pass --device"):
        run_device([{"step": 1, "mfu_peak_source": "table:NVIDIA L4"}])


def test_calibrating_from_a_run_fits_the_compute_rate_to_its_step(run_dir, cache):
    record, scale = calibrate_from_run(run_dir)
    assert scale > 0 and (cache / "calibration.json").is_file()
    [workload] = record["workloads"].values()
    assert workload["fitted_to_run"]["run_dir"] == run_dir
    # the model split over the 2 ranks was timed against one rank's whole model (never faster than half of it)
    assert set(workload["tp_factors"]) == {"2"} and workload["tp_factors"]["2"] > 0.5
    c = compare_run(run_dir)  # the run it was fitted to now prices at its own step time
    assert c.errors()["step_time_s"] == pytest.approx(0.0, abs=0.01)
    assert "fitted to" in c.hardware.source
    # the measurement is the workload's with the kernels it ran: the same model with the plain loss is not it
    import dataclasses

    from raydist.planner.hardware import config_signature, get_hardware

    cfg = Config.load(os.path.join(run_dir, "config.toml"))
    plain = dataclasses.replace(cfg, kernels=dataclasses.replace(cfg.kernels, loss="plain"))
    assert "fitted to" in get_hardware("cpu", 2, None, config_signature(cfg)).source
    assert "this workload" not in get_hardware("cpu", 2, None, config_signature(plain)).source


def test_calibrating_from_a_tensor_parallel_run_fits_its_step_too(tiny_data, tmp_path, cache):
    """A TP 2 run: its step is mostly the split model's measured ratio (--calibrate's tp_factors), which scales
    with the compute rate the fit scales; counted as fixed, the fit priced such a run 44% off."""
    root = str(tmp_path / "tp2")
    raw = tiny_config(tiny_data, train={"steps": STEPS, "log_every": 2}, parallel={"tp": 2}, ray={"num_workers": 2})
    run_fit(raw, 2, root)
    with open(os.path.join(root, "config.toml"), "w") as f:
        f.write(Config.from_dict(raw).to_toml())
    record, _ = calibrate_from_run(root)
    [workload] = record["workloads"].values()
    assert workload["tp_factors"]["2"] > 0.5
    c = compare_run(root)
    assert c.estimate.layout.degrees()["tp"] == 2 and c.estimate.time["tp_measured"] > 0
    assert c.errors()["step_time_s"] == pytest.approx(0.0, abs=0.01)


def test_calibrating_from_a_gpu_run_is_refused(run_dir, tmp_path, cache):
    import shutil

    gpu = str(tmp_path / "gpu")
    shutil.copytree(run_dir, gpu)
    records = [dict(r, mfu_peak_source="table:NVIDIA H100 80GB HBM3") for r in _records(run_dir)]
    with open(os.path.join(gpu, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    with pytest.raises(ConfigError, match="trained on a GPU"):
        calibrate_from_run(gpu)
    assert compare_run(gpu).device == "h100"  # compared against the device's row instead


def test_cli_and_report_show_the_comparison(run_dir, tmp_path, cache, capsys):
    assert main(["plan", "--from-run", run_dir, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "cpu" and out["layout"].startswith("dp_replicate2")
    assert set(out["errors"]) == {"step_time_s", "mfu", "mem_peak_gb"} and out["measured"]["step_time_s"] > 0
    assert main(["plan", "--from-run", run_dir]) == 0
    assert "step time" in capsys.readouterr().out
    assert main(["report", run_dir, "--out", str(tmp_path / "report")]) == 0
    html = (tmp_path / "report" / "report.html").read_text()
    assert "The plan against this run" in html and "step time" in html
    assert main(["plan", "--from-run", run_dir, "--device", "tpu"]) == 2  # one error line, before any pricing
    assert capsys.readouterr().err.strip().startswith("error: --device 'tpu' is not one of")


def test_a_report_whose_plan_cannot_be_made_still_renders(tmp_path, cache):
    """The report's plan section says why it has no comparison; the rest of the report is made as before."""
    from raydist.report.data import RunData
    from raydist.report.html import plan_comparison

    run = tmp_path / "no-config"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "step_time_s": 0.1, "world_size": 2}) + "\n")
    assert plan_comparison(RunData(str(run))).startswith("n/a: ") and "config.toml" in plan_comparison(RunData(str(run)))
    (run / "config.toml").write_text("[model]\nnum_layers = 'two'\n")  # unreadable: still a line, not a crash
    assert plan_comparison(RunData(str(run))).startswith("n/a: ")
