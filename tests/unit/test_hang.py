"""Hang diagnosis without Ray (raydist.elastic.hang): the action record, which ranks are named, and a diagnosis that
writes py-spy stacks of the live ranks and of a stopped one."""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from raydist.elastic.hang.diagnosis import HangMonitor
from raydist.elastic.hang.trigger import is_hang
from raydist.elastic.stacks import py_spy
from raydist.metrics.actions import ACTIONS, Actions, doing
from raydist.parallel.runtime import free_port


def test_the_action_record_nests_and_stays_where_a_failure_happened():
    actions = Actions()
    actions.step = 7
    with actions.doing("forward/backward"):
        with actions.doing(("all_reduce", "(group 3)")):
            assert actions.describe() == "all_reduce (group 3)"
        assert actions.describe() == "forward/backward"
    with pytest.raises(RuntimeError):
        with actions.doing("clip: gradient norm"):
            raise RuntimeError("Timed out waiting 20000ms for recv operation to complete")
    assert actions.record()["action"] == "clip: gradient norm" and actions.record()["step"] == 7
    assert is_hang(RuntimeError("[Gloo] Timed out waiting 20000ms for recv"))
    assert not is_hang(RuntimeError("Connection reset by peer"))


def monitor(rank, world, store, tmp_path, **kw):
    return HangMonitor(rank, world, str(tmp_path), interval_s=1.0, store=store, **kw)


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=datetime.timedelta(seconds=5),
                         wait_for_workers=False)


def rec(rank, step, action, beat, since=None):
    return {"rank": rank, "host": "h", "pid": 100 + rank, "step": step, "action": action, "beat": beat,
            "since": since if since is not None else beat - 1}


def test_culprits_are_silent_ranks_else_ranks_somewhere_else(store, tmp_path):
    m = monitor(0, 4, store, tmp_path)
    now = time.time()
    waiting = {r: rec(r, 13, "all_reduce (group 1)", now) for r in range(4)}
    # a rank whose heartbeat stopped (SIGSTOP) is the culprit, whatever its last action
    silent = {**waiting, 2: rec(2, 13, "forward/backward", now - 30)}
    [c] = m.culprits(silent, now)
    assert (c["rank"], c["pid"]) == (2, 102) and c["reason"].startswith("no heartbeat for 30s")
    # all beating: the rank stuck elsewhere (still reading its data) never arrived
    late = {**waiting, 3: rec(3, 13, "data: next batch", now, since=now - 25)}
    [c] = m.culprits(late, now)
    assert c["rank"] == 3 and c["for_s"] == 25.0 and "data: next batch" in c["reason"]
    # two ranks: the one whose collective timed out says where the others should be
    pair = {0: rec(0, 13, "all_reduce (group 1)", now), 1: rec(1, 13, "data: next batch", now)}
    assert [c["rank"] for c in monitor(0, 2, store, tmp_path).culprits(pair, now, waiting_rank=0)] == [1]
    # a rank that never published (or a store that does not answer) is named too
    assert [c["rank"] for c in m.culprits({r: waiting[r] for r in (0, 1, 2)}, now)] == [3]
    assert m.culprits(waiting, now) == []  # everyone waits in the same place: nobody to blame
    idle = {**waiting, 3: rec(3, None, "idle", now)}
    assert m.culprits(idle, now) == []


SLEEPER = "import time\nprint('ready', flush=True)\nwhile True:\n    time.sleep(0.05)\n"


def test_a_diagnosis_names_the_stopped_rank_and_writes_the_stacks(store, tmp_path):
    """Rank 1 is another process that published its record and was then stopped; rank 0 diagnoses."""
    assert py_spy() is not None, "py-spy is a dependency of raydist (pyproject.toml): pip install py-spy"
    victim = subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout.readline() == "ready\n"  # its interpreter is up before it is stopped
        host = socket.gethostname()
        store.set("raydist/hang/rank/1", json.dumps({"rank": 1, "host": host, "pid": victim.pid, "step": 13,
                                                     "action": "forward/backward", "since": time.time() - 40,
                                                     "beat": time.time() - 30}))
        os.kill(victim.pid, signal.SIGSTOP)
        events = []
        m = monitor(0, 2, store, tmp_path, on_hang=events.append)
        ACTIONS.step = 13
        try:
            with doing(("all_reduce", "(group 1)")):
                raise RuntimeError("Timed out waiting 20000ms for recv operation to complete")
        except RuntimeError as exc:
            diagnosis = m.diagnose("collective timeout", exc)
        assert events == [diagnosis]
        [culprit] = diagnosis["culprits"]
        assert (culprit["rank"], culprit["pid"], culprit["host"]) == (1, victim.pid, host)
        assert [w["rank"] for w in diagnosis["waiting"]] == [0]
        assert diagnosis["waiting"][0]["action"] == "all_reduce (group 1)"
        stacks = diagnosis["stacks"]
        assert stacks.startswith(str(tmp_path / "logs" / "hang-"))
        assert sorted(os.listdir(stacks)) == ["rank-0-error.txt", "rank-0.txt", "rank-1.txt", "ranks.json"]
        assert "py-spy dump" in open(os.path.join(stacks, "rank-0.txt")).read()
        stopped = open(os.path.join(stacks, "rank-1.txt")).read()
        assert "--nonblocking" in stopped and "<module>" in stopped  # a stopped process is read, not paused
        assert diagnosis["stacks_written"] == [0, 1]
        assert json.load(open(os.path.join(stacks, "ranks.json")))["culprits"][0]["rank"] == 1
        # a second rank seeing the same hang does not diagnose again
        assert monitor(1, 2, store, tmp_path).diagnose("collective timeout") is None
    finally:
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
