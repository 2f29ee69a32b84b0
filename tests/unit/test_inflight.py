"""In-flight collectives (raydist.elastic.inflight): torch's flight recorder read as its JSON dump says (a sample built
from FlightRecorderDetail.hpp's `dump_json` and ProcessGroupNCCL's names, and a real dump of gloo's recorder,
which shares the format), the strict mode's record adapted, the compact heartbeat view, and whether a rank
has arrived at a collective."""

from __future__ import annotations

import json
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist

from raydist.elastic import inflight
from raydist.parallel.runtime import spawn
from workers import patience

T0 = 1_795_000_000.0  # a wall-clock time, in seconds


def entry(record_id, pg_id, name, profiling_name, *, seq=0, p2p_seq=0, p2p=False, state="scheduled", at=0.0,
          retired=False):
    """One entry as FlightRecorder::dump_json writes it (torch 2.13, version "2.10")."""
    return {"record_id": record_id, "pg_id": pg_id, "process_group": [name, "desc"], "thread_name": "python",
            "thread_id": "1", "collective_seq_id": seq, "p2p_seq_id": p2p_seq, "op_id": record_id,
            "profiling_name": profiling_name, "time_created_ns": int((T0 + at) * 1e9), "input_sizes": [[4]],
            "input_dtypes": ["Float"], "output_sizes": [[4]], "output_dtypes": ["Float"], "state": state,
            "time_discovered_started_ns": 0, "time_discovered_completed_ns": 0, "retired": retired,
            "timeout_ms": 600000, "is_p2p": p2p}


NCCL_SAMPLE = {
    "version": "2.10", "comm_lib_version": "2.27.5",
    "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
                  "4": {"name": "4", "desc": "mesh_pp", "ranks": "[1, 3]"}},
    "pg_status": {"0": {"last_enqueued_collective": "8", "last_started_collective": "-1",
                        "last_completed_collective": "7"},
                  "4": {"last_enqueued_collective": "12", "last_started_collective": "-1",
                        "last_completed_collective": "11"}},
    "entries": [
        # left over from a completed batch: its "nccl:coalesced" entry is done, so absent from an onlyActive dump
        entry(10, 4, "4", "nccl:send 0->1", p2p_seq=11, p2p=True, at=-60),
        entry(11, 4, "4", "nccl:recv 0<-1", p2p_seq=11, p2p=True, at=-60),
        # a lone P2P entry: a send outside a batch, or the rest of a one-op batch (ambiguous: not reported)
        entry(14, 4, "4", "nccl:send 0->1", p2p_seq=12, p2p=True, at=-50),
        # the collective this rank waits in, and a later one queued behind it on the same stream
        entry(20, 0, "0", "nccl:all_reduce", seq=8, at=-30, state="started"),
        entry(21, 0, "0", "nccl:all_gather", seq=9, at=-29),
        # a pending batch on the pipeline group: its op entries and the "coalesced" one share p2p_seq_id 13
        entry(22, 4, "4", "nccl:send 0->1", p2p_seq=13, p2p=True, at=-20),
        entry(23, 4, "4", "nccl:recv 0<-1", p2p_seq=13, p2p=True, at=-20),
        entry(24, 4, "4", "nccl:coalesced", p2p_seq=13, p2p=True, at=-20),
        # completed (a dump without onlyActive has them)
        entry(25, 0, "0", "nccl:broadcast", seq=7, at=-40, state="completed", retired=True),
    ],
}


def test_nccls_recorder_reads_as_the_pending_ops_one_per_coalesced_group():
    ops = inflight.parse_recorder(NCCL_SAMPLE)
    assert [(o["group"], o["seq"], o["op"], o["state"], o["p2p"]) for o in ops] == [
        ("0", 8, "all_reduce", "started", False),
        ("0", 9, "all_gather", "queued", False),
        ("4", 13, "batch[send 0->1, recv 0<-1]", "queued", True)]
    assert ops[0]["ranks"] == [0, 1, 2, 3] and ops[0]["since"] == pytest.approx(T0 - 30)
    assert ops[2]["ranks"] == [1, 3] and ops[2]["peers"] == [3]  # group rank 1 of [1, 3]: global rank 3
    # the monitor's view: the oldest pending per group, and which one has waited too long
    view = inflight.summarize(ops)
    assert view["0"]["head"]["seq"] == 8 and view["0"]["pending"] == 2 and view["0"]["issued"] == 9
    assert inflight.stuck(ops, 25.0, now=T0) is ops[0]
    assert inflight.stuck(ops, 35.0, now=T0) is None


def test_the_recorder_is_read_with_the_json_bindings_arguments_and_missing_is_nothing(monkeypatch):
    c10d = inflight._c10d()
    calls = []

    def dump_nccl_trace_json(includeCollectives=None, onlyActive=None):  # torch's signature: no stack traces
        calls.append((includeCollectives, onlyActive))
        return json.dumps(NCCL_SAMPLE).encode()

    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", dump_nccl_trace_json, raising=False)
    ops = inflight.nccl_recorder(group_ranks={})
    assert calls == [(True, True)] and [o["seq"] for o in ops] == [8, 9, 13]
    monkeypatch.delattr(c10d, "_dump_nccl_trace_json")
    assert inflight.nccl_recorder() == []  # a CPU build: no NCCL, nothing pending
    errors = []
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", lambda **kw: b"not json", raising=False)
    assert inflight.pending(errors) == [] and errors and errors[0].startswith("nccl:")


def _late_peer() -> dict:
    """Rank 1 joins rank 0's all_reduce on a subgroup 1.5 s late; rank 0 reads gloo's recorder meanwhile."""
    rank = dist.get_rank()
    sub = dist.new_group([0, 1])
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    dist.all_reduce(t, group=sub)
    if rank == 1:
        time.sleep(1.5)
        dist.all_reduce(t, group=sub)
        return {}
    work = dist.all_reduce(t, group=sub, async_op=True)
    time.sleep(0.5)
    waiting = inflight.gloo_recorder()
    work.wait()
    # the recorder's entry is retired on gloo's side of the work, which can lag the wait() returning: CI on a
    # loaded 2-core machine once read it as still queued right after the wait. Read until it goes (10 s at most)
    deadline = time.monotonic() + patience(10.0)
    after = inflight.gloo_recorder()
    while after and time.monotonic() < deadline:
        time.sleep(0.05)
        after = inflight.gloo_recorder()
    return {"waiting": waiting, "after": after, "name": sub.group_name}


def test_a_real_dump_of_gloos_recorder_names_the_collective_a_rank_waits_in(plain_gloo):
    """The format is torch's (FlightRecorder<c10::Event>, the same dump_json as NCCL's): read it for real
    (plain gloo: under the strict mode the recorder would hold the strict groups' inner gloo operations)."""
    got, _ = spawn(_late_peer, 2, timeout_s=120)
    [op] = got["waiting"]
    assert (op["group"], op["seq"], op["op"], op["ranks"], op["p2p"]) == (got["name"], 2, "all_reduce", [0, 1], False)
    assert time.time() - 120 < op["since"] < time.time()
    assert got["after"] == []


def _late_peer_strict() -> dict:
    """Under the strict mode: rank 1 issues the all_reduce 1.5 s late; rank 0's strict record meanwhile."""
    rank = dist.get_rank()
    t = torch.ones(4)
    dist.all_reduce(t)
    peer = 1 - rank
    ops = [dist.P2POp(dist.isend, t.clone(), peer), dist.P2POp(dist.irecv, torch.zeros(4), peer)]
    for r in dist.batch_isend_irecv(ops):
        r.wait()
    if rank == 1:
        time.sleep(1.5)
        dist.all_reduce(t)
        return {}
    work = dist.all_reduce(t, async_op=True)
    time.sleep(0.5)
    waiting = inflight.strict_source()()
    work.wait()
    return {"waiting": waiting, "after": inflight.strict_source()(), "name": dist.group.WORLD.group_name}


def test_the_strict_modes_record_is_a_flight_source(monkeypatch):
    """raydist.strict's own record (a real strict world group), read through the adapter."""
    monkeypatch.setenv("RAYDIST_STRICT_COLLECTIVES", "1")
    got, _ = spawn(_late_peer_strict, 2, timeout_s=120)
    [op] = got["waiting"]
    assert (op["group"], op["seq"], op["ranks"], op["p2p"]) == (got["name"], 2, [0, 1], False)
    assert op["op"] == "all_reduce" and op["state"] in ("queued", "started")
    assert time.time() - 120 < op["since"] < time.time()
    assert got["after"] == []


def test_the_strict_modes_p2p_ops_name_their_peers(monkeypatch):
    now = time.time()
    # as raydist.strict.runtime.StrictRuntime.pending writes them (peers are global ranks)
    pending = [{"group": "3", "ranks": [2, 5], "seq": 4, "state": "started", "since": now - 12, "kind": "p2p",
                "op": "batch [isend to rank 5 (message 3 of the pair, tag 0, 16 bytes), "
                      "irecv from rank 5 (message 3 of the pair, tag 0, 16 bytes)]"},
               {"group": "3", "ranks": [2, 5], "seq": 5, "op": "all_reduce #5", "state": "queued", "since": now - 11,
                "kind": "collective"}]
    strict = types.ModuleType("raydist.strict")
    strict.flight = types.SimpleNamespace(pending=lambda: pending)
    monkeypatch.setitem(sys.modules, "raydist.strict", strict)
    monkeypatch.setitem(sys.modules, "raydist.strict.flight", strict.flight)
    inflight.register_flight_source("strict", inflight.strict_source())
    try:
        ops = inflight.pending()
    finally:
        inflight.unregister_flight_source("strict")
    assert [(o["seq"], o["op"][:5], o["p2p"], o["peers"], o["source"]) for o in ops] == [
        (4, "batch", True, [5], "strict"), (5, "all_r", False, None, "strict")]
    assert inflight.describe_op(ops[1]) == "all_reduce #5 on group 3"
    assert inflight.stuck(ops, 10.0)["seq"] == 4


def test_without_the_strict_mode_installed_there_is_no_strict_source(monkeypatch):
    monkeypatch.setitem(sys.modules, "raydist.strict", None)  # import fails
    assert inflight.strict_source() is None


def test_whether_a_rank_arrived_at_a_collective():
    now = T0
    op = {"group": "0", "seq": 8, "op": "all_reduce", "since": now - 30, "p2p": False}
    def rec(view, beat=now):
        return {"beat": beat, "inflight": view}

    assert inflight.arrived(rec({"0": {"head": {"seq": 8}, "issued": 8, "pending": 1}}), op) is True
    assert inflight.arrived(rec({"0": {"head": None, "issued": 9, "pending": 0}}), op) is True  # issued and done
    assert inflight.arrived(rec({"0": {"head": {"seq": 6}, "issued": 7, "pending": 2}}), op) is False  # behind
    assert inflight.arrived(rec({}), op) is False  # nothing pending there
    assert inflight.arrived(rec({}, beat=now - 40), op) is None  # published before the op was issued
    assert inflight.arrived({"beat": now}, op) is None  # no in-flight view at all (gloo)
    p2p = {**op, "p2p": True, "seq": 41}
    assert inflight.arrived(rec({"0": {"head": {"seq": 3}, "issued": 3, "pending": 1}}), p2p) is True
    assert inflight.arrived(rec({}), p2p) is False
