"""Live recovery on a real local Ray cluster (gloo): two replicas of two workers, with FSDP inside
(dp_replicate 2 x dp_shard 2) or TP inside (dp_replicate 2 x tp 2), one worker killed mid-run.
The surviving replica keeps stepping, Ray Train replaces only the dead worker's replica group (both its
workers), the replacement's ranks receive the live state from the survivor's same ranks, and the run
completes with no whole-group restart, no step redone, the uninterrupted run's loss and every one of its
samples trained exactly once. The survivor's longest gap between steps and the time to rejoin are printed
(recorded, not asserted: wall time on a shared machine)."""

from __future__ import annotations

import os
import signal
from collections import defaultdict

import pytest

from raydist.config import Config
from raydist.data.position import rank_slice
from raydist.elastic.live import live_slice
import ray_runs
from ray_runs import Background, Throttle, jsonl, wait_for
from raydist.testing import run_fit

# 20-45 s a case here; up to 266 s in clean-clone CI runs once (the tp case, before `Throttle`), too near 400 s for a
# run whose waits are bounded
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]
EXACT_STEPS = 30  # the steps whose losses must equal the uninterrupted run's to 1e-4 (see the test)
# The survivors are held back until the replacement joins (`Throttle`), so a run needs steps enough for the
# kill at step 12, the survivor's steps alone and the steps after the rejoin that show both replicas stepping
# together again: 60 with replicas of two workers (the kill came at step 12-13 here, 1-5 steps alone, 42-47 after
# the rejoin; one-worker replicas, which step about five times faster, needed 120).
STEPS = 60
ray_4cpu = ray_runs.ray_4cpu  # the Ray files' shared local cluster (a fixture)


def small(data: str, root, *extra) -> Config:
    return Config.load(None, [
        f"data.path={data}", "data.seq_len=32", "data.reader=arrow", "model.num_layers=2", "model.d_model=64",
        "model.ffn_hidden=128", "train.global_batch=8", "train.micro_batch=2", "train.eval_every=0",
        "train.log_every=1", "checkpoint.every_steps=10", "checkpoint.async_save=false",
        f"checkpoint.storage={root}", "ray.max_pending_s=60", *extra])


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    """`reference(steps)`: the uninterrupted run of that many steps, one process (no Ray), once per module."""
    runs = {}

    def run(steps: int):
        if steps not in runs:
            root = tmp_path_factory.mktemp("live-reference")
            cfg = small(tiny_data, root, f"train.steps={steps}", "ray.num_workers=1", "parallel.dp_replicate=1")
            [runs[steps]] = run_fit(cfg.to_dict(), 1, str(root / "reference"))
        return runs[steps]

    return run


def set_priority(pids: set[int], nice: int) -> None:
    """Every thread of these processes to `nice` (setpriority reaches one thread; a process gone is skipped, and
    a raise the user may not make is left undone)."""
    for pid in pids:
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in threads:
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            except OSError:
                pass


def committed_steps(run_dir) -> dict[int, list[dict]]:
    """Every worker's committed steps ({"step", "span", "replica_span", "quorum": [rank, size],
    "shard": [dp rank, dp], "ids", "pid"}), by step."""
    by_step: dict[int, list[dict]] = defaultdict(list)
    folder = os.path.join(run_dir, "samples")
    for name in os.listdir(folder):
        pid = int(name.removeprefix("replica-").removesuffix(".jsonl"))
        for rec in jsonl(os.path.join(folder, name)):
            by_step[rec["step"]].append({**rec, "pid": pid})
    return by_step


def assert_every_sample_trained_once(by_step: dict[int, list[dict]], reference_ids, batch: int, shard: int,
                                     victim_pids: set[int]):
    """Each step's quorum covered the uninterrupted run's global batch exactly once: every record's ids are
    the reference's ids at its span, its replica's span is the quorum's `live_slice` share for its rank,
    and its own span is its dp rank's equal part of that share. A worker of the killed replica may lack its
    record at the step right after its last recorded one (killed, by the kill or by Ray's replacement,
    between that step's commit and its line; the survivors' lines show its replica was in the quorum that
    committed the step)."""
    last = {pid: max(s for s, recs in by_step.items() for r in recs if r["pid"] == pid) for pid in victim_pids
            if any(r["pid"] == pid for recs in by_step.values() for r in recs)}
    dp_rank = {r["pid"]: r["shard"][0] for recs in by_step.values() for r in recs}
    assert sorted(by_step) == list(range(1, len(reference_ids) + 1))
    for step, want in enumerate(reference_ids, start=1):
        want, first = [int(i) for i in want], (step - 1) * batch
        records = by_step[step]
        [size] = {r["quorum"][1] for r in records}
        shares = {live_slice(first, batch, k, size, unit=shard): k for k in range(size)}
        parts = {rank_slice(a, b - a, j, shard): (a, b, j) for a, b in shares for j in range(shard)}
        recorded = [tuple(r["span"]) for r in records]
        assert len(set(recorded)) == len(recorded) and set(recorded) <= set(parts), (step, recorded, size)
        for r in records:
            assert shares[tuple(r["replica_span"])] == r["quorum"][0], (step, r)
            assert parts[tuple(r["span"])] == (*r["replica_span"], r["shard"][0]) and r["shard"][1] == shard, (step, r)
            assert sorted(r["ids"]) == sorted(want[r["span"][0] - first:r["span"][1] - first]), (step, r)
        missing = [parts[span] for span in set(parts) - set(recorded)]
        assert len({(a, b) for a, b, _ in missing}) <= 1, (step, missing)  # one replica's share at most
        for _, _, j in missing:
            assert any(dp_rank.get(pid) == j and last_step == step - 1 for pid, last_step in last.items()), \
                (step, missing, last)


# The leader (replica 0: the quorum's rank 0, which writes the run's bookkeeping and durable checkpoints)
# once ended in whole-group restarts: another local cluster's dashboard told Ray Train's placement-group
# cleaner that this run's controller was dead (raydist.driver.ray_cluster.embedded_dashboard), and a replica slow
# to start left the leader stepping alone, so its death took the only live state (TorchftReplicas.join).
# With FSDP inside (shard 2) the victim is the leader's first worker, which hosts its replica's TCP store and
# torchft ManagerServer; the follower replica steps alone meanwhile. With TP inside, a follower's second
# worker: no batch leader (its tp peer reads the rows), its shards of every matrix held by no one else in its
# replica; the leader steps alone. So the two cases span both roles and both layouts inside a replica.
# (Left out, for the suite's 2-core budget: an FSDP follower's death, a case of its own until 2026-11-30 (57-88 s
# of CPU; its handoff of FSDP shards is the leader case's, and tests/unit/test_live_replicas.py's fsdp case in
# one process per replica), and a one-worker replica's death, leader or follower (44 s; these cases with less
# inside, whose handoff tests/unit/test_live_replicas.py also covers).)
@pytest.mark.parametrize("inside, victim", [({"dp_shard": 2}, (0, 0)), ({"tp": 2}, (1, 1))],
                         ids=["fsdp-leader-rank0", "tp-follower-rank1"])
def test_a_killed_replica_is_replaced_live_and_the_run_completes(ray_4cpu, tiny_data, tmp_path, reference, inside,
                                                                 victim):
    batch = 8
    replica, rank = victim
    shard = inside.get("dp_shard", 1)  # a replica's dp ranks
    workers = shard * inside.get("tp", 1)  # a replica's workers
    steps = STEPS
    reference = reference(steps)
    cfg = small(tiny_data, tmp_path, f"train.steps={steps}", "train.run_name=live", f"ray.num_workers={2 * workers}",
                "parallel.dp_replicate=2", *[f"parallel.{k}={v}" for k, v in inside.items()],
                "elastic.live_recovery=true", "elastic.max_failures=3", "elastic.collective_timeout_s=30",
                f"ray.cpus_per_worker={1 / workers}")  # 4 workers fit the 4-CPU cluster beside the Lighthouse
    run_dir = tmp_path / "live"
    job = Background(cfg, record_samples=True)
    wait_for(lambda: any(r["step"] >= 12 for r in jsonl(run_dir / "metrics.jsonl")), 300, "step 12")
    # the whole group started together: every step so far ran on both replicas, so the victim's live
    # state also lives in the survivor
    before = [r["replicas"] for r in jsonl(run_dir / "metrics.jsonl") if r.get("replicas")]
    assert before and set(before) == {2}, before
    launches = [e for e in jsonl(run_dir / "events.jsonl") if e["kind"] == "launch"]
    assert sorted((e["replica"], e["replica_rank"]) for e in launches) == [(r, j) for r in (0, 1)
                                                                             for j in range(workers)]
    pid = next(e["pid"] for e in launches if (e["replica"], e["replica_rank"]) == victim)
    group = {e["pid"] for e in launches if e["replica"] == replica}
    os.kill(pid, signal.SIGKILL)
    # The replacement must start cold, build its Trainer and join before the survivors run out of steps: a
    # loaded CI run once finished 108 remaining steps first. The survivors' threads go to nice 19, so the
    # replacement (nice 0) gets a core, and once they have stepped alone they run a sixth of the time
    # (`Throttle`): they train on alone, at a pace the replacement's start outruns (what they compute is
    # unchanged). Held back from the kill, they once stepped alone only once before the rejoin.
    survivors = {e["pid"] for e in launches if e["replica"] != replica}
    set_priority(survivors, 19)

    def rejoined():
        return any(e["kind"] == "replica_joined" for e in jsonl(run_dir / "events.jsonl"))

    wait_for(lambda: not job.thread.is_alive() or rejoined()
             or any(r.get("replicas") == 1 for r in jsonl(run_dir / "metrics.jsonl")), 600, "a step alone")
    throttle = Throttle(survivors)
    # Once the replacement joined, both replicas step together and the slower paces every step: the survivors
    # run freely at nice 0 again, as the Ray tests run (under xdist a niced test beside them would otherwise
    # take half their CPU to the run's end, tests/workers.py). A run that ends first fails the checks below.
    try:
        wait_for(lambda: not job.thread.is_alive() or rejoined(), 600, "a rejoin")
    finally:
        throttle.stop()
    set_priority(survivors, 0)
    summary = job.join(600)
    assert job.error is None, job.error
    assert summary["steps"] == steps
    assert summary["restarts"] == 0 and summary["steps_redone"] == 0, summary
    events = jsonl(run_dir / "events.jsonl")
    lost = [e for e in events if e["kind"] == "replica_lost"]
    joined = [e for e in events if e["kind"] == "replica_joined"]
    assert [e["replica"] for e in lost] == [replica] and [e["replica"] for e in joined] == [replica], (lost, joined)
    assert summary["replicas_lost"] == 1 and summary["replica_time_out_s"] > 0
    assert not any(e["kind"] == "restart" for e in events)
    # durable checkpoints went on (written by the leader replica's workers): the last one is committed
    assert (run_dir / "checkpoints" / f"step_{steps:08d}" / "COMMIT.json").exists()
    # Ray Train replaced the victim's whole replica group (every one of its workers, each launched twice) and
    # nothing else; the replacement took the live state: it started after the kill and loaded no checkpoint
    relaunched = [e for e in events if e["kind"] == "launch"][len(launches):]
    assert sorted((e["replica"], e["replica_rank"]) for e in relaunched) == [(replica, j) for j in range(workers)]
    assert not {e["pid"] for e in relaunched} & group
    assert abs(summary["final_loss"] - reference.losses[-1]) / reference.losses[-1] < 0.02
    # Each step's loss is the uninterrupted run's up to summation order (only who computed which rows
    # changed): 1e-4 over the first EXACT_STEPS, which hold the kill, any step redone and survivor's steps
    # alone (asserted below). Later the reduction-order noise (1e-7 at first) grows through training,
    # smoothly and unrelated to the events (3e-3 by step 65 in one run), so the final loss is held to 2%.
    logged = {r["step"]: r["loss"] for r in jsonl(run_dir / "metrics.jsonl") if r.get("replicas")}
    # (a killed leader replica takes its last metrics lines still in its writer's queue with it)
    unlogged = sorted(set(range(1, steps + 1)) - set(logged))
    assert not unlogged or (replica == 0 and unlogged == list(range(unlogged[0], unlogged[-1] + 1))
                            and len(unlogged) <= 3), unlogged
    worst = max(abs(logged[s] - reference.losses[s - 1]) / reference.losses[s - 1] for s in logged if s <= EXACT_STEPS)
    # every sample of the uninterrupted run, step by step, trained exactly once (batch leaders record them)
    assert_every_sample_trained_once(committed_steps(run_dir), reference.sample_ids, batch, shard, group)
    metrics = [r for r in jsonl(run_dir / "metrics.jsonl") if r.get("replicas")]
    one_replica = [r["step"] for r in metrics if r["replicas"] == 1]
    assert one_replica and min(one_replica) <= EXACT_STEPS, one_replica  # the survivor stepped alone
    together = [r["step"] for r in metrics if r["replicas"] == 2 and r["step"] > max(one_replica)]
    assert together, one_replica  # and both replicas stepped together again after the rejoin
    times = [r["elapsed_s"] for r in sorted(metrics, key=lambda r: r["step"])]  # (an unlogged step: in its gap)
    gaps = [b - a for a, b in zip(times, times[1:])]
    print(f"\nlive recovery ({inside or 'one worker'} inside, replica {replica} rank {rank} killed): survivor's "
          f"longest step gap "
          f"{max(gaps):.2f}s (median {sorted(gaps)[len(gaps) // 2]:.3f}s), time to rejoin "
          f"{joined[0]['time_to_rejoin_s']:.2f}s, steps on one replica {len(one_replica)} (of {steps}; {len(together)} "
          f"together after the rejoin), "
          f"steps retried {summary.get('replica_steps_retried')}, largest loss difference over steps 1-{EXACT_STEPS} "
          f"{worst:.1e}")
    assert worst <= 1e-4, worst
