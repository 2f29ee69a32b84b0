"""Hang diagnosis that cannot hang itself (raydist.elastic.hang, raydist.elastic.bounded_store): stores that block
forever (a TCPStore client whose server, inside rank 0, is SIGSTOPped), raise, or answer; the view each rank keeps
of every rank's record; missed beats that an outage explains; the stuck collective named by sequence
number; the idle worker's control channel. No Ray, no process group: fake stores and fixed records."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from raydist import strict

from raydist.elastic.bounded_store import BoundedStore, StoreUnreachable
from raydist.elastic.control import ControlChannel
from raydist.elastic.hang import trigger
from raydist.elastic.hang.diagnosis import HangMonitor
from raydist.elastic.inflight import poll_s, register_flight_source, unregister_flight_source
from raydist.parallel.runtime import free_port

BOUND_S = 60  # the bound from a stop to the hang event: a diagnosis must end well within it


class BlockingStore:
    """Every call blocks until `release` is set: what a TCPStore client does while its server is stopped."""

    def __init__(self):
        self.release = threading.Event()
        self.calls: list[str] = []

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append(name)
            self.release.wait()
            raise ConnectionError(f"{name}: the server went away")

        return call


class RefusingStore:
    """Every call fails at once: rank 0's process is dead, its port closed."""

    def __getattr__(self, name):
        def call(*args, **kwargs):
            raise ConnectionError("Connection refused")

        return call


class DictStore:
    """An answering store (the TCPStore calls raydist makes)."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def add(self, key, amount):
        self.data[key] = str(int(self.data.get(key, b"0")) + amount).encode()
        return int(self.data[key])

    def multi_get(self, keys):
        return [self.data[k] for k in keys]


@pytest.fixture
def blocking():
    store = BlockingStore()
    yield store
    store.release.set()  # ends the stuck call threads


def rec(rank, step=13, action="all_reduce (group 0)", beat=None, pid=None, **extra):
    beat = time.time() if beat is None else beat
    return {"rank": rank, "host": "h", "pid": pid or 100 + rank, "step": step, "action": action, "since": beat - 1,
            "beat": beat, **extra}


def bounded(fn, *args, **kwargs):
    """fn(*args) in a thread; the test fails (instead of hanging) if it does not return within BOUND_S."""
    box = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} did not return within {BOUND_S}s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


# ---- the bounded store ----------------------------------------------------------------------------


def test_a_store_call_that_never_returns_raises_and_later_calls_fail_without_queueing(blocking):
    store = BoundedStore(blocking, timeout_s=0.2)
    with pytest.raises(StoreUnreachable):
        bounded(store.check, ["k"])
    assert not store.reachable and store.down_since is not None
    with pytest.raises(StoreUnreachable, match="has not answered"):
        bounded(store.get, "k")
    assert blocking.calls == ["check"]  # the second call never reached the stuck client


def test_a_store_that_answers_again_ends_the_outage():
    inner = DictStore()
    gate = threading.Event()

    class Slow(DictStore):
        def check(self, keys):
            gate.wait()
            return inner.check(keys)

    store = BoundedStore(Slow(), timeout_s=0.1)
    with pytest.raises(StoreUnreachable):
        store.check(["k"])
    gate.set()  # the server is continued: the stuck call returns
    for _ in range(100):
        try:
            assert store.check(["k"]) is False
            break
        except StoreUnreachable:
            time.sleep(0.05)
    assert store.reachable and len(store.outages) == 1
    start, end = store.outages[0]
    assert start <= end


def test_a_wait_that_times_out_is_an_answer_not_an_outage():
    class Waits(DictStore):
        def wait(self, keys, timeout):
            raise RuntimeError("Socket Timeout")

    store = BoundedStore(Waits(), timeout_s=1.0)
    with pytest.raises(RuntimeError, match="Timeout"):
        store.wait(["k"], datetime.timedelta(seconds=0.01))
    assert store.reachable


# ---- the diagnosis: bounded, and what it names -----------------------------------------------------


def monitor(rank, world, store, tmp_path, **kw):
    kw.setdefault("stacks", False)
    return HangMonitor(rank, world, str(tmp_path), interval_s=1.0, store=store, **kw)


@pytest.mark.parametrize("kind", ["blocks", "refuses"])
def test_a_diagnosis_without_the_store_ends_and_names_rank_0_with_its_pid_from_the_view(kind, blocking, tmp_path):
    """Rank 1's collective timed out; rank 0, the store's host, is stopped (the store blocks forever) or
    dead (it refuses): rank 1 names rank 0 with the pid it read earlier, and writes the hang event."""
    events = []
    store = blocking if kind == "blocks" else RefusingStore()
    m = monitor(1, 2, BoundedStore(store, timeout_s=0.3), tmp_path, on_hang=events.append, budget_s=10.0)
    m.view[0] = rec(0, step=12, action="forward/backward", pid=4242)  # from its periodic reads
    error = RuntimeError("[Gloo] Timed out waiting 10000ms for recv operation to complete")
    diagnosis = bounded(m.diagnose, "collective timeout", error)
    assert diagnosis is not None and events == [diagnosis]
    [culprit] = diagnosis["culprits"]
    assert (culprit["rank"], culprit["pid"], culprit["host"]) == (0, 4242, "h") and "seen_s_ago" in culprit
    assert "store in its process did not answer" in culprit["reason"] and culprit["silent"]
    assert [w["rank"] for w in diagnosis["waiting"]] == [1]
    assert diagnosis["store_reachable"] is False
    assert json.load(open(tmp_path / diagnosis["stacks"].rsplit("/", 2)[-2] / diagnosis["stacks"].rsplit("/", 1)[-1]
                          / "ranks.json"))["culprits"][0]["pid"] == 4242


def test_the_whole_diagnosis_has_a_deadline_even_if_a_step_inside_hangs(blocking, tmp_path, monkeypatch):
    """Whatever blocks inside (here: writing the stacks' directory), diagnose returns at its budget and
    still leaves a `hang` event saying it did not finish."""
    events = []
    m = monitor(1, 2, BoundedStore(blocking, timeout_s=0.2), tmp_path, on_hang=events.append, budget_s=1.0)
    never = threading.Event()
    monkeypatch.setattr("raydist.elastic.hang.diagnosis.write_file", lambda *a, **k: never.wait())
    m.on_hang = lambda d: (events.append(d), never.wait()) if "incomplete" not in d else events.append(d)
    assert bounded(m.diagnose, "watchdog: no progress") is None
    assert "did not finish" in events[-1]["incomplete"]
    never.set()


def test_the_ranks_that_wait_for_another_ranks_diagnosis_stop_waiting_when_the_store_stops_answering(tmp_path):
    inner = DictStore()
    inner.add("raydist/hang/claim", 1)  # another rank claimed the diagnosis
    store = BoundedStore(inner, timeout_s=0.3)
    m = monitor(1, 2, store, tmp_path)
    inner.check = lambda keys: threading.Event().wait()  # then the store stopped answering
    assert bounded(m.diagnose, "collective timeout") is None


def test_missed_beats_during_a_store_outage_are_not_blamed(tmp_path):
    """Rank 0 (the store's host) was stopped for 148 s and resumed: rank 1 could not beat meanwhile. The
    diagnosis rank 0 makes names itself (its monitor saw it did not run), not rank 1."""
    now = time.time()
    m = monitor(0, 2, DictStore(), tmp_path, collective_timeout_s=20)
    m.frozen = (now - 150, now - 2)
    records = {0: rec(0, beat=now), 1: rec(1, beat=now - 149)}
    [culprit] = m.culprits(records, now, waiting_rank=0)
    assert culprit["rank"] == 0 and "did not run for 148s" in culprit["reason"]
    # without the freeze the same stale beat is the culprit (a stopped rank 1)
    m.frozen = None
    [culprit] = m.culprits(records, now, waiting_rank=0)
    assert culprit["rank"] == 1 and culprit["reason"].startswith("no heartbeat for 149s")
    # a non-host rank that saw the store down: the other ranks' stale beats are not evidence either
    m3 = monitor(1, 3, DictStore(), tmp_path)
    m3.store.outages = [(now - 60, now - 1)]
    records = {1: rec(1, beat=now), 2: rec(2, beat=now - 58)}
    assert m3.culprits({**records, 0: rec(0, beat=now)}, now) == []


STOPPED = """
import datetime, sys, time
import torch.distributed as dist
from raydist import strict
from raydist.elastic.hang import diagnosis, heartbeat
heartbeat.STALE_MIN_S = 1.0
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=datetime.timedelta(seconds=5))
diagnosis.HangMonitor(1, 2, sys.argv[2], interval_s=0.2, store=store, stacks=False).start()
print("ready", flush=True)
time.sleep(60)
"""


def test_a_monitor_notices_its_own_process_was_stopped_and_says_so_in_its_record(tmp_path):
    """SIGSTOP for 3 s: once continued, the rank's record says when it did not run (what lets a diagnosis
    after a stop name the stopped process instead of the ranks that could not beat meanwhile)."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=5),
                          wait_for_workers=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, "-c", STOPPED, str(port), str(tmp_path)], stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        assert child.stdout.readline() == "ready\n"
        time.sleep(0.5)
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(3.0)
        os.kill(child.pid, signal.SIGCONT)
        record = None
        for _ in range(100):
            record = json.loads(store.get("raydist/hang/rank/1"))
            if "frozen" in record:
                break
            time.sleep(0.1)
        start, end = record["frozen"]
        assert 2.0 < end - start < 30.0 and end <= record["beat"]
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait()


def test_a_beat_stale_long_after_an_outage_is_blamed(tmp_path):
    now = time.time()
    m = monitor(0, 2, DictStore(), tmp_path)
    m.store.outages = [(now - 300, now - 200)]  # long over: rank 1 has had time to beat since
    [culprit] = m.culprits({0: rec(0, beat=now), 1: rec(1, beat=now - 250)}, now)
    assert culprit["rank"] == 1


def inflight(group, seq, op="all_reduce", since=None, ranks=(0, 1, 2), issued=None, p2p=False, peers=None):
    head = {"seq": seq, "op": op, "state": "queued", "since": since if since is not None else time.time() - 30,
            "p2p": p2p, "peers": peers}
    return {group: {"ranks": list(ranks), "pending": 1, "head": head, "issued": issued or seq}}


def test_the_rank_that_never_issued_the_stuck_collective_is_named_with_op_group_and_sequence_number(tmp_path):
    """NCCL: everyone beats, the hosts ran ahead (their actions say nothing useful); rank 0 and rank 2 wait
    in all_reduce #7 of group 3, rank 1's communicators show it never issued #7 there."""
    now = time.time()
    stuck = {"group": "3", "ranks": [0, 1, 2], "seq": 7, "op": "all_reduce", "state": "queued", "since": now - 30,
             "p2p": False, "peers": None}
    records = {0: rec(0, action="forward/backward", inflight=inflight("3", 7, since=now - 30)),
               1: rec(1, action="forward/backward", inflight={"3": {"ranks": [0, 1, 2], "pending": 0, "head": None,
                                                                    "issued": 6}}),
               2: rec(2, action="optimizer", inflight=inflight("3", 7, since=now - 29))}
    m = monitor(0, 3, DictStore(), tmp_path, flight=True)
    [culprit] = m.culprits(records, now, waiting_rank=0, stuck=stuck)
    assert (culprit["rank"], culprit["pid"]) == (1, 101)
    assert "has not issued all_reduce #7 on group 3 (its last there: #6)" in culprit["reason"]
    # a rank waiting in another group's collective is named, and where it waits is said
    records[1] = rec(1, inflight=inflight("5", 12, op="all_gather", since=now - 40, ranks=(1, 2)))
    [culprit] = m.culprits(records, now, waiting_rank=0, stuck=stuck)
    assert culprit["rank"] == 1 and "it waits in all_gather #12 on group 5 since 40s" in culprit["reason"]
    # everyone issued it: nobody is named on that evidence (the places then decide: all in one place)
    records[1] = rec(1, action="all_reduce (group 0)", inflight=inflight("3", 7, since=now - 30))
    records[0]["action"] = records[2]["action"] = "all_reduce (group 0)"
    assert m.culprits(records, now, waiting_rank=0, stuck=stuck) == []
    # a record published before the collective was issued tells nothing
    records[1] = rec(1, beat=now - 31, action="all_reduce (group 0)", inflight={})
    m.interval_s = 20.0  # (so that a 31 s old beat is not stale)
    assert m.culprits(records, now, waiting_rank=0, stuck=stuck) == []


def test_a_stuck_p2p_exchange_names_the_peer_that_is_in_no_exchange_of_that_group(tmp_path):
    now = time.time()
    stuck = {"group": "pp", "ranks": [0, 1, 2, 3], "seq": 41, "op": "batch[send 0->1, recv 0<-1]", "state": "queued",
             "since": now - 30, "p2p": True, "peers": [1]}
    records = {0: rec(0, inflight=inflight("pp", 41, since=now - 30, p2p=True, peers=[1])),
               1: rec(1, action="F mb3 stage1", inflight={}),
               2: rec(2, action="F mb4 stage2", inflight={}),  # not its peer: not named
               3: rec(3, inflight=inflight("pp", 9, p2p=True, peers=[2]))}
    m = monitor(0, 4, DictStore(), tmp_path, flight=True)
    [culprit] = m.culprits(records, now, waiting_rank=0, stuck=stuck)
    assert culprit["rank"] == 1 and "batch[send 0->1, recv 0<-1] #41 on group pp" in culprit["reason"]


# ---- the monitor watches its own in-flight collectives ----------------------------------------------


def test_the_monitor_fires_once_for_an_op_pending_longer_than_the_collective_timeout(tmp_path):
    now = time.time()
    ops = [{"group": "0", "ranks": [0, 1], "seq": 5, "op": "all_reduce", "state": "started", "since": now - 3},
           {"group": "2", "ranks": [0, 1], "seq": 9, "op": "batch[isend->1, irecv<-1]", "state": "queued",
            "since": now - 30, "p2p": True, "peers": [1]}]
    register_flight_source("fake", lambda: ops)
    fired = []
    done = threading.Event()
    try:
        m = HangMonitor(0, 2, str(tmp_path), interval_s=0.05, store=DictStore(), stacks=False, flight=True,
                        collective_timeout_s=10.0, on_stuck=lambda op: (fired.append(op), done.set()))
        assert m.poll_flight(now=now) == {**ops[1], "source": "fake"}
        assert m.poll_flight(now=now - 25) is None  # nothing has waited 10 s yet
        published = m.record()["inflight"]
        assert published["0"]["head"]["seq"] == 5 and published["2"]["head"]["op"] == "batch[isend->1, irecv<-1]"
        assert published["2"]["issued"] == 9
        assert trigger.group_timeout_s(10.0, "nccl") == 10.0  # no monitor watches yet: NCCL's own timeout
        m.start()
        assert trigger.group_timeout_s(10.0, "nccl") > 10.0 + trigger.DIAGNOSE_BUDGET_S  # groups made from now on
        assert done.wait(BOUND_S)
        time.sleep(0.3)  # more beats: still once
        m.stop()
        assert trigger.group_timeout_s(10.0, "nccl") == 10.0
        assert [op["seq"] for op in fired] == [9]
        beat = json.loads(m.store.store.data["raydist/hang/rank/0"])
        assert beat["inflight"]["2"]["head"]["seq"] == 9
    finally:
        unregister_flight_source("fake")


def test_without_a_flight_source_nothing_is_published_or_fired(tmp_path):
    m = monitor(0, 2, DictStore(), tmp_path)
    assert "inflight" not in m.record()
    assert m.poll_flight() is None  # no collective timeout given: never stuck


def test_group_timeouts_come_after_detection_and_the_diagnosis():
    for timeout_s in (10.0, 20.0, 300.0, 1800.0):
        detected_by = timeout_s + poll_s(timeout_s, 2.0) + 2.0
        for backend in ("nccl", "cpu:gloo,cuda:nccl", strict.BACKEND):  # they abort the process: watched
            later = trigger.group_timeout_s(timeout_s, backend, 2.0, monitored=True)
            assert later >= detected_by + trigger.DIAGNOSE_BUDGET_S + 5
            assert trigger.group_timeout_s(timeout_s, backend, 2.0, monitored=False) == timeout_s  # no monitor
        assert trigger.group_timeout_s(timeout_s, "gloo", 2.0, monitored=True) == timeout_s  # gloo raises


def test_ray_trains_process_group_gets_the_later_timeout_and_the_recorder_env_on_nccl(monkeypatch):
    from raydist.config import Config
    from raydist.elastic.torch_backend import torch_config

    monkeypatch.delenv(strict.ENV, raising=False)
    cfg = Config.load(None, ["elastic.collective_timeout_s=20", "monitor.heartbeat_interval_s=2"])
    gpu = torch_config(cfg, use_gpu=True)
    assert gpu.backend == "nccl"
    assert gpu.timeout_s >= trigger.group_timeout_s(20, "nccl", 2.0, monitored=True) > 20 + trigger.DIAGNOSE_BUDGET_S
    assert int(gpu.worker_env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    cpu = torch_config(cfg, use_gpu=False)
    assert (cpu.backend, cpu.timeout_s, cpu.worker_env) == ("gloo", 20, {})
    monkeypatch.setenv(strict.ENV, "1")  # the launcher makes it the strict backend, which aborts like NCCL
    assert (torch_config(cfg, use_gpu=False).timeout_s
            >= trigger.group_timeout_s(20, strict.BACKEND, 2.0, monitored=True))


def test_an_idle_worker_does_not_hang_on_a_stopped_rank_0(blocking):
    """Idle workers follow rank 0's messages through the store that lives in rank 0: stopped, it must end
    in an error (a restart), not a worker blocked forever."""
    channel = ControlChannel(blocking, rank=1)
    channel.bounded = BoundedStore(blocking, timeout_s=0.2)
    with pytest.raises(RuntimeError, match="no heartbeat from rank 0"):
        bounded(channel.follow, lambda m: None, timeout_s=1.0, poll_s=0.1)
