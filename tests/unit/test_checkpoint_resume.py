"""Checkpoint/restart under plain torch.distributed (gloo processes): a killed run resumes from the newest
committed checkpoint with the same samples in the same order (same or different dp size), partial and
corrupt checkpoints are skipped, and a checkpoint loads into another layout with identical outputs."""

import json
import os

import numpy as np
import pytest

from raydist.testing import run_fit, tiny_config

STEPS = 10


def config(data, dp_replicate=1, dp_shard=1, **train):
    return tiny_config(data, train={"steps": STEPS, "global_batch": 12, "micro_batch": 1, **train},
                       parallel={"dp_replicate": dp_replicate, "dp_shard": dp_shard},
                       checkpoint={"every_steps": 5, "keep": 3, "async_save": False})


def global_samples(results):
    """Per step, the global batch's sample ids in dp-rank order (batch leaders' slices concatenated)."""
    leaders = [r for r in results if r.sample_ids]
    return [np.concatenate([r.sample_ids[i] for r in leaders]).tolist() for i in range(len(leaders[0].sample_ids))]


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    """An uninterrupted run at dp 2."""
    run_dir = str(tmp_path_factory.mktemp("ref") / "run")
    results = run_fit(config(tiny_data, dp_replicate=2), 2, run_dir)
    return results, global_samples(results)


def events(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "events.jsonl"))]


def test_kill_and_resume_same_layout(tiny_data, tmp_path, reference):
    ref_results, ref_samples = reference
    run_dir = str(tmp_path / "run")
    # (bookkeeping on the training thread: with the writer thread a loaded machine may still hold step 6's
    # lines at the kill, as a clean-clone CI run did; tests/unit/sync_bookkeeping.py)
    assert run_fit(config(tiny_data, dp_replicate=2), 2, run_dir, crash_after_step=7,
                   imports=("sync_bookkeeping",)) is None
    first = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    resumed = run_fit(config(tiny_data, dp_replicate=2), 2, run_dir)
    # the resumed attempt starts at the step-5 checkpoint: steps 6..10, exactly as the uninterrupted run
    assert resumed[0].losses == pytest.approx(ref_results[0].losses[5:], rel=1e-6)
    assert global_samples(resumed) == ref_samples[5:]
    assert [r["step"] for r in first] == list(range(7))  # killed right after step 7, before logging it
    summary = resumed[0].summary
    # step 6 was done and recorded before the kill; step 7 was in flight (its bookkeeping never ran)
    assert summary["restarts"] == 1 and summary["steps_redone"] == 1 and summary["steps"] == STEPS
    kinds = [e["kind"] for e in events(run_dir)]
    assert kinds[0] == "start" and "restart" in kinds and kinds[-1] == "end"


@pytest.mark.parametrize("before, after", [
    ((1, 4), (2, 1)),   # FSDP 4 -> DDP 2
    ((2, 1), (1, 3)),   # DDP 2 -> FSDP 3
], ids=["fsdp4-to-ddp2", "ddp2-to-fsdp3"])
def test_resume_at_another_dp_size_sees_the_same_samples(tiny_data, tmp_path, reference, before, after):
    ref_results, ref_samples = reference
    run_dir = str(tmp_path / "run")
    assert run_fit(config(tiny_data, *before), before[0] * before[1], run_dir, crash_after_step=7) is None
    resumed = run_fit(config(tiny_data, *after), after[0] * after[1], run_dir)
    assert global_samples(resumed) == ref_samples[5:]  # no sample lost or repeated, same order
    got, want = np.array(resumed[0].losses), np.array(ref_results[0].losses[5:])
    assert (np.abs(got - want) / want).max() < 1e-4
    resize = [e for e in events(run_dir) if e["kind"] == "resize"]
    assert resize and resize[0]["from_world_size"] == before[0] * before[1]


def test_crash_during_checkpoint_write_keeps_the_previous_one(tiny_data, tmp_path, reference):
    run_dir = str(tmp_path / "run")
    raw = config(tiny_data, dp_replicate=2)
    assert run_fit(raw, 2, run_dir, crash_before_commit_of=10) is None  # final save: shards, no commit
    step10 = os.path.join(run_dir, "checkpoints", "step_00000010")
    assert os.path.isdir(step10) and not os.path.exists(os.path.join(step10, "COMMIT.json"))
    resumed = run_fit(raw, 2, run_dir)
    assert len(resumed[0].losses) == 5  # resumed from step 5, the last committed one
    assert resumed[0].losses == pytest.approx(reference[0][0].losses[5:], rel=1e-6)
    skipped = [e for e in events(run_dir) if e["kind"] == "checkpoint_skipped"]
    assert skipped and "no commit marker" in skipped[0]["reason"]


def test_truncated_shard_is_detected(tiny_data, tmp_path):
    run_dir = str(tmp_path / "run")
    raw = config(tiny_data, dp_replicate=2)
    run_fit(raw, 2, run_dir)
    step10 = os.path.join(run_dir, "checkpoints", "step_00000010")
    shard = sorted(f for f in os.listdir(step10) if f.endswith(".raw"))[0]
    with open(os.path.join(step10, shard), "r+b") as f:
        f.truncate(100)
    raw["train"]["steps"] = 12
    resumed = run_fit(raw, 2, run_dir)
    assert len(resumed[0].losses) == 7  # from step 5 to 12: the truncated step-10 checkpoint was skipped
    skipped = [e for e in events(run_dir) if e["kind"] == "checkpoint_skipped"]
    assert skipped and f"{shard} has 100 bytes" in skipped[0]["reason"]


def test_async_saves_commit_and_keep_last_k(tiny_data, tmp_path):
    run_dir = str(tmp_path / "run")
    raw = config(tiny_data, dp_replicate=2)
    raw["checkpoint"] = {"every_steps": 2, "keep": 2, "async_save": True}
    run_fit(raw, 2, run_dir)
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["step_00000008", "step_00000010"]
    committed = [e["step"] for e in events(run_dir) if e["kind"] == "checkpoint"]
    assert committed[-1] == 10 and committed == sorted(set(committed))


def test_a_run_resumed_at_its_last_step_reports_its_final_loss(tiny_data, tmp_path):
    """A worker that dies after the last checkpoint was saved, before the run's report: the restart resumes at
    the last step and trains nothing; its summary still carries the run's final loss (the checkpoint's notes),
    not None (a clean-clone CI run saw None in tests/ray/test_elastic.py)."""
    raw = tiny_config(tiny_data, train={"steps": 4, "log_every": 2}, checkpoint={"every_steps": 2, "async_save": False})
    run_dir = str(tmp_path / "run")
    [first] = run_fit(raw, 1, run_dir)
    [again] = run_fit(raw, 1, run_dir)
    assert first.summary["final_loss"] is not None
    assert again.summary["steps"] == 4 and again.summary["final_loss"] == first.summary["final_loss"]
