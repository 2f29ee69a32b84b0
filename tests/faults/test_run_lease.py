"""One driver per run: RUN_DIR/lease.json. A second `raydist train` on a live run fails before Ray starts;
a stale lease is taken over; starters racing for one run directory end with exactly one holder; the
lease is released when the run ends, also when it fails."""

import json
import os
import threading
import time

import pytest

import faults_fs
from fault_runs import files_under
from raydist.checkpoint.lease import RunBusyError, RunLease, format_time
from raydist.parallel.runtime import start_method_context
from workers import patience

OBJFILE = faults_fs.ObjFileSystem.protocol[0]  # object-store semantics on local files (registered by the import)


def _race(run_dirs: list[str], ready, starts, results) -> None:
    """In a spawned process, for each run directory in turn: say it is ready, wait for that round's start
    signal, try to take the lease, report. (A lease taken is never released: the winner keeps it.)"""
    for run_dir, start in zip(run_dirs, starts):
        ready.release()
        start.wait()
        try:
            lease = RunLease(run_dir, "race", log=lambda *_: None).acquire()
            results.put(("won", os.getpid(), lease.run_id))
        except RunBusyError as exc:
            results.put(("busy", os.getpid(), str(exc)))


@pytest.mark.parametrize("stale", [False, True], ids=["fresh", "stale-lease"])
def test_concurrent_starters_local_exactly_one_wins(tmp_path, stale):
    """Three rounds, each a new run directory raced for by the same 4 processes (spawned and imported once),
    all of them waiting for the round's signal when it is given. The processes are forks of raydist's fork server
    (torch and raydist imported once, as `spawn`'s ranks are), not spawned interpreters that import them each:
    2.3 s of CPU a process."""
    ctx = start_method_context()
    rounds = 3
    run_dirs = [str(tmp_path / f"run{round_}") for round_ in range(rounds)]
    if stale:
        for run_dir in run_dirs:
            os.makedirs(run_dir)
            old = {"pid": 1, "host": "gone", "since": 0.0, "heartbeat": time.time() - 3600, "run_id": "old"}
            json.dump(old, open(os.path.join(run_dir, "lease.json"), "w"))
    ready, starts, results = ctx.Semaphore(0), [ctx.Event() for _ in run_dirs], ctx.Queue()
    procs = [ctx.Process(target=_race, args=(run_dirs, ready, starts, results)) for _ in range(4)]
    for p in procs:
        p.start()
    try:
        for run_dir, start in zip(run_dirs, starts):
            for _ in procs:  # every process is waiting for this round's signal
                assert ready.acquire(timeout=patience(60)), "a starter never got ready"
            start.set()
            outcomes = [results.get(timeout=patience(60)) for _ in procs]
            winners = [o for o in outcomes if o[0] == "won"]
            assert len(winners) == 1, outcomes
            assert all("is already running" in o[2] for o in outcomes if o[0] == "busy")
            assert json.load(open(os.path.join(run_dir, "lease.json")))["run_id"] == winners[0][2]
    finally:
        for start in starts:  # (after a failed round: the processes run the rest and end)
            start.set()
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def test_concurrent_starters_object_store_exactly_one_wins(tmp_path):
    """Object stores: write, wait settle_s, read back; the last writer holds it, the others see it."""
    run_dir = f"{OBJFILE}://host{tmp_path}/run"
    barrier = threading.Barrier(3)
    outcomes = []

    def starter():
        lease = RunLease(run_dir, "race", settle_s=0.3, log=lambda *_: None)
        barrier.wait()
        try:
            lease.acquire()
            outcomes.append(("won", lease.run_id))
        except RunBusyError as exc:
            outcomes.append(("busy", str(exc)))

    threads = [threading.Thread(target=starter) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [o for o in outcomes if o[0] == "won"]
    assert len(winners) == 1, outcomes
    assert json.load(open(tmp_path / "run" / "lease.json"))["run_id"] == winners[0][1]


def test_stale_lease_is_taken_over_with_a_warning(tmp_path):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    old = {"pid": 4242, "host": "crashed-host", "since": 1.0, "heartbeat": time.time() - 100, "run_id": "old"}
    json.dump(old, open(os.path.join(run_dir, "lease.json"), "w"))
    lines = []
    with RunLease(run_dir, "r", interval_s=10, log=lines.append) as lease:
        assert json.load(open(os.path.join(run_dir, "lease.json")))["run_id"] == lease.run_id
    assert len(lines) == 1 and lines[0].startswith("warning: run r: taking over a stale lease (pid 4242 on "
                                                   "crashed-host, last heartbeat 100s ago, the limit is 30s)")
    assert not os.path.exists(os.path.join(run_dir, "lease.json"))  # released


def test_heartbeat_renews_and_notices_a_takeover(tmp_path):
    run_dir = str(tmp_path / "run")
    lines = []
    with RunLease(run_dir, "r", interval_s=0.1, log=lines.append) as lease:
        first = json.load(open(os.path.join(run_dir, "lease.json")))
        time.sleep(0.5)
        renewed = json.load(open(os.path.join(run_dir, "lease.json")))
        assert renewed["heartbeat"] > first["heartbeat"] and renewed["since"] == first["since"]
        assert {k for k in renewed} == {"pid", "host", "since", "heartbeat", "run_id"}
        json.dump({**renewed, "run_id": "someone-else", "pid": 7}, open(os.path.join(run_dir, "lease.json"), "w"))
        time.sleep(0.5)
        assert not lease.held
    assert any("lost its lease (now held by pid 7" in line for line in lines)
    assert json.load(open(os.path.join(run_dir, "lease.json")))["run_id"] == "someone-else"  # not ours to delete


def _cli_config(tiny_data, tmp_path) -> list[str]:
    return ["--set", f"data.path={tiny_data}", "--set", "data.seq_len=32", "--set", "train.run_name=busy",
            "--set", f"checkpoint.storage={tmp_path}/runs"]


def test_cli_refuses_a_live_run(tiny_data, tmp_path, capsys, no_ray):
    from raydist.cli import main

    run_dir = tmp_path / "runs" / "busy"
    run_dir.mkdir(parents=True)
    since = time.time() - 60
    lease = {"pid": 31337, "host": "trainer-7", "since": since, "heartbeat": time.time() - 1, "run_id": "live"}
    (run_dir / "lease.json").write_text(json.dumps(lease))
    before = files_under(run_dir)
    assert main(["train", *_cli_config(tiny_data, tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: run busy is already running (pid 31337 on trainer-7 since {format_time(since)}); "
                   "pick another train.run_name"]
    assert files_under(run_dir) == before  # nothing written, no Ray (no_ray), no worker


def test_lease_is_released_when_the_run_fails(tiny_data, tmp_path, launch_without_ray, monkeypatch):
    from raydist.config import Config
    from raydist.driver.launcher import launch

    launch_without_ray["fail"] = RuntimeError("the workers died")
    cfg = Config.load(None, [a for a in _cli_config(tiny_data, tmp_path) if a != "--set"])
    held = []
    acquire = RunLease.acquire
    monkeypatch.setattr(RunLease, "acquire", lambda self: held.append(self.uri) or acquire(self))
    with pytest.raises(RuntimeError, match="the workers died"):
        launch(cfg, log=lambda *_: None)
    assert held == [f"{tmp_path}/runs/busy/lease.json"] and launch_without_ray["trainers"] == 1
    assert not os.path.exists(held[0])
