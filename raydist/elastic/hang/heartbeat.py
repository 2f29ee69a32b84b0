"""The hang monitor's heartbeat: each rank's record of what it is doing, published for a diagnosis
(raydist.elastic.hang.diagnosis) to read.

Each rank keeps a record of what it is doing (`ACTIONS`): the step, the action (a phase of the step, a
collective with its group, a pipeline action with its micro-batch and stage, a checkpoint save...) and
since when. Setting it is two attribute writes; collectives called through `torch.distributed`'s Python
functions are recorded by wrappers `track_collectives()` installs in Ray workers. On NCCL the host runs
ahead of the GPU, so the action says where the host is; what the communicators still wait for comes from
a flight source (raydist.elastic.inflight: NCCL's flight recorder, or the strict-collectives mode's own record).

`Heartbeat` (one per Ray Train worker, a daemon thread) every `monitor.heartbeat_interval_s`:
- publishes the record to the attempt's TCP store (through a `BoundedStore`: the store's server lives in
  rank 0's process, which may be the one that is stopped, and a stopped server blocks a client forever):

      raydist/hang/rank/<r>   {"rank", "host", "pid", "step", "action", "since", "beat",
                               "inflight": {group: {"ranks", "issued", "head": {"seq", "op", ...}, "pending"}}}

  ("inflight" only where a flight source watches this rank's groups);
- reads every rank's record into its own view (`view`), so that a diagnosis without the store still knows
  rank 0's pid, host and action;
- where a flight source watches (NCCL, the strict mode), asks it for this rank's pending ops every
  `inflight.poll_s(...)` and, when one has waited longer than `elastic.collective_timeout_s`, calls
  `on_stuck(op)` once (raydist.elastic.hang.trigger);
- answers a diagnosis's request for stacks: a rank on another host than the diagnoser's writes its own.

The thread keeps beating while the training thread waits in a collective (the wait releases the GIL), so a
rank whose beat stops is stopped (SIGSTOP, a debugger), frozen in native code holding the GIL, or dead. It
also notices when its own process did not run for a while (`frozen`: it woke up long after it should have).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import math
import os
import socket
import threading
import time
from typing import Any, Callable

import torch.distributed as dist

from raydist.elastic import inflight
from raydist.elastic.bounded_store import STORE_TIMEOUT_S, BoundedStore
from raydist.elastic.hang import trigger
from raydist.elastic.stacks import own_stack
from raydist.metrics.actions import ACTIONS
from raydist.store.run_store import RunStore

PREFIX = "raydist/hang/"
STALE_MIN_S = 5.0


# ---- the record: collectives called through torch.distributed --------------------------------------

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


# ---- the heartbeat ---------------------------------------------------------------------------------


def write_file(directory_uri: str, name: str, text: str) -> None:
    """`text` as the file `name` under `directory_uri` (a path or an fsspec URI), written whole."""
    RunStore(directory_uri).write_text(name, text)


class Heartbeat:
    """The per-rank heartbeat thread (see the module doc).

    collective_timeout_s / on_stuck: where given, the heartbeat watches this rank's in-flight collectives
    (flight=True publishes them) and calls `on_stuck(op)` once, from its thread, for the first op pending
    longer than that."""

    def __init__(self, rank: int, world_size: int, run_dir: str, interval_s: float = 2.0, stacks: bool = True,
                 store: Any = None, flight: bool = False, collective_timeout_s: float | None = None,
                 on_stuck: Callable[[dict], None] | None = None):
        self.rank, self.world_size, self.run_dir = rank, world_size, run_dir
        self.interval_s, self.stacks = interval_s, stacks
        self.host, self.pid = socket.gethostname(), os.getpid()
        store = store if store is not None else self._client()
        self.store = store if isinstance(store, BoundedStore) else BoundedStore(store)
        self.flight, self.collective_timeout_s, self.on_stuck = flight, collective_timeout_s, on_stuck
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

    def start(self) -> "Heartbeat":
        with contextlib.suppress(Exception):
            self.beat()
        self._thread.start()
        if self.flight and self.collective_timeout_s is not None and self.on_stuck is not None:
            trigger.WATCHING.set()  # groups created from now on may time out later (group_timeout_s)
        return self

    def stop(self) -> None:
        self._stop.set()
        trigger.WATCHING.clear()

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
        write_file(directory, f"rank-{rank}.txt", header + text)
