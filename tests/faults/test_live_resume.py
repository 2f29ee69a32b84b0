"""Live recovery's durable checkpoints on a real local Ray cluster (gloo): two replicas of two workers each
(dp_replicate 2 x dp_shard 2, FSDP inside), every worker killed at once mid-run. No replica survives to heal
the others, so Ray Train restarts the whole group and every worker resumes from the newest committed
checkpoint on storage, as a run without live recovery would: one restart, the steps since that checkpoint
redone, and every step's samples, before and after, those of the uninterrupted run.

Losses: each redone step's loss is the one the killed workers logged for that step (1e-6 relative: the same
layout, quorum, samples and reduction order, so the resume restored everything the step depends on). The
reference is one process, whose gradient sums run in another order than FSDP's reduce-scatter and the
replicas' all-reduce: fp32 rounding of order 1e-7 that AdamW grows through training (3e-3 by step 65 in
test_live_recovery), so a step's loss equals the reference's to 1e-4 only over the first EXACT_STEPS steps,
and the final loss to 2%; an uninterrupted reference in the live layout would take a second Ray run."""

from __future__ import annotations

import os
import signal

import pytest

from raydist.testing import run_fit
from ray_runs import Background, jsonl, ray_4cpu, wait_for  # noqa: F401  (ray_4cpu: a fixture)
from test_live_recovery import EXACT_STEPS, committed_steps, small

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(400)]  # 50-80 s here, the default 180 s is tight on CI


def test_a_live_run_whose_every_worker_dies_resumes_from_its_durable_checkpoint(ray_4cpu, tiny_data, tmp_path):
    steps, batch, shard = 40, 8, 2  # the kill at step 24 or later, the resume from step 20 (60 until 2026-11-30)
    cfg = small(tiny_data, tmp_path, f"train.steps={steps}", "train.run_name=live", "ray.num_workers=4",
                "parallel.dp_replicate=2", f"parallel.dp_shard={shard}", "elastic.live_recovery=true",
                "elastic.max_failures=3", "elastic.collective_timeout_s=30", "ray.cpus_per_worker=0.5")
    reference_cfg = small(tiny_data, tmp_path, f"train.steps={steps}", "ray.num_workers=1", "parallel.dp_replicate=1")
    [reference] = run_fit(reference_cfg.to_dict(), 1, str(tmp_path / "reference"))
    run_dir = tmp_path / "live"
    job = Background(cfg, record_samples=True)
    # past the first durable checkpoint (every 10 steps)
    wait_for(lambda: any(r["step"] >= 24 for r in jsonl(run_dir / "metrics.jsonl")), 300, "step 24")
    first = {e["pid"] for e in jsonl(run_dir / "events.jsonl") if e["kind"] == "launch"}
    assert len(first) == 4, first
    for pid in first:
        os.kill(pid, signal.SIGKILL)
    summary = job.join(600)
    assert job.error is None, job.error
    assert summary["steps"] == steps and summary["restarts"] == 1, summary

    events = jsonl(run_dir / "events.jsonl")
    [restart] = [e for e in events if e["kind"] == "restart"]
    resumed = restart["resumed_step"]
    assert resumed >= 20 and resumed % 10 == 0, restart
    assert summary["steps_redone"] == restart["steps_to_redo"] > 0, (summary, restart)
    relaunched = {e["pid"] for e in events if e["kind"] == "launch"} - first
    assert len(relaunched) == 4, relaunched
    assert (run_dir / "checkpoints" / f"step_{steps:08d}" / "COMMIT.json").exists()
    assert abs(summary["final_loss"] - reference.losses[-1]) / reference.losses[-1] < 0.02

    # Per step, the loss of the attempt that counts (the first up to the checkpoint, the second after it)
    metrics = jsonl(run_dir / "metrics.jsonl")
    before = {r["step"]: r["loss"] for r in metrics if r.get("replicas") and r["attempt"] == 1}
    after = {r["step"]: r["loss"] for r in metrics if r.get("replicas") and r["attempt"] == 2}
    assert sorted(after) == list(range(resumed + 1, steps + 1)), sorted(after)
    assert set(range(1, resumed + 1)) <= set(before), sorted(before)
    # the steps the killed workers logged past the checkpoint, redone by the new ones with the same losses
    redone = sorted(s for s in before if s > resumed)
    assert redone, sorted(before)
    worst_redone = max(abs(after[s] - before[s]) / before[s] for s in redone)
    losses = {**{s: before[s] for s in range(1, resumed + 1)}, **after}
    worst = max(abs(losses[s] - reference.losses[s - 1]) / reference.losses[s - 1] for s in range(1, EXACT_STEPS + 1))
    print(f"\nlive resume from step {resumed}: redone steps {redone[0]}-{redone[-1]} differ from the first "
          f"attempt's by {worst_redone:.1e}; steps 1-{EXACT_STEPS} from the reference by {worst:.1e}")
    assert worst_redone <= 1e-6, [(s, before[s], after[s]) for s in redone]
    assert worst <= 1e-4, worst

    # Every step up to the checkpoint was trained by the first workers and every later one by the new ones
    # (the first workers' steps after the checkpoint were lost with them and redone), each on exactly the
    # uninterrupted run's samples of that step: the resume restored the data position with the weights.
    by_step = committed_steps(run_dir)
    for step in range(1, steps + 1):
        pids = first if step <= resumed else relaunched
        ids = [i for r in by_step[step] if r["pid"] in pids for i in r["ids"]]
        assert sorted(ids) == sorted(int(i) for i in reference.sample_ids[step - 1]), step
        assert {r["quorum"][1] for r in by_step[step] if r["pid"] in pids} == {2}, step  # both replicas
    lost = [s for s, records in by_step.items() if s > resumed and any(r["pid"] in first for r in records)]
    assert lost and max(lost) >= 24, lost  # the first workers had trained past the checkpoint: those were redone
