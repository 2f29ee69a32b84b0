"""raydist report: a run with a restart, a resize, checkpoints and pipeline data -> PNG + one offline page."""

from __future__ import annotations

import base64
import json
import math
from html.parser import HTMLParser
from pathlib import Path

import matplotlib  # noqa: F401  (a dependency: the report draws with it; missing, this is an error, not a skip)
import pytest

from raydist.cli import main
from raydist.report import build_report, load_run
from raydist.report.data import goodput
from raydist.report.plots import PANELS


def _one_f_one_b(stages: int, microbatches: int, f_s: float = 0.01, b_s: float = 0.02) -> list[dict]:
    """A 1F1B timeline: stage s starts forward of micro-batch i at (s + i) * f_s in warm-up, etc. Good
    enough to draw; the report does not check schedules."""
    actions, clock = [], [0.0] * stages
    for i in range(microbatches):
        for s in range(stages):
            start = max(clock[s], clock[s - 1] if s else 0.0)
            actions.append({"rank": s, "stage": s, "chunk": 0, "kind": "F", "microbatch": i,
                            "start_s": start, "end_s": start + f_s})
            clock[s] = start + f_s
        for s in reversed(range(stages)):
            start = max(clock[s], clock[s + 1] if s + 1 < stages else 0.0)
            actions.append({"rank": s, "stage": s, "chunk": 0, "kind": "B", "microbatch": i,
                            "start_s": start, "end_s": start + b_s})
            clock[s] = start + b_s
    return actions


def make_run_dir(root: Path, *, restart: bool = True, pipeline: bool = True) -> Path:
    """A 100-step run on 4 workers (pp 2 x dp 2) that loses two workers after step 50, restarts from the
    step-30 checkpoint on 2 workers and finishes."""
    run = root / "demo-run"
    run.mkdir(parents=True)
    (run / "config.toml").write_text("[train]\nsteps = 100\n[parallel]\npp = 2\ndp_replicate = -1\n")
    metrics, events = [], [{"kind": "start", "step": 0, "elapsed_s": 0.0, "time": 1e9, "world_size": 4}]
    elapsed = 0.0

    def record(step: int, world: int, elapsed_s: float, val: bool) -> dict:
        rec = {"step": step, "loss": 5.5 * math.exp(-step / 60) + 1.2, "lr": 3e-3, "grad_norm": 1.0,
               "tokens_per_s": 2000.0 * world / 4, "step_time_s": 0.5, "data_wait_s": 0.01,
               "mfu": 0.3 * world / 4, "mfu_peak_source": "measured:cpu_fp32_matmul", "tokens": step * 2048,
               "mem_peak_mb": 900.0 + step, "world_size": world,
               "mesh": {"pp": 2, "dp_replicate": world // 2, "dp_shard": 1, "cp": 1, "tp": 1},
               "elapsed_s": round(elapsed_s, 3)}
        if pipeline:
            rec["mem_peak_mb_per_rank"] = [950.0 - 40 * r + step for r in range(world)]
            rec["pipeline"] = {"busy_s": [0.3, 0.28], "idle_s": [0.1, 0.12], "bubble": 0.2}
        if val:
            rec["val_loss"] = rec["loss"] + 0.1
        return rec

    metrics.append({"step": 0, "loss": 5.8, "val_loss": 5.8, "tokens_per_s": 0.0, "tokens": 0, "world_size": 4,
                    "mesh": {"pp": 2, "dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1}, "elapsed_s": 1.0})
    for step in range(10, 60 if restart else 101, 10):
        elapsed += 5.0
        metrics.append(record(step, 4, elapsed, step % 50 == 0))
        if step % 30 == 0:
            events.append({"kind": "checkpoint", "step": step, "elapsed_s": elapsed + 0.5, "time": 1e9 + elapsed,
                           "path": f"checkpoints/step_{step:08d}"})
    if restart:
        elapsed += 8.0
        events.append({"kind": "restart", "step": 30, "elapsed_s": elapsed, "time": 1e9 + elapsed,
                       "world_size": 2, "reason": "worker died (node lost)"})
        events.append({"kind": "resize", "step": 30, "elapsed_s": elapsed + 0.1, "time": 1e9 + elapsed,
                       "world_size": 2, "previous_world_size": 4})
        for step in range(40, 101, 10):
            elapsed += 10.0
            metrics.append(record(step, 2, elapsed, step % 50 == 0 or step == 100))
            if step % 30 == 0:
                events.append({"kind": "checkpoint", "step": step, "elapsed_s": elapsed + 0.5,
                               "time": 1e9 + elapsed, "path": f"checkpoints/step_{step:08d}"})
        events.append({"kind": "checkpoint_failed", "step": 95, "elapsed_s": elapsed - 4, "time": 1e9 + elapsed,
                       "reason": "disk full"})
    events.append({"kind": "end", "step": 100, "elapsed_s": elapsed + 1, "time": 1e9 + elapsed + 1})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in metrics) + "\n")
    (run / "events.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n")
    (run / "summary.json").write_text(json.dumps({
        "status": "completed", "steps": 100, "first_val_loss": 5.8, "final_val_loss": 1.9, "tokens_per_s": 1500.0,
        "mfu": 0.15, "elapsed_s": elapsed + 1, "restarts": 1 if restart else 0, "steps_redone": 20 if restart else 0,
        "time_lost_restart_s": 28.0 if restart else 0.0, "time_lost_checkpoint_s": 1.5,
        "useful_tokens_per_s": 1200.0}))
    if pipeline:
        (run / "pipeline_timeline.json").write_text(json.dumps(_one_f_one_b(2, 4)))
    return run


class _Refs(HTMLParser):
    def __init__(self):
        super().__init__()
        self.refs, self.ids, self.tags = [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        for key, value in attrs:
            if key in ("src", "href", "srcset", "action", "data"):
                self.refs.append((tag, value))
            if key == "id":
                self.ids.append(value)


def _check_self_contained(html: str) -> _Refs:
    parser = _Refs()
    parser.feed(html)
    assert "script" not in parser.tags and "link" not in parser.tags and "iframe" not in parser.tags
    for tag, ref in parser.refs:
        assert ref.startswith("data:image/png;base64,"), (tag, ref[:60])
        png = base64.b64decode(ref.split(",", 1)[1])
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "@import" not in html and "url(" not in html
    return parser


def test_report_of_a_run_with_a_restart(tmp_path):
    run = make_run_dir(tmp_path)
    paths = build_report(str(run))
    html = Path(paths["html"]).read_text()
    parser = _check_self_contained(html)
    for panel_id, _, _ in PANELS:
        assert f"panel-{panel_id}" in parser.ids
    assert html.count("data:image/png;base64,") == len(PANELS)
    assert "panel empty" not in html  # every panel had data
    assert "restart" in html and "worker died" in html and "checkpoint_failed" in html
    png = Path(paths["png"]).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 50_000
    g = goodput(load_run(str(run)))
    assert g["restarts"] == 1 and g["steps_redone"] == 20 and g["resizes"] == 1 and g["checkpoints"] == 3


def test_goodput_falls_back_to_events_without_summary_fields(tmp_path):
    run = make_run_dir(tmp_path)
    (run / "summary.json").unlink()
    g = goodput(load_run(str(run)))
    assert g["restarts"] == 1
    assert g["steps_redone"] == 20  # logged up to step 50, resumed from 30
    assert g["checkpoints_failed"] == 1


def test_panels_say_no_data_when_files_are_missing(tmp_path):
    run = make_run_dir(tmp_path, restart=False, pipeline=False)
    for name in ("events.jsonl", "summary.json", "config.toml"):
        (run / name).unlink()
    out = tmp_path / "out"
    assert main(["report", str(run), "--out", str(out)]) == 0
    html = (out / "report.html").read_text()
    parser = _check_self_contained(html)
    for panel_id, _, _ in PANELS:
        assert f"panel-{panel_id}" in parser.ids
    assert "panel empty' id='panel-pipeline'" in html
    assert "no data (no events.jsonl)" in html and "no data (no config.toml)" in html
    assert (out / "report.png").stat().st_size > 10_000


def test_report_errors(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "not found" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_report_reads_an_fsspec_uri(tmp_path):
    run = make_run_dir(tmp_path)
    paths = build_report(f"file://{run}", str(tmp_path / "uri-out"))
    assert Path(paths["html"].removeprefix("file://")).is_file()


def test_pipeline_panel_draws_weight_gradient_actions_in_their_own_colour():
    """A zero-bubble step's W actions (deferred weight gradients) get a colour of their own."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    from raydist.report.data import RunData
    from raydist.report.plots import ACTION_COLORS, panel_pipeline

    timeline = [{"rank": 0, "stage": 0, "chunk": 0, "kind": k, "microbatch": 0, "start_s": i * 0.01,
                 "end_s": (i + 1) * 0.01} for i, k in enumerate("FBW")]
    fig, ax = plt.subplots()
    try:
        assert panel_pipeline(ax, RunData("run", timeline=timeline))
        colours = [bar.get_facecolor() for bar in ax.patches]
    finally:
        plt.close(fig)
    assert colours == [to_rgba(ACTION_COLORS[(k, False)]) for k in "FBW"]
    assert len({ACTION_COLORS[(k, False)] for k in "FBW"}) == 3
