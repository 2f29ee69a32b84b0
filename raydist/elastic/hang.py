"""Hang diagnosis: which rank never arrived, at which collective, where every rank was, and each live rank's
Python stack; bounded in time whatever the store, the stopped rank or py-spy do.

Each rank keeps a record of what it is doing (`ACTIONS`): the step, the action (a phase of the step, a
collective with its group, a pipeline action with its micro-batch and stage, a checkpoint save...) and
since when. Setting it is two attribute writes; collectives called through `torch.distributed`'s Python
functions are recorded by wrappers `track_collectives()` installs in Ray workers. On NCCL the host runs
ahead of the GPU, so the action says where the host is; what the communicators still wait for comes from
a flight source (raydist.elastic.inflight: NCCL's flight recorder, or the strict-collectives mode's own record).

`HangMonitor` (one per Ray Train worker, a daemon thread) every `monitor.heartbeat_interval_s`:
- publishes the record to the attempt's TCP store (through a `BoundedStore`: the store's server lives in
  rank 0's process, which may be the one that is stopped, and a stopped server blocks a client forever):

      raydist/hang/rank/<r>   {"rank", "host", "pid", "step", "action", "since", "beat",
                               "inflight": {group: {"ranks", "issued", "head": {"seq", "op", ...}, "pending"}}}

  ("inflight" only where a flight source watches this rank's groups);
- reads every rank's record into its own view (`view`), so that a diagnosis without the store still knows
  rank 0's pid, host and action;
- where a flight source watches (NCCL, the strict mode), asks it for this rank's pending ops every
  `inflight.poll_s(...)` and, when one has waited longer than `elastic.collective_timeout_s`, calls
  `on_stuck(op)` once: the session diagnoses and ends the worker, before the group's own timeout
  (`group_timeout_s`) would abort the process without a word.

The thread keeps beating while the training thread waits in a collective (the wait releases the GIL), so a
rank whose beat stops is stopped (SIGSTOP, a debugger), frozen in native code holding the GIL, or dead. It
also notices when its own process did not run for a while (`frozen`: it woke up long after it should have).

`diagnose(trigger)` (a collective that timed out or is stuck, the step watchdog) returns within
`DIAGNOSE_BUDGET_S` whatever happens (its work runs in a daemon thread joined with that deadline; each store
call, py-spy run and wait inside has its own share of it):
1. one rank claims the diagnosis (`store.add`); the others wait for it to finish (bounded), so that no
   rank's exit tears the worker group down while stacks are being written. If the store does not answer,
   every rank that sees the hang diagnoses with what it knows;
2. it reads every rank's record (the store's, else its own view) and names the culprits:
   - this rank itself if its own process was frozen just before (it is why the others timed out);
   - the store's host (rank 0) when the store does not answer: an unreachable store is evidence against
     the process it lives in (its pid and host from the view);
   - ranks without a record (store reachable), or whose beat is stale (no heartbeat for 3 intervals and at
     least 5 s), unless a store outage or this rank's own freeze explains the missed beats;
   - with the stuck collective known (group G, sequence number n): the members of G whose in-flight view
     shows they never issued n (for P2P: the peers with nothing pending on G);
   - else live ranks that are somewhere other than the rest (an earlier step or another action);
3. it publishes a dump request; every live rank on another host writes its own stack (py-spy on itself,
   Python's own frames where py-spy cannot attach), and the diagnoser runs `py-spy dump` for every rank on
   its own host (`--nonblocking` for silent ones: a stopped process is read, not paused);
4. RUN_DIR/logs/hang-<UTC time>-rank<r>/ gets `rank-<r>.txt` per stack, `ranks.json` (every record, the
   culprits, the collective, the trigger) and the diagnoser's exception; the event log gets a `hang`
   event naming the culprits' rank, host, pid, action and why, and the collective (op, group, sequence
   number); then the failure goes on to Ray Train, which restarts the run.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import math
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist

from raydist import strict

from raydist.elastic import inflight
from raydist.elastic.bounded_store import STORE_TIMEOUT_S, BoundedStore, StoreUnreachable  # noqa: F401
from raydist.elastic.stacks import PY_SPY_TIMEOUT_S, own_stack, py_spy_dump, python_stacks
from raydist.metrics.actions import ACTIONS
from raydist.store.run_store import RunStore

PREFIX = "raydist/hang/"
DIAGNOSE_BUDGET_S = 45.0  # the whole diagnosis, from the trigger to the failure going on
EXIT_MARGIN_S = 10.0  # after the budget, before a group's own timeout may end the process
STALE_MIN_S = 5.0
STORE_HOST_RANK = 0  # Ray Train's TorchConfig rendezvous: env://, MASTER_ADDR/PORT are rank 0's
                     # (ray/train/torch/config.py, _TorchBackend.on_start), so the TCPStore server is rank 0's
RESERVE_S = 3.0  # of the budget, kept for writing ranks.json and the event


def watched(backend: str) -> bool:
    """Whether raydist's monitor, not the process group, ends a collective that waits too long on `backend`
    (a group's backend name, e.g. dist.get_backend()): NCCL, whose collectives never raise in Python (its
    watchdog aborts the process), and the strict-collectives mode's, whose collectives end the process the
    same way (raydist.strict). gloo raises at its timeout."""
    return "nccl" in str(backend) or strict.BACKEND in str(backend)


_WATCHING = threading.Event()  # set while a HangMonitor of this process watches its in-flight collectives


def group_timeout_s(collective_timeout_s: float, backend: str, interval_s: float = 2.0,
                    monitored: bool | None = None) -> float:
    """The timeout to give process groups of `backend`. Where a monitor watches (`watched`, and `monitored`:
    by default whether one runs in this process), it sees an op pending longer than `collective_timeout_s`
    at its next poll (`inflight.poll_s`, plus one heartbeat of jitter), diagnoses within DIAGNOSE_BUDGET_S
    and ends the worker: the group's own timeout (NCCL's watchdog abort) must come after all that, or the
    process dies without naming anyone. Elsewhere (gloo, or no monitor: spawn, tests) the group's own
    timeout is `collective_timeout_s`: gloo raises, NCCL and the strict mode abort."""
    monitored = _WATCHING.is_set() if monitored is None else monitored
    if not (watched(backend) and monitored):
        return collective_timeout_s
    return (collective_timeout_s + inflight.poll_s(collective_timeout_s, interval_s) + interval_s
            + DIAGNOSE_BUDGET_S + EXIT_MARGIN_S)


COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_to_all_single", "barrier", "all_gather_object", "broadcast_object_list", "gather_object",
               "batch_isend_irecv", "send", "recv", "monitored_barrier")
_TRACKED: dict[str, Callable] = {}


def _group_of(args: tuple, kwargs: dict):
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    return group


def _wrap(name: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def tracked(*args, **kwargs):
        if kwargs.get("async_op"):
            return original(*args, **kwargs)
        group = _group_of(args, kwargs)
        label = (name, f"(group {group.group_name})" if group is not None else "(default group)")
        previous = ACTIONS.enter(label)
        result = original(*args, **kwargs)
        ACTIONS.what, ACTIONS.since = previous
        return result

    tracked._raydist_tracked = True
    return tracked


def track_collectives() -> None:
    """Records every synchronous torch.distributed collective this process calls (idempotent)."""
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None or getattr(original, "_raydist_tracked", False):
            continue
        _TRACKED[name] = original
        setattr(dist, name, _wrap(name, original))


def untrack_collectives() -> None:
    for name, original in _TRACKED.items():
        setattr(dist, name, original)
    _TRACKED.clear()


def is_hang(error: BaseException) -> bool:
    """A collective (or the store) timed out: a peer never arrived."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = f"{type(error).__name__} {error}".lower()
        if "timed out" in text or "timeout" in text:
            return True
        error = error.__cause__ or error.__context__
    return False


# ---- the monitor -----------------------------------------------------------------------------------


def _write(directory_uri: str, name: str, text: str) -> None:
    RunStore(directory_uri).write_text(name, text)


class HangMonitor:
    """The per-rank heartbeat thread and the diagnosis (see the module doc).

    collective_timeout_s / on_stuck: where given, the monitor watches this rank's in-flight collectives
    (flight=True publishes them) and calls `on_stuck(op)` once, from its thread, for the first op pending
    longer than that."""

    def __init__(self, rank: int, world_size: int, run_dir: str, interval_s: float = 2.0, stacks: bool = True,
                 store: Any = None, on_hang: Callable[[dict], None] | None = None,
                 log: Callable[[str], None] | None = None, flight: bool = False,
                 collective_timeout_s: float | None = None, on_stuck: Callable[[dict], None] | None = None,
                 store_host: int = STORE_HOST_RANK, budget_s: float = DIAGNOSE_BUDGET_S):
        self.rank, self.world_size, self.run_dir = rank, world_size, run_dir
        self.interval_s, self.stacks = interval_s, stacks
        self.host, self.pid = socket.gethostname(), os.getpid()
        store = store if store is not None else self._client()
        self.store = store if isinstance(store, BoundedStore) else BoundedStore(store)
        self.on_hang = on_hang
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.flight, self.collective_timeout_s, self.on_stuck = flight, collective_timeout_s, on_stuck
        self.store_host, self.budget_s = store_host, budget_s
        self.view: dict[int, dict] = {}  # every rank's last record as this rank read it
        self.inflight: dict[str, dict] = {}  # this rank's pending ops per group, as published
        self.pending_ops: list[dict] = []  # the last poll's pending ops
        self.flight_errors: list[str] = []
        self._issued: dict[str, int] = {}
        self.frozen: tuple[float, float] | None = None  # (from, to): this process did not run
        self._stop = threading.Event()
        self._dumped = False
        self._stuck_fired = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="raydist-hang-monitor")
        self.diagnosis: dict | None = None
        self._reported = False

    @staticmethod
    def _client() -> Any:
        """A client of the attempt's TCP store of its own (the default store's client is the process
        group's, with the collective's timeout; either way its server lives in rank 0's process)."""
        timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if addr and port:
            try:
                return dist.TCPStore(addr, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
            except Exception:
                pass
        return dist.distributed_c10d._get_default_store()

    # ---- heartbeat ------------------------------------------------------------------------------
    def start(self) -> "HangMonitor":
        with contextlib.suppress(Exception):
            self.beat()
        self._thread.start()
        if self.flight and self.collective_timeout_s is not None and self.on_stuck is not None:
            _WATCHING.set()  # groups created from now on may time out later (group_timeout_s)
        return self

    def stop(self) -> None:
        self._stop.set()
        _WATCHING.clear()

    def record(self) -> dict[str, Any]:
        rec = {"rank": self.rank, "host": self.host, "pid": self.pid, **ACTIONS.record(), "beat": round(time.time(), 3)}
        if self.flight:
            rec["inflight"] = self.inflight
        if self.store.outages:
            rec["store_unreachable"] = [round(t, 3) for t in self.store.outages[-1]]
        if self.frozen is not None:
            rec["frozen"] = [round(t, 3) for t in self.frozen]
        return rec

    def beat(self) -> None:
        self.store.set(f"{PREFIX}rank/{self.rank}", json.dumps(self.record()))

    def stale_after_s(self) -> float:
        return max(3 * self.interval_s, STALE_MIN_S)

    def poll_s(self) -> float:
        return inflight.poll_s(self.collective_timeout_s or 0.0, self.interval_s)

    def poll_flight(self, now: float | None = None) -> dict | None:
        """Asks the flight sources for this rank's pending ops; returns the one stuck longer than the
        collective timeout (None if none, or when not watching)."""
        errors: list[str] = []
        self.pending_ops = inflight.pending(errors)
        self.flight_errors = errors
        self.inflight = inflight.summarize(self.pending_ops, self._issued)
        if self.collective_timeout_s is None:
            return None
        return inflight.stuck(self.pending_ops, self.collective_timeout_s, now)

    def refresh_view(self) -> None:
        """Every rank's current record into `view` (the ones that exist; one round trip where it can)."""
        keys = [f"{PREFIX}rank/{r}" for r in range(self.world_size)]
        if self.store.check(keys):
            values = self.store.multi_get(keys)
        else:
            values = [self.store.get(k) if self.store.check([k]) else None for k in keys]
        for r, value in enumerate(values):
            if value is not None and r != self.rank:
                self.view[r] = {**json.loads(value), "read_at": round(time.time(), 3)}

    def _run(self) -> None:
        last = time.monotonic()
        next_poll = 0.0
        view_every = max(1, math.ceil(self.world_size / 32))  # a full read costs the store world_size records
        beats = 0
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            late = now - last - self.interval_s
            last = now
            if late > self.stale_after_s():  # this process did not run (SIGSTOP, a stalled host)
                wall = time.time()
                self.frozen = (wall - late, wall)
            stuck = None
            if self.flight and now >= next_poll:
                with contextlib.suppress(Exception):
                    stuck = self.poll_flight()
                next_poll = now + self.poll_s()
            with contextlib.suppress(Exception):  # the store is gone (rank 0 died) or slow: next beat
                self.beat()
                if beats % view_every == 0:
                    self.refresh_view()
                if not self._dumped and self.store.check([f"{PREFIX}request"]):
                    self._answer(json.loads(self.store.get(f"{PREFIX}request")))
            beats += 1
            if stuck is not None and self.on_stuck is not None and not self._stuck_fired:
                self._stuck_fired = True
                with contextlib.suppress(Exception):
                    self.on_stuck(stuck)

    def _answer(self, request: dict) -> None:
        """A diagnosis asks for stacks: ranks on other hosts than the diagnoser's write their own."""
        self._dumped = True
        if request.get("host") == self.host or not self.stacks:
            return
        self._write_stack(request["dir"], self.rank, own_stack())
        self.store.set(f"{PREFIX}dumped/{self.rank}", "1")

    def _write_stack(self, directory: str, rank: int, text: str) -> None:
        header = f"# rank {rank}\n"
        _write(directory, f"rank-{rank}.txt", header + text)

    # ---- diagnosis ------------------------------------------------------------------------------
    def _records(self, deadline: float) -> tuple[dict[int, dict], bool]:
        """Every rank's record from the store; where the store does not answer, this rank's view of it."""
        records, reachable = {}, True
        keys = [f"{PREFIX}rank/{r}" for r in range(self.world_size)]

        def left() -> float:  # each call: the store's own timeout, or what is left of this step's deadline
            return min(self.store.timeout_s, max(0.5, deadline - time.monotonic()))

        try:
            if self.store.check(keys, timeout_s=left()):
                values = self.store.multi_get(keys, timeout_s=left())
            else:
                values = [self.store.get(k, timeout_s=left()) if self.store.check([k], timeout_s=left()) else None
                          for k in keys]
            records = {r: json.loads(v) for r, v in enumerate(values) if v is not None}
        except Exception:
            reachable = False
            records = {r: {**rec, "from_view": True} for r, rec in self.view.items()}
        records[self.rank] = self.record()  # this rank's, fresh
        return records, reachable

    def _outages(self, now: float) -> list[tuple[float, float]]:
        """Times when beats could not land: this rank's store outages, and its own process's freeze."""
        return self.store.outages_until(now) + ([self.frozen] if self.frozen is not None else [])

    def _explained(self, beat: float, now: float) -> tuple[float, float] | None:
        """The outage that explains a beat last seen at `beat` (the rank was beating up to it, and it ended
        too recently for the rank to have beaten since), else None."""
        stale = self.stale_after_s()
        for start, end in self._outages(now):
            if start - stale <= beat and end >= now - stale:
                return start, end
        return None

    def culprits(self, records: dict[int, dict], now: float, store_reachable: bool = True,
                 waiting_rank: int | None = None, stuck: dict | None = None) -> list[dict]:
        """Ranks that never arrived (see the module doc, step 2). `waiting_rank`: the rank whose collective
        timed out; `stuck`: the collective it waits in (an inflight op dict), when known."""
        out = []
        recent = now - 2 * self.stale_after_s() - (self.collective_timeout_s or 0)
        if self.frozen is not None and self.frozen[1] >= recent:  # this process itself was stopped just before
            lasted = self.frozen[1] - self.frozen[0]
            if lasted >= self.stale_after_s():
                out.append({**self._brief(records[self.rank], now),
                            "reason": f"this process did not run for {lasted:.0f}s (stopped, e.g. SIGSTOP, or its "
                                      "host stalled): the others could not wait that long"})
        for r in range(self.world_size):
            rec = records.get(r)
            if r == self.rank:
                continue
            if not store_reachable and r == self.store_host:
                brief = self._brief(rec, now) if rec else {"rank": r, "host": None, "pid": None}
                out.append({**brief, "silent": True, "reason": "the rendezvous store in its process did not answer "
                            "(stopped, frozen or dead)"})
            elif rec is None:
                if store_reachable:
                    out.append({"rank": r, "host": None, "pid": None,
                                "reason": "no record (it never started, or the store did not answer)"})
            elif now - rec["beat"] > self.stale_after_s() and self._explained(rec["beat"], now) is None:
                out.append({**self._brief(rec, now), "silent": True,
                            "reason": f"no heartbeat for {now - rec['beat']:.0f}s "
                                      "(stopped, frozen holding the GIL, or dead)"})
        if out:
            return out
        if stuck is not None:
            out = self._never_arrived(records, now, stuck)
            if out:
                return out
        return self._elsewhere(records, now, waiting_rank)

    def _never_arrived(self, records: dict[int, dict], now: float, stuck: dict) -> list[dict]:
        """Members of the stuck collective's group (its peers, for P2P) whose in-flight view shows they
        never issued it."""
        members = stuck.get("peers") if stuck.get("p2p") else stuck.get("ranks")
        out = []
        for r in members or []:
            rec = records.get(r)
            if r == self.rank or rec is None or inflight.arrived(rec, stuck) is not False:
                continue
            mine = (rec.get("inflight") or {}).get(stuck["group"]) or {}
            where = f"it is in '{rec.get('action')}' at step {rec.get('step')}"
            others = [g for g in (rec.get("inflight") or {}).values() if g.get("head")]
            if others:
                oldest = min((g["head"] for g in others), key=lambda h: h["since"])
                group = next(name for name, g in rec["inflight"].items() if g.get("head") is oldest)
                where += (f"; it waits in {inflight.describe_op({**oldest, 'group': group})} "
                          f"since {now - oldest['since']:.0f}s")
            last = mine.get("issued")
            out.append({**self._brief(rec, now), "reason": f"has not issued {inflight.describe_op(stuck)} "
                        f"(its last there: {'#' + str(last) if last else 'none seen'}); {where}"})
        return out

    def _elsewhere(self, records: dict[int, dict], now: float, waiting_rank: int | None) -> list[dict]:
        """All beating: the ranks that are elsewhere never arrived where the others wait."""
        out = []
        if len(records) < 2:
            return out
        places: dict[tuple, list[int]] = {}
        for r, rec in records.items():
            if rec.get("action") == "idle":  # idle workers take part in no collective
                continue
            places.setdefault((rec.get("step"), rec.get("action")), []).append(r)
        if len(places) <= 1:
            return []
        majority = max(places.values(), key=len)
        if waiting_rank is not None and waiting_rank in records:
            rec = records[waiting_rank]
            majority = places.get((rec.get("step"), rec.get("action")), majority)
        for (step, action), ranks in places.items():
            if ranks is majority:
                continue
            for r in ranks:
                out.append({**self._brief(records[r], now), "reason": f"in '{action}' at step {step} while "
                                                                      f"{len(majority)} rank(s) wait elsewhere"})
        return out

    @staticmethod
    def _brief(rec: dict, now: float) -> dict:
        brief = {"rank": rec["rank"], "host": rec.get("host"), "pid": rec.get("pid"), "step": rec.get("step"),
                 "action": rec.get("action"), "for_s": round(now - rec["since"], 1) if rec.get("since") else None}
        if rec.get("from_view"):  # not the store's record: this rank's last read of it, that long ago
            brief["seen_s_ago"] = round(now - rec.get("read_at", now), 1)
        return brief

    def diagnose(self, trigger: str, error: BaseException | None = None, stuck: dict | None = None) -> dict | None:
        """Called by a rank that saw the hang; returns the diagnosis (None when another rank made it, or
        when it did not finish within the budget: it then says so, and the caller fails anyway)."""
        deadline = time.monotonic() + self.budget_s
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["diagnosis"] = self._diagnose(trigger, error, stuck, deadline)
            except BaseException as exc:  # a diagnosis aid must never hide the failure itself
                box["error"] = exc

        thread = threading.Thread(target=run, daemon=True, name="raydist-hang-diagnosis")
        thread.start()
        thread.join(self.budget_s)
        if thread.is_alive():
            self.log(f"warning: rank {self.rank}: the hang diagnosis did not finish within {self.budget_s:.0f}s; "
                     "failing without it")
            self._report({"trigger": trigger, "culprits": [], "waiting": [], "stacks": None, "stacks_written": [],
                          "collective": self._collective(stuck, time.time()), "diagnosed_by": self.rank,
                          "incomplete": f"the diagnosis did not finish within {self.budget_s:.0f}s"})
            return None
        if "error" in box:
            error = box["error"]
            self.log(f"warning: rank {self.rank}: hang diagnosis failed ({type(error).__name__}: {error})")
            return None
        return box.get("diagnosis")

    def _report(self, diagnosis: dict) -> None:
        """The `hang` event, once per process."""
        if self._reported or self.on_hang is None:
            return
        self._reported = True
        with contextlib.suppress(Exception):
            self.on_hang(diagnosis)

    @staticmethod
    def _collective(op: dict | None, now: float) -> dict | None:
        if op is None:
            return None
        return {"op": op["op"], "group": op["group"], "seq": op["seq"], "ranks": op.get("ranks"),
                "state": op.get("state"), "pending_s": round(now - op["since"], 1)}

    def _diagnose(self, trigger: str, error: BaseException | None, stuck: dict | None, deadline: float) -> dict | None:
        left = lambda: deadline - time.monotonic() - RESERVE_S  # noqa: E731
        try:
            first = self.store.add(f"{PREFIX}claim", 1, timeout_s=min(self.store.timeout_s, max(0.5, left()))) == 1
        except Exception:
            first = True  # the store does not answer: diagnose with what this rank knows
        if not first:
            self._wait_for(f"{PREFIX}done", deadline - RESERVE_S)
            return None
        if stuck is None:  # the collective this rank waits in, if a recorder knows (gloo's read once, here)
            stuck = min(inflight.own_pending(gloo=True), key=lambda op: op["since"], default=None)
        records, reachable = self._records(deadline - RESERVE_S - 10.0)
        now = time.time()
        culprits = self.culprits(records, now, reachable, waiting_rank=self.rank if error is not None or stuck
                                 else None, stuck=stuck)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
        directory = self.run_dir.rstrip("/") + f"/logs/hang-{stamp}-rank{self.rank}"
        if reachable:
            with contextlib.suppress(Exception):
                self.store.set(f"{PREFIX}request", json.dumps({"dir": directory, "host": self.host, "time": now}),
                               timeout_s=min(self.store.timeout_s, max(0.5, left())))
        named = {c["rank"] for c in culprits}
        dumped = self._dump_local(directory, records, culprits, deadline) if self.stacks else []
        if self.stacks and reachable:  # ranks on other hosts answer the request from their heartbeat threads
            others = [r for r, rec in records.items() if rec.get("host") != self.host and r not in named]
            wait_until = time.monotonic() + max(0.0, min(15.0, left()))
            while others and time.monotonic() < wait_until:
                others = [r for r in others if not self._check(f"{PREFIX}dumped/{r}")]
                time.sleep(0.2)
            dumped += [r for r, rec in records.items() if rec.get("host") != self.host and r not in others
                       and r not in named]
        waiting = [self._brief(rec, now) for r, rec in sorted(records.items()) if r not in named]
        diagnosis = {"trigger": trigger, "culprits": culprits, "waiting": waiting,
                     "collective": self._collective(stuck, now), "stacks": directory, "stacks_written": sorted(dumped),
                     "diagnosed_by": self.rank, "store_reachable": reachable,
                     "records": {str(r): rec for r, rec in sorted(records.items())}}
        if self.flight_errors:
            diagnosis["flight_errors"] = self.flight_errors
        with contextlib.suppress(Exception):
            _write(directory, "ranks.json", json.dumps(diagnosis, indent=1, default=str))
            if error is not None:
                _write(directory, f"rank-{self.rank}-error.txt",
                       "".join(traceback.format_exception(type(error), error, error.__traceback__)))
        self.diagnosis = diagnosis
        self._report(diagnosis)
        if reachable:
            with contextlib.suppress(Exception):
                self.store.set(f"{PREFIX}done", "1", timeout_s=1.0)
        return diagnosis

    def _dump_local(self, directory: str, records: dict[int, dict], culprits: list[dict], deadline: float) -> list[int]:
        """py-spy for every rank on this host, in parallel; silent ranks are read without pausing them."""
        silent = {c["rank"] for c in culprits if c.get("silent")}
        local = {r: rec for r, rec in records.items() if rec.get("host") == self.host and rec.get("pid")}
        results: dict[int, tuple[bool, str]] = {}
        timeout_s = max(1.0, min(PY_SPY_TIMEOUT_S, deadline - time.monotonic() - RESERVE_S - 2.0))

        def dump(r: int, rec: dict) -> None:
            results[r] = py_spy_dump(rec["pid"], nonblocking=r in silent, timeout_s=timeout_s)

        threads = [threading.Thread(target=dump, args=(r, rec), daemon=True) for r, rec in local.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s + 1.0)  # (they run side by side: the joins add up to one timeout)
        written = []
        for r, rec in sorted(local.items()):
            ok, text = results.get(r, (False, "py-spy did not answer"))
            if not ok and r == self.rank:
                ok, text = True, f"# py-spy could not attach ({text.splitlines()[-1] if text else '?'}); " \
                                 "Python's own frames\n" + python_stacks()
            elif ok:
                text = f"# py-spy dump --pid {rec['pid']}{' --nonblocking' if r in silent else ''}\n" + text
            else:
                text = f"# py-spy dump --pid {rec['pid']} failed: {text}\n"
            with contextlib.suppress(Exception):
                self._write_stack(directory, r, f"# host {rec['host']} pid {rec['pid']} step {rec.get('step')} "
                                                f"action {rec.get('action')}\n" + text)
                if ok:
                    written.append(r)
        return written

    def _check(self, key: str) -> bool:
        try:
            return self.store.check([key], timeout_s=1.0)
        except Exception:
            return False

    def _wait_for(self, key: str, until: float) -> None:
        """Polls `key` until the monotonic time `until`; stops early if the store stops answering."""
        while time.monotonic() < until:
            try:
                if self.store.check([key], timeout_s=max(0.1, min(1.0, until - time.monotonic()))):
                    return
            except Exception:
                return
            time.sleep(0.2)
