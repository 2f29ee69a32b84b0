"""Hang diagnosis: which rank never arrived, where every rank was, and each live rank's Python stack.

Each rank keeps a record of what it is doing (`ACTIONS`): the step, the action (a phase of the step, a
collective with its group, a pipeline action with its micro-batch and stage, a checkpoint save...) and
since when. Setting it is two attribute writes; collectives called through `torch.distributed`'s Python
functions are recorded by wrappers `track_collectives()` installs in Ray workers.

`HangMonitor` (one per Ray Train worker, a daemon thread) publishes the record every
`monitor.heartbeat_interval_s` to the attempt's TCP store (the process group's, with a client of its own
and short timeouts):

    raydist/hang/rank/<r>   {"rank", "host", "pid", "step", "action", "since", "beat"}

The thread keeps beating while the training thread waits in a collective (the wait releases the GIL), so a
rank whose beat stops is stopped (SIGSTOP, a debugger), frozen in native code holding the GIL, or dead.
When a collective times out in a rank, or the step watchdog fires, that rank calls `diagnose(trigger)`:

1. one rank claims the diagnosis (`store.add`); the others wait for it to finish (bounded), so that no
   rank's exit tears the worker group down while stacks are being written;
2. the diagnoser reads every rank's record and names the culprits: ranks without a record, ranks whose
   beat is stale (no heartbeat for 3 intervals and at least 5 s), else live ranks that are somewhere other
   than the rest (an earlier step or another action: they never arrived at the collective the others wait
   in);
3. it publishes a dump request; every live rank on another host writes its own stack (py-spy on itself,
   Python's own frames where py-spy cannot attach), and the diagnoser runs `py-spy dump` for every rank on
   its own host (`--nonblocking` for the stale ones: a stopped process is read, not paused);
4. RUN_DIR/logs/hang-<UTC time>/ gets `rank-<r>.txt` per stack, `ranks.json` (every record, the
   culprits, the trigger) and the diagnoser's exception; the event log gets a `hang` event naming the
   culprits' rank, host, pid, action and why; then the failure goes on to Ray Train, which restarts the run.

Nothing here may block the failure for long: every store call has a short timeout, py-spy runs with a
timeout, and the whole diagnosis is bounded (`DIAGNOSE_BUDGET_S`).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist

PREFIX = "raydist/hang/"
STORE_TIMEOUT_S = 5.0
DIAGNOSE_BUDGET_S = 45.0
STALE_MIN_S = 5.0


# ---- what this rank is doing ---------------------------------------------------------------------


class Actions:
    """This process's current action: `what` (a string, or a tuple formatted when published), since when,
    and the step. `doing(what)` nests: on normal exit the outer action comes back; on an exception the
    record stays where the failure happened (what a diagnosis wants to read)."""

    def __init__(self):
        self.what: Any = "starting"
        self.since = time.time()
        self.step: int | None = None

    def enter(self, what: Any) -> tuple[Any, float]:
        previous = (self.what, self.since)
        self.what, self.since = what, time.time()
        return previous

    @contextlib.contextmanager
    def doing(self, what: Any):
        previous = self.enter(what)
        yield
        self.what, self.since = previous

    def describe(self) -> str:
        return describe(self.what)

    def record(self) -> dict[str, Any]:
        return {"step": self.step, "action": self.describe(), "since": round(self.since, 3)}


def describe(what: Any) -> str:
    if isinstance(what, tuple):
        return " ".join(str(part) for part in what if part is not None and part != "")
    return str(what)


ACTIONS = Actions()
doing = ACTIONS.doing

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


# ---- stacks (py-spy, or Python's own) live in stacks.py ------------------------------------------------
from raydist.stacks import PY_SPY_TIMEOUT_S, own_stack, py_spy, py_spy_dump, python_stacks  # noqa: E402,F401


# ---- the monitor -----------------------------------------------------------------------------------


def _write(run_dir_uri: str, name: str, text: str) -> None:
    from raydist.atomic import write_text_atomic

    write_text_atomic(run_dir_uri.rstrip("/") + "/" + name, text)


class HangMonitor:
    """The per-rank heartbeat thread and the diagnosis (see the module doc)."""

    def __init__(self, rank: int, world_size: int, run_dir: str, interval_s: float = 2.0, stacks: bool = True,
                 store: dist.Store | None = None, on_hang: Callable[[dict], None] | None = None,
                 log: Callable[[str], None] | None = None):
        self.rank, self.world_size, self.run_dir = rank, world_size, run_dir
        self.interval_s, self.stacks = interval_s, stacks
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.store = store if store is not None else self._client()
        self.on_hang = on_hang
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._stop = threading.Event()
        self._dumped = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="raydist-hang-monitor")
        self.diagnosis: dict | None = None

    @staticmethod
    def _client() -> dist.Store:
        """A client of the attempt's TCP store with short timeouts (the default store waits as long as a
        collective; its server lives in rank 0's process, which may be the one that is stopped)."""
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
        self.beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def record(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "pid": self.pid, **ACTIONS.record(), "beat": round(time.time(), 3)}

    def beat(self) -> None:
        self.store.set(f"{PREFIX}rank/{self.rank}", json.dumps(self.record()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
                if not self._dumped and self.store.check([f"{PREFIX}request"]):
                    self._answer(json.loads(self.store.get(f"{PREFIX}request")))
            except Exception:  # the store is gone (rank 0 died) or slow: try again next beat
                pass

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
    def _records(self) -> tuple[dict[int, dict], bool]:
        records, reachable = {}, True
        for r in range(self.world_size):
            key = f"{PREFIX}rank/{r}"
            try:
                if self.store.check([key]):
                    records[r] = json.loads(self.store.get(key))
            except Exception:
                reachable = False
                break
        records[self.rank] = self.record()  # this rank's, fresh
        return records, reachable

    def stale_after_s(self) -> float:
        return max(3 * self.interval_s, STALE_MIN_S)

    def culprits(self, records: dict[int, dict], now: float, store_reachable: bool = True,
                 waiting_rank: int | None = None) -> list[dict]:
        """Ranks that never arrived: no record, a stale beat, or (all beating) somewhere other than where
        `waiting_rank` (the rank whose collective timed out) waits, else than where most ranks are."""
        out = []
        for r in range(self.world_size):
            rec = records.get(r)
            if rec is None:
                reason = "no record (it never started, or the store did not answer)"
                if not store_reachable and r == 0:
                    reason = "the store in its process did not answer (stopped or dead)"
                out.append({"rank": r, "host": None, "pid": None, "reason": reason})
            elif now - rec["beat"] > self.stale_after_s():
                out.append({**self._brief(rec, now), "reason": f"no heartbeat for {now - rec['beat']:.0f}s "
                                                               "(stopped, frozen holding the GIL, or dead)"})
        if out or len(records) < 2:
            return out
        # everyone beats: the ranks that are elsewhere never arrived where the others wait
        places: dict[tuple, list[int]] = {}
        for r, rec in records.items():
            if rec.get("action") == "idle":  # idle workers take part in no collective
                continue
            places.setdefault((rec.get("step"), rec.get("action")), []).append(r)
        if len(places) == 1:
            return []
        majority = max(places.values(), key=len)
        if waiting_rank is not None and waiting_rank in records:
            rec = records[waiting_rank]
            majority = places.get((rec.get("step"), rec.get("action")), majority)
        for (step, action), ranks in places.items():
            if ranks is majority:
                continue
            for r in ranks:
                rec = records[r]
                out.append({**self._brief(rec, now), "reason": f"in '{action}' at step {step} while "
                                                               f"{len(majority)} rank(s) wait elsewhere"})
        return out

    @staticmethod
    def _brief(rec: dict, now: float) -> dict:
        return {"rank": rec["rank"], "host": rec["host"], "pid": rec["pid"], "step": rec.get("step"),
                "action": rec.get("action"), "for_s": round(now - rec["since"], 1)}

    def diagnose(self, trigger: str, error: BaseException | None = None) -> dict | None:
        """Called by the rank that saw the hang; returns the diagnosis (None when another rank made it)."""
        start = time.monotonic()
        try:
            first = self.store.add(f"{PREFIX}claim", 1) == 1
        except Exception:
            first = True  # the store is gone: diagnose with what this rank knows
        if not first:
            self._wait_for(f"{PREFIX}done", DIAGNOSE_BUDGET_S)
            return None
        now = time.time()
        records, reachable = self._records()
        culprits = self.culprits(records, now, reachable, waiting_rank=self.rank if error is not None else None)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
        directory = self.run_dir.rstrip("/") + f"/logs/hang-{stamp}"
        with contextlib.suppress(Exception):
            self.store.set(f"{PREFIX}request", json.dumps({"dir": directory, "host": self.host, "time": now}))
        dumped = self._dump_local(directory, records, culprits) if self.stacks else []
        if self.stacks:  # ranks on other hosts answer the request from their heartbeat threads
            others = [r for r, rec in records.items() if rec.get("host") != self.host
                      and r not in {c["rank"] for c in culprits}]
            deadline = time.monotonic() + max(1.0, min(15.0, DIAGNOSE_BUDGET_S - (time.monotonic() - start)))
            while others and time.monotonic() < deadline:
                others = [r for r in others if not self._check(f"{PREFIX}dumped/{r}")]
                time.sleep(0.2)
            dumped += [r for r, rec in records.items() if rec.get("host") != self.host and r not in others
                       and r not in {c["rank"] for c in culprits}]
        waiting = [self._brief(rec, now) for r, rec in sorted(records.items())
                   if r not in {c["rank"] for c in culprits}]
        diagnosis = {"trigger": trigger, "culprits": culprits, "waiting": waiting, "stacks": directory,
                     "stacks_written": sorted(dumped), "diagnosed_by": self.rank, "store_reachable": reachable,
                     "records": {str(r): rec for r, rec in sorted(records.items())}}
        with contextlib.suppress(Exception):
            _write(directory, "ranks.json", json.dumps(diagnosis, indent=1, default=str))
            if error is not None:
                _write(directory, f"rank-{self.rank}-error.txt",
                       "".join(traceback.format_exception(type(error), error, error.__traceback__)))
        self.diagnosis = diagnosis
        if self.on_hang is not None:
            with contextlib.suppress(Exception):
                self.on_hang(diagnosis)
        with contextlib.suppress(Exception):
            self.store.set(f"{PREFIX}done", "1")
        return diagnosis

    def _dump_local(self, directory: str, records: dict[int, dict], culprits: list[dict]) -> list[int]:
        """py-spy for every rank on this host, in parallel; stale ranks are read without pausing them."""
        stale = {c["rank"] for c in culprits if c.get("reason", "").startswith("no heartbeat")}
        local = {r: rec for r, rec in records.items() if rec.get("host") == self.host and rec.get("pid")}
        results: dict[int, tuple[bool, str]] = {}

        def dump(r: int, rec: dict) -> None:
            results[r] = py_spy_dump(rec["pid"], nonblocking=r in stale)

        threads = [threading.Thread(target=dump, args=(r, rec), daemon=True) for r, rec in local.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(PY_SPY_TIMEOUT_S + 5)
        written = []
        for r, rec in sorted(local.items()):
            ok, text = results.get(r, (False, "py-spy did not answer"))
            if not ok and r == self.rank:
                ok, text = True, f"# py-spy could not attach ({text.splitlines()[-1] if text else '?'}); " \
                                 "Python's own frames\n" + python_stacks()
            elif ok:
                text = f"# py-spy dump --pid {rec['pid']}{' --nonblocking' if r in stale else ''}\n" + text
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
            return bool(self.store.check([key]))
        except Exception:
            return False

    def _wait_for(self, key: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._check(key):
            time.sleep(0.2)
