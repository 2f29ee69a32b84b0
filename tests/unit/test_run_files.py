"""The files a real run writes, read back: goodput accounting (raydist.metrics.goodput) and `raydist report`.

One process trains 8 steps with a checkpoint every 4 and is killed right after step 7 (step 6 recorded,
step 7 in flight); it resumes from step 4, redoes steps 5 and 6 and finishes. An uninterrupted run of the
same config is the reference. The goodput fields of summary.json must hold together with the run's own
metrics and events (times sandwiched between the records around them, intervals that cannot overlap
summing to at most the wall time), and the report must show that run: its steps, losses, the restart."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from raydist.testing import run_fit, tiny_config

STEPS, EVERY, CRASH = 8, 4, 7
SLACK_S = 0.002  # times in the files are rounded to the millisecond


def config(data: str) -> dict:
    return tiny_config(data, train={"steps": STEPS}, checkpoint={"every_steps": EVERY, "keep": 3, "async_save": False})


def jsonl(run_dir: str, name: str) -> list[dict]:
    with open(os.path.join(run_dir, name)) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_json(run_dir: str, name: str) -> dict:
    with open(os.path.join(run_dir, name)) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory) -> dict:
    """{"reference": (its FitResult, run dir), "resumed": (the resumed attempt's FitResult, run dir)}."""
    root = tmp_path_factory.mktemp("run-files")
    raw = config(tiny_data)
    [reference] = run_fit(raw, 1, str(root / "reference"))
    # (its bookkeeping written as it goes: the lines of step 6 are on storage when step 7 is killed)
    assert run_fit(raw, 1, str(root / "resumed"), crash_after_step=CRASH, imports=("sync_bookkeeping",)) is None
    [resumed] = run_fit(raw, 1, str(root / "resumed"))
    return {"reference": (reference, str(root / "reference")), "resumed": (resumed, str(root / "resumed"))}


def checkpoint_write_s(run_dir: str) -> float:
    return sum(e["write_s"] for e in jsonl(run_dir, "events.jsonl") if e["kind"] == "checkpoint")


def check_wall_time(summary: dict, run_dir: str) -> None:
    """run_wall_s lies between the last step's record and the end event; the checkpoint stalls (blocking
    saves: at least each committed checkpoint's write) and the last attempt's training loop, which never
    overlap, fit in it; useful tokens/s is the run's tokens over it."""
    last = max(jsonl(run_dir, "metrics.jsonl"), key=lambda r: r["elapsed_s"])
    [end] = [e for e in jsonl(run_dir, "events.jsonl") if e["kind"] == "end"]
    assert last["step"] == STEPS
    assert last["elapsed_s"] <= summary["elapsed_s"] <= summary["run_wall_s"] <= end["elapsed_s"] + SLACK_S
    assert checkpoint_write_s(run_dir) - SLACK_S <= summary["time_lost_checkpoint_s"]
    assert summary["time_lost_checkpoint_s"] + summary["train_wall_s"] <= summary["run_wall_s"] + SLACK_S
    # over the wall time before summary.json rounded it to the millisecond: a run of 0.35 s (a clean-clone
    # CI run) moves the quotient by up to 1.4e-3 that way
    wall, tokens = summary["run_wall_s"], summary["tokens"]
    assert tokens / (wall + 5e-4) - 0.005 <= summary["useful_tokens_per_s"] <= tokens / (wall - 5e-4) + 0.005
    assert (summary["replicas_lost"], summary["replica_time_out_s"], summary["replicas_out_at_end"]) == (0, 0.0, 0)


def test_the_training_loops_time_leaves_out_its_checkpoint_stalls(tiny_data, tmp_path):
    """Every save stalls a second more (tests/unit/slow_save.py): the one inside the loop (step 4) is checkpoint
    time, not training time, so the two still fit in the run's wall time. Until 2026-11-30 train_wall_s held
    it too: with this plant 1.25 s against the 0.50 s bound below, and without it a clean-clone CI run once
    saw 0.615 + 0.151 s over a wall of 0.76 s (test_goodput_of_an_uninterrupted_run)."""
    from slow_save import SLOW_S

    run_dir = str(tmp_path / "run")
    [result] = run_fit(config(tiny_data), 1, run_dir, imports=("slow_save",))
    summary = result.summary
    assert summary["time_lost_checkpoint_s"] >= 2 * SLOW_S  # steps 4 and 8
    # the loop runs from just after step 0's record to just after step 8's, the step-4 save inside it
    elapsed = {r["step"]: r["elapsed_s"] for r in jsonl(run_dir, "metrics.jsonl")}
    assert summary["train_wall_s"] <= elapsed[STEPS] - elapsed[0] - SLOW_S + 0.25  # (the plant: 1 s over)
    check_wall_time(summary, run_dir)


def test_goodput_of_an_uninterrupted_run(runs):
    result, run_dir = runs["reference"]
    summary = read_json(run_dir, "summary.json")
    assert summary == result.summary  # what fit returned is what it wrote
    assert (summary["restarts"], summary["steps_redone"], summary["time_lost_restart_s"]) == (0, 0, 0.0)
    assert summary["time_lost_checkpoint_s"] > 0  # two blocking saves (steps 4 and 8)
    check_wall_time(summary, run_dir)
    progress = read_json(run_dir, "progress.json")
    assert (progress["attempts"], progress["max_step"], progress["recovering"]) == (1, STEPS, None)


def test_goodput_after_a_crash_and_resume(runs):
    result, run_dir = runs["resumed"]
    summary = read_json(run_dir, "summary.json")
    assert summary == result.summary
    metrics, events = jsonl(run_dir, "metrics.jsonl"), jsonl(run_dir, "events.jsonl")
    first = [r for r in metrics if r["attempt"] == 1]
    second = {r["step"]: r for r in metrics if r["attempt"] == 2}
    [restart] = [e for e in events if e["kind"] == "restart"]

    # the steps redone: those the killed attempt had recorded since the checkpoint it resumed from
    assert [r["step"] for r in first] == list(range(CRASH))  # killed after step 7, before recording it
    assert restart["resumed_step"] == restart["step"] == EVERY and restart["previous_step"] == CRASH - 1
    assert summary["restarts"] == 1 and summary["steps_redone"] == restart["steps_to_redo"] == CRASH - 1 - EVERY
    assert sorted(second) == list(range(EVERY + 1, STEPS + 1))

    # time lost to the restart: from the killed attempt's last progress (after its step-5 record, before its
    # step-6 record) until the new attempt is back at step 6 (before its step-6 record); at least the gap
    # from that last record to the restart event
    lost = summary["time_lost_restart_s"]
    assert restart["elapsed_s"] - first[-1]["elapsed_s"] - SLACK_S <= lost
    assert lost <= second[CRASH - 1]["elapsed_s"] - first[-2]["elapsed_s"] + SLACK_S
    assert lost + summary["time_lost_checkpoint_s"] <= summary["run_wall_s"] + SLACK_S  # never overlapping
    check_wall_time(summary, run_dir)
    progress = read_json(run_dir, "progress.json")
    assert (progress["attempts"], progress["restarts"], progress["max_step"]) == (2, 1, STEPS)
    assert progress["recovering"] is None  # the new attempt got back past step 6


def test_report_of_the_resumed_run(runs, tmp_path, capsys):
    import matplotlib.pyplot as plt

    from raydist.cli import main
    from raydist.report import load_run
    from raydist.report.data import goodput
    from raydist.report.plots import PANELS, panel_loss

    reference, _ = runs["reference"]
    resumed, run_dir = runs["resumed"]
    out = tmp_path / "report"
    assert main(["report", run_dir, "--out", str(out)]) == 0
    html = (out / "report.html").read_text()
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for panel_id, _, _ in PANELS:  # every panel but the pipeline's (no pipeline here) has data
        assert (f"panel empty' id='panel-{panel_id}'" in html) == (panel_id == "pipeline"), panel_id
    # the goodput table and the event list
    assert "<th>steps</th><td>8</td>" in html and "<th>restarts</th><td>1</td>" in html
    assert "<th>steps redone</th><td>2</td>" in html and "<th>checkpoints</th><td>2</td>" in html
    assert f"step {EVERY}</th><td>restart: " in html and f"resumed_step={EVERY}" in html

    # the same from the run's files alone (no summary.json): the report's own accounting agrees with fit's
    data = load_run(run_dir)
    g = goodput(data)
    assert (g["status"], g["steps"], g["restarts"], g["steps_redone"], g["checkpoints"]) == ("completed", 8, 1, 2, 2)
    bare = tmp_path / "bare"
    shutil.copytree(run_dir, bare)
    os.remove(bare / "summary.json")
    g = goodput(load_run(str(bare)))
    assert (g["restarts"], g["steps_redone"], g["checkpoints"], g["steps"]) == (1, 2, 2, STEPS)

    # the loss panel: one line per attempt, each step's loss that step's training loss
    fig, ax = plt.subplots()
    try:
        assert panel_loss(ax, data)
        lines = {line.get_label(): line for line in ax.get_lines()}
    finally:
        plt.close(fig)
    first, second = lines["loss (attempt 1)"], lines["loss (attempt 2)"]
    assert list(first.get_xdata()) == list(range(CRASH))
    assert list(second.get_xdata()) == list(range(EVERY + 1, STEPS + 1))
    assert list(second.get_ydata()) == resumed.losses  # the resumed attempt's own losses
    assert list(first.get_ydata())[1:] == pytest.approx(reference.losses[:CRASH - 1], rel=1e-6)
    assert list(second.get_ydata()) == pytest.approx(reference.losses[EVERY:], rel=1e-6)
    assert list(lines["restart"].get_xdata()) == [EVERY, EVERY]  # drawn at the step it resumed from
