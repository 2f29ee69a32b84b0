"""Bytes that change after the commit (same size): `raydist verify` names the file, and a resume notices
the damaged chunk while reading it and falls back to the previous checkpoint, which continues exactly; with
no older checkpoint it stops with one message instead of training a half-loaded model."""

import json
import os

import pytest

from fault_runs import small_config
from raydist.checkpoint import storage
from raydist.testing import run_fit


def flip_a_byte(run_dir: str, step: int) -> None:
    ckpt = os.path.join(run_dir, "checkpoints", storage.step_dir_name(step))
    shard = os.path.join(ckpt, sorted(f for f in os.listdir(ckpt) if f.endswith(".raw"))[0])
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0xFF  # the size stays
    open(shard, "wb").write(bytes(data))


def test_damaged_bytes_are_found_by_verify_and_skipped_on_resume(tiny_data, tmp_path, capsys):
    from raydist.cli import main

    run_dir = str(tmp_path / "run")
    raw = small_config(tiny_data, steps=12, keep=2)  # checkpoints at 5 and 10
    [full] = run_fit(raw, 1, str(tmp_path / "reference"))
    assert run_fit(raw, 1, run_dir, crash_after_step=11) is None
    assert main(["verify", run_dir]) == 0
    assert capsys.readouterr().out.count(" ok ") == 2

    flip_a_byte(run_dir, 10)
    assert main(["verify", run_dir, "--json"]) == 1
    results = json.loads(capsys.readouterr().out)
    assert [r["status"] for r in results] == ["ok", "corrupt"]
    assert "does not match its checksum" in results[1]["problem"]

    [resumed] = run_fit(raw, 1, run_dir)  # reads step 10, finds the chunk, loads step 5 instead
    assert resumed.losses == pytest.approx(full.losses[5:], rel=1e-6)
    events = [json.loads(line) for line in open(os.path.join(run_dir, "events.jsonl"))]
    assert any(e["kind"] == "checkpoint_skipped" and "checksum" in e["reason"] for e in events)


def test_the_only_checkpoint_damaged_stops_the_resume(tiny_data, tmp_path):
    run_dir = str(tmp_path / "run")
    raw = small_config(tiny_data, steps=10)
    assert run_fit(raw, 1, run_dir, crash_after_step=7) is None  # committed 5 only
    flip_a_byte(run_dir, 5)
    with pytest.raises(RuntimeError, match="step_00000005 is corrupt and no older checkpoint loads"):
        run_fit(raw, 1, run_dir)
