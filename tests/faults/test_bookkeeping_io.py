"""Bookkeeping files survive crashes and concurrent writers.

Whole files (progress.json, summary.json, config.toml, manifest.json, extra.json, COMMIT.json) are
replaced atomically; JSON-lines files are appended one whole line at a time (local) or as one part per
writer (object stores); a torn file or line, whatever made it, is read as absent or skipped, and a run
resumed on top of it finishes exactly like an uninterrupted one.
"""

import json
import os
import shutil
import time

import pytest

import faults_fs  # noqa: F401  (registers objfile://)
from fault_runs import small_config
from raydist.metrics.goodput import EventLog, read_events
from raydist.metrics.logger import MetricsWriter, read_metrics
from raydist.store.atomic import write_bytes_atomic
from raydist.store.run_store import RunStore, append_line
from raydist.testing import run_fit


# ---- whole files -----------------------------------------------------------------------------------


def test_local_write_is_replace_or_nothing(tmp_path, monkeypatch):
    target = tmp_path / "d" / "summary.json"
    write_bytes_atomic(str(target), b'{"v": 1}')
    assert json.loads(target.read_text()) == {"v": 1}

    def crash(fd):  # dies after the bytes were written, before the rename
        raise OSError("killed")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="killed"):
        write_bytes_atomic(str(target), b'{"v": 2, "long": "' + b"x" * 10000 + b'"}')
    assert json.loads(target.read_text()) == {"v": 1}  # the old content, whole
    assert os.listdir(target.parent) == ["summary.json"]  # no temporary file left behind


def test_object_store_write_is_one_put(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(faults_fs.ObjFileSystem, "pipe_file",
                        lambda self, path, data, **kw: calls.append((path, data)))
    write_bytes_atomic(f"objfile://host{tmp_path}/run/progress.json", b"{}")
    assert calls == [(f"{tmp_path}/run/progress.json", b"{}")]


@pytest.mark.parametrize("content", [b"", b'{"max_step": 7, "attem'], ids=["empty", "half"])
def test_torn_json_reads_as_absent_with_a_warning(tmp_path, content):
    path = tmp_path / "progress.json"
    path.write_bytes(content)
    with pytest.warns(RuntimeWarning, match="progress.json is (empty|not valid JSON).*treating it as absent"):
        assert RunStore(str(tmp_path)).read_json("progress.json") is None
    assert RunStore(str(tmp_path)).read_json("absent.json") is None


# ---- appended lines ----------------------------------------------------------------------------------


def test_torn_last_line_is_skipped_and_does_not_swallow_the_next(tmp_path, recwarn):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')  # a crash in the middle of an append
    assert read_metrics(str(tmp_path)) == [{"step": 1}]  # the torn last line: skipped, silently
    assert not recwarn.list
    append_line(str(path), json.dumps({"step": 3}))  # the next attempt appends
    assert path.read_text().splitlines() == ['{"step": 1}', '{"step": 2, "lo', '{"step": 3}']
    problems = []
    assert RunStore(str(tmp_path)).read_records("metrics.jsonl", problems) == [{"step": 1}, {"step": 3}]
    assert problems == ["metrics.jsonl:2: not a JSON record (a torn line?), skipped"]


def test_object_store_writers_never_lose_each_others_lines(tmp_path):
    """Rank 0's event log and an event from another rank (`run_event` in a worker) interleave; on an
    object store each writer used to rewrite the one file from its memory, dropping the other's lines."""
    from raydist.training.ray_session import run_event

    run_dir = f"objfile://host{tmp_path}/run"
    os.makedirs(tmp_path / "run")
    (tmp_path / "run" / "events.jsonl").write_text('{"kind": "launch", "step": null, "time": 1.0}\n')  # older version
    rank0 = EventLog(run_dir, run_start=0.0)
    rank0.event("start", 0)
    time.sleep(0.01)  # events are ordered by their millisecond timestamps
    run_event(run_dir, 0.0, "worker_error", rank=1, error="peer died")
    time.sleep(0.01)
    rank0.event("checkpoint", 5)
    metrics = MetricsWriter(run_dir)
    metrics.write({"step": 1})
    later = MetricsWriter(run_dir)  # the next attempt
    later.write({"step": 2})
    kinds = [e["kind"] for e in read_events(run_dir)]
    assert kinds == ["launch", "start", "worker_error", "checkpoint"]
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    assert len(os.listdir(tmp_path / "run" / "events.jsonl.d")) == 2  # one part per writer


# ---- a run resumed on torn bookkeeping ----------------------------------------------------------------


@pytest.fixture(scope="module")
def crashed(tiny_data, tmp_path_factory):
    """A run killed right after step 7 (checkpoint at 5; progress.json says 6 or 7)."""
    run_dir = str(tmp_path_factory.mktemp("crashed") / "run")
    assert run_fit(small_config(tiny_data), 1, run_dir, crash_after_step=7) is None
    return run_dir


@pytest.mark.parametrize("keep", [0, 0.5], ids=["progress-0-bytes", "progress-half"])
def test_resume_on_torn_bookkeeping_finishes_like_an_uninterrupted_run(tiny_data, tmp_path, crashed, reference,
                                                                      keep):
    run_dir = str(tmp_path / "run")
    shutil.copytree(crashed, run_dir)
    # metrics lines are written in the background (raydist.metrics.background): the kill after step 7 may
    # have lost step 6's line, never an earlier one
    before = [r["step"] for r in RunStore(run_dir).read_records("metrics.jsonl")]
    assert before in (list(range(6)), list(range(7)))
    progress = os.path.join(run_dir, "progress.json")
    data = open(progress, "rb").read()
    open(progress, "wb").write(data[:int(len(data) * keep)])
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write('{"step": 7, "loss": 2.')  # and the crash tore the last metrics and events lines
    with open(os.path.join(run_dir, "events.jsonl"), "a") as f:
        f.write('{"kind": "checkp')
    [resumed] = run_fit(small_config(tiny_data), 1, run_dir)
    assert resumed.summary["steps"] == 10
    assert resumed.losses == pytest.approx(reference[5:], rel=1e-6)  # from the step-5 checkpoint
    assert resumed.summary["final_loss"] == pytest.approx(reference[-1], rel=1e-6)
    assert json.load(open(progress))["max_step"] == 10  # rewritten whole
    problems = []
    steps = [r["step"] for r in RunStore(run_dir).read_records("metrics.jsonl", problems)]
    assert steps == before + list(range(6, 11)) and len(problems) == 1
    kinds = [e["kind"] for e in read_events(run_dir)]
    assert kinds[0] == "start" and kinds[-1] == "end"
