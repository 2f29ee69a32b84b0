"""TensorBoard event files written by the driver's TensorBoardTracker from metrics records and events, local and
through an fsspec URI (that the launcher's Follower writes them in a real run: tests/faults/test_tracking.py)."""

from __future__ import annotations

import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from raydist.metrics.tensorboard import TensorBoardTracker

RECORDS = [
    {"step": 0, "loss": 5.8, "val_loss": 5.8, "tokens_per_s": 0.0, "world_size": 2},
    {"step": 10, "loss": 4.0, "lr": 1e-3, "tokens_per_s": 1500.0, "mfu": 0.2, "world_size": 2,
     "mem_peak_mb_per_rank": [900.0, 850.0], "pipeline": {"busy_s": [0.3, 0.2], "idle_s": [0.1, 0.2], "bubble": 0.25},
     "mfu_peak_source": "measured:cpu_fp32_matmul", "mesh": {"pp": 2}},
    {"step": 20, "loss": 3.0, "val_loss": 3.2, "tokens_per_s": 1600.0, "mfu": 0.21, "world_size": 2},
]


def _scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(log_dir)
    acc.Reload()
    # event files store float32: round to compare with the float64 records
    return {tag: [(e.step, round(e.value, 5)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_scalars_round_trip(tmp_path):
    tb = TensorBoardTracker(str(tmp_path))
    tb.start()
    for record in RECORDS:
        tb.metric(record)
    tb.event({"kind": "restart", "step": 10, "elapsed_s": 12.0, "reason": "worker died"})
    tb.end("FINISHED", {"steps": 20})
    scalars = _scalars(str(tmp_path / "tensorboard"))
    assert scalars["train/loss"] == [(0, 5.8), (10, 4.0), (20, 3.0)]
    assert [s for s, _ in scalars["train/val_loss"]] == [0, 20]
    assert scalars["memory/peak_mb_rank1"] == [(10, 850.0)]
    assert scalars["pipeline/bubble"] == [(10, 0.25)]
    assert scalars["events/restart"] == [(10, 1.0)]
    assert "train/mfu_peak_source" not in scalars  # strings are not scalars


def test_remote_run_dir_is_uploaded(tmp_path):
    """A non-local fsspec run dir (memory://) gets the event files copied up with each checkpoint and at the end."""
    import fsspec

    tb = TensorBoardTracker("memory://runs/remote-run")
    tb.start()
    assert not tb.writer.local
    tb.metric(RECORDS[1])
    fs = fsspec.filesystem("memory")
    assert not fs.exists("/runs/remote-run/tensorboard") or not fs.ls("/runs/remote-run/tensorboard")
    tb.event({"kind": "checkpoint", "step": 10, "path": "memory://runs/remote-run/checkpoints/step_00000010"})
    files = fs.ls("/runs/remote-run/tensorboard")
    assert files and all("tfevents" in f["name"] for f in files)
    tb.end("FINISHED", {})
    local = tmp_path / "copy"
    local.mkdir()
    for f in fs.ls("/runs/remote-run/tensorboard"):
        (local / f["name"].rsplit("/", 1)[-1]).write_bytes(fs.cat_file(f["name"]))
    assert _scalars(str(local))["train/loss"] == [(10, 4.0)]


def test_without_tensorboard_a_warning_and_no_writer(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    lines = []
    tb = TensorBoardTracker(str(tmp_path), lines.append)
    tb.start()
    tb.metric(RECORDS[0])
    tb.end("FINISHED", {})
    assert tb.writer is None and not (tmp_path / "tensorboard").exists()
    assert lines == ["warning: tensorboard is not installed: no event files in RUN_DIR/tensorboard/ "
                     "(pip install tensorboard)"]
