"""What this process's communicators were asked to do and have not finished: its in-flight collectives, for
hang detection and diagnosis (raydist.elastic.hang).

An NCCL collective never raises in Python: the host enqueues it and runs on, and ProcessGroupNCCL's watchdog
aborts the whole process once an op has waited longer than its group's timeout. raydist's recorded action
(raydist.metrics.actions) says where the host is, which is ahead of the GPU. So each rank's monitor thread asks a
*flight source* which ops are pending, and, before the group's own timeout, detects an op that has waited
longer than `elastic.collective_timeout_s`. A source returns this process's pending ops, the op at the head
of each group's stream first:

    {"group": group name, "ranks": [global ranks of the group] | None, "seq": per-group sequence number
     (1-based), "op": "all_reduce" | "batch[send 0->1, recv 0<-1]" ..., "state": "queued" | "started",
     "since": time.time() when it was issued, "p2p": bool, "peers": [global ranks] | None}

Sources:
- registered ones (`register_flight_source`), e.g. the strict-collectives mode's `raydist.strict.flight.pending`
  (adapted by `strict_source`): when any is registered only they are asked;
- else torch's flight recorder for NCCL (`torch._C._distributed_c10d._dump_nccl_trace_json(includeCollectives,
  onlyActive)`, CUDA builds only; JSON, never the pickled `_dump_nccl_trace`), read by `nccl_recorder`.
  Its buffer must exist before the first NCCL group: `TORCH_NCCL_TRACE_BUFFER_SIZE` in the worker's
  environment (raydist.elastic.torch_backend sets it). Field names: torch/csrc/distributed/c10d/
  FlightRecorder.hpp and FlightRecorderDetail.hpp (`dump_json`).

Reading the recorder, as its `dump_json` and ProcessGroupNCCL fill it:
- `entries[]`: `process_group` [name, desc], `pg_id`, `record_id` (global order), `collective_seq_id`,
  `p2p_seq_id`, `is_p2p`, `profiling_name` ("nccl:all_reduce", "nccl:send 0->1", "nccl:recv 0<-1" with group
  ranks, "nccl:coalesced"), `time_created_ns` (wall clock), `state` ("scheduled", "started" with
  TORCH_NCCL_ENABLE_TIMING, "completed"), `retired`; `onlyActive` leaves out completed entries;
- `pg_config` {name: {"ranks": "[0, 1]"}} (global ranks), `pg_status` {pg_id: last enqueued / completed seq}.
- A coalesced group (every `batch_isend_irecv`, coalesced collectives) is one entry per op, recorded without
  CUDA events so it never reads as completed, then one "nccl:coalesced" entry with the same sequence
  number that carries the group's events (torch's own tools/flight_recorder groups them the same way). A
  group whose "coalesced" entry is absent from an onlyActive dump has completed: its op entries are left
  over. A lone P2P entry is therefore ambiguous (a pending send outside a batch, or what is left of a
  one-op batch): it is not reported, so P2P outside `batch_isend_irecv` is not watched (raydist sends
  only in batches).
- The dump holds the GIL while it serialises (about 40 us per entry: 85 ms for a full 2000-entry
  buffer, measured on gloo's recorder), so it is read every `poll_s(...)`, not every heartbeat.

gloo records into the other recorder (`_dump_fr_trace_json`, collectives only, entries never read as
completed: `retired` marks a finished one). It is read once, at a diagnosis (`own_pending(gloo=True)`),
never polled: dumping a full buffer costs the training thread the time above, and a gloo collective
raises in Python at its timeout anyway.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Callable

_SOURCES: dict[str, Callable[[], list[dict]]] = {}


def register_flight_source(name: str, fn: Callable[[], list[dict]]) -> None:
    """`fn()` lists this process's pending ops (see the module docstring); replaces a source of that name."""
    _SOURCES[name] = fn


def unregister_flight_source(name: str) -> None:
    _SOURCES.pop(name, None)


def registered() -> list[str]:
    return list(_SOURCES)


def pending(errors: list[str] | None = None) -> list[dict]:
    """This process's pending ops from every registered source, else from NCCL's flight recorder. A source
    that fails is skipped (its error appended to `errors`): a diagnosis aid must never fail training."""
    sources = dict(_SOURCES) or {"nccl": nccl_recorder}
    out = []
    for name, fn in sources.items():
        try:
            ops = fn() or []
        except Exception as exc:
            if errors is not None:
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        out += [{**op, "source": name} for op in ops]
    return out


def own_pending(gloo: bool = False, errors: list[str] | None = None) -> list[dict]:
    """`pending()`, plus (gloo=True, at a diagnosis) gloo's recorder when no source is registered."""
    ops = pending(errors)
    if gloo and not _SOURCES:
        try:
            ops += [{**op, "source": "gloo"} for op in gloo_recorder()]
        except Exception as exc:
            if errors is not None:
                errors.append(f"gloo: {type(exc).__name__}: {exc}")
    return ops


def poll_s(collective_timeout_s: float, interval_s: float) -> float:
    """How often the monitor asks the sources: every heartbeat, and at least a fifth of the collective
    timeout (at most 30 s) apart, so that a long timeout does not pay for frequent recorder dumps."""
    return max(interval_s, min(30.0, collective_timeout_s / 5))


# ---- torch's flight recorders ----------------------------------------------------------------------


def _c10d():
    import torch.distributed  # noqa: F401  (the bindings live in torch._C once torch.distributed is loaded)
    import torch._C._distributed_c10d as c10d

    return c10d


def nccl_recorder(group_ranks: dict[str, list[int]] | None = None) -> list[dict]:
    """ProcessGroupNCCL's pending ops; [] where there is no NCCL (a CPU build) or no recorder."""
    dump = getattr(_c10d(), "_dump_nccl_trace_json", None)
    if dump is None:
        return []
    raw = dump(includeCollectives=True, onlyActive=True)
    return parse_recorder(json.loads(raw), group_ranks if group_ranks is not None else python_group_ranks())


def gloo_recorder(group_ranks: dict[str, list[int]] | None = None) -> list[dict]:
    """gloo's pending collectives (torch's generic recorder); [] where this torch has none."""
    dump = getattr(_c10d(), "_dump_fr_trace_json", None)
    if dump is None:
        return []
    raw = dump(includeCollectives=True, onlyActive=True)
    return parse_recorder(json.loads(raw), group_ranks if group_ranks is not None else python_group_ranks())


def python_group_ranks() -> dict[str, list[int]]:
    """{group name: global ranks} of every process group this process knows (the recorder's own pg_config
    misses gloo groups, which get their name after construction)."""
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return {}
        names = list(dist.distributed_c10d._world.pg_names.items())  # (another thread may be creating groups)
        return {name: list(dist.get_process_group_ranks(pg)) for pg, name in names}
    except Exception:
        return {}


_PEER = re.compile(r"(\d+)\s*(->|<-)\s*(\d+)")  # NCCL's "send 0->1", "recv 0<-1" (group ranks)
_STRICT_PEER = re.compile(r"(?:to|from) rank (\d+)")  # the strict mode's "isend to rank 1 (...)" (global ranks)


def _op_name(profiling_name: str) -> str:
    return profiling_name.split(":", 1)[1] if ":" in profiling_name else profiling_name


def _ranks_of(text: Any) -> list[int] | None:
    if isinstance(text, list):
        return [int(r) for r in text]
    if isinstance(text, str):
        found = [int(r) for r in re.findall(r"\d+", text)]
        return found or None
    return None


def _peer(op: str, ranks: list[int] | None) -> int | None:
    """The global rank on the other side of "send 0->1" / "recv 0<-1" (group ranks in NCCL's names)."""
    match = _PEER.search(op)
    if match is None:
        return None
    peer = int(match.group(3))
    if ranks:
        return ranks[peer] if peer < len(ranks) else None
    return peer


def parse_recorder(trace: dict, group_ranks: dict[str, list[int]] | None = None) -> list[dict]:
    """Pending ops from one JSON dump of a flight recorder (see the module docstring), one per
    coalesced group, oldest first."""
    group_ranks = group_ranks or {}
    config = trace.get("pg_config") or {}
    entries = sorted(trace.get("entries") or [], key=lambda e: e.get("record_id", 0))
    runs: dict[tuple, list[dict]] = {}  # (pg_id, p2p, seq) -> its entries
    for e in entries:
        if e.get("state") == "completed":
            continue
        name = str(e.get("profiling_name", ""))
        if e.get("retired") and name.startswith("gloo:"):  # gloo retires an op when it finishes
            continue
        p2p = bool(e.get("is_p2p"))
        seq = int(e.get("p2p_seq_id") if p2p else e.get("collective_seq_id") or 0)
        runs.setdefault((e.get("pg_id"), p2p, seq), []).append(e)
    ops = []
    for (_, p2p, seq), run in runs.items():
        coalesced = [e for e in run if str(e.get("profiling_name", "")).endswith("coalesced")]
        members = [e for e in run if e not in coalesced]
        if not coalesced and (len(members) > 1 or p2p):
            continue  # what a completed coalesced group leaves behind (or a lone, ambiguous P2P entry)
        first = run[0]
        pg = first.get("process_group") or ["?", ""]
        group = str(pg[0] if isinstance(pg, (list, tuple)) else pg)
        ranks = group_ranks.get(group) or _ranks_of((config.get(group) or {}).get("ranks"))
        names = [_op_name(str(e.get("profiling_name", ""))) for e in members]
        if coalesced:
            op = f"{'batch' if p2p else 'coalesced'}[{', '.join(names)}]"
        else:
            op = names[0]
        peers = sorted({p for p in (_peer(n, ranks) for n in names) if p is not None}) if p2p else None
        started = any(e.get("state") == "started" for e in run)
        ops.append({"group": group, "ranks": ranks, "seq": seq, "op": op, "state": "started" if started else "queued",
                    "since": min(int(e.get("time_created_ns") or 0) for e in run) / 1e9, "p2p": p2p,
                    "peers": peers or None})
    return sorted(ops, key=lambda o: o["since"])


# ---- raydist's strict-collectives mode -----------------------------------------------------------------


def strict_source() -> Callable[[], list[dict]] | None:
    """`raydist.strict.flight.pending` as a flight source, or None where the mode is not installed. Its ops
    carry group, ranks, seq, op ("all_reduce #5", "isend to rank 1 (...)", "batch [isend to rank 1 (...),
    irecv from rank 1 (...)]": peers are global ranks), state, since and kind ("collective" | "p2p")."""
    try:
        from raydist.strict import flight
    except ImportError:
        return None

    def source() -> list[dict]:
        out = []
        for op in flight.pending():
            p2p = op.get("kind") == "p2p"
            name = str(op["op"]) if p2p else re.sub(r"\s*#\d+$", "", str(op["op"]))  # ("all_reduce #5": seq apart)
            peers = sorted({int(m) for m in _STRICT_PEER.findall(name)}) if p2p else None
            out.append({"group": str(op["group"]), "ranks": list(op.get("ranks") or []) or None, "seq": int(op["seq"]),
                        "op": name, "state": op.get("state", "queued"), "since": float(op["since"]), "p2p": p2p,
                        "peers": peers or None})
        return out

    return source


# ---- what a heartbeat carries, and what it says -------------------------------------------------------


def summarize(ops: list[dict], issued: dict[str, int] | None = None) -> dict[str, dict]:
    """The compact per-group view a heartbeat carries: {group: {"ranks", "issued" (highest seq known issued),
    "head": the oldest pending op {"seq", "op", "state", "since", "p2p", "peers"}, "pending": count}}.
    `issued` (updated in place) remembers the highest seq seen per group across polls."""
    issued = issued if issued is not None else {}
    out: dict[str, dict] = {}
    for op in ops:
        g = out.get(op["group"])
        issued[op["group"]] = max(issued.get(op["group"], 0), op["seq"])
        if g is None:
            out[op["group"]] = {"ranks": op.get("ranks"), "pending": 1,
                                "head": {k: op.get(k) for k in ("seq", "op", "state", "since", "p2p", "peers")}}
        else:
            g["pending"] += 1
            if op["since"] < g["head"]["since"]:
                g["head"] = {k: op.get(k) for k in ("seq", "op", "state", "since", "p2p", "peers")}
    for group, g in out.items():
        g["issued"] = issued.get(group)
    return out


def stuck(ops: list[dict], timeout_s: float, now: float | None = None) -> dict | None:
    """The oldest op pending longer than `timeout_s`, else None."""
    now = time.time() if now is None else now
    late = [op for op in ops if now - op["since"] > timeout_s]
    return min(late, key=lambda op: op["since"]) if late else None


def describe_op(op: dict) -> str:
    return f"{op['op']} #{op['seq']} on group {op['group']}"


def arrived(record: dict, op: dict) -> bool | None:
    """Whether the rank of `record` has issued `op` (the diagnoser's stuck op), from the in-flight view it
    published: True (it issued it: it waits too), False (it never issued it), None (its record cannot tell:
    published before the op was issued, or without an in-flight view)."""
    if "inflight" not in record or record.get("beat", 0) < op["since"]:
        return None
    mine = (record.get("inflight") or {}).get(op["group"])
    if op.get("p2p"):  # P2P sequence numbers are per rank: the peer has arrived if it is in any exchange there
        return mine is not None
    if mine is None:
        return False
    head, issued = mine.get("head") or {}, mine.get("issued") or 0
    return max(head.get("seq", 0), issued) >= op["seq"]  # (pending at an earlier seq there: not arrived)
