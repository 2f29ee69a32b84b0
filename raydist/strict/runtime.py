"""One per process under the strict mode: the strict groups, what the host waits on, the deadlock finder,
the watchdog's abort, and the flight record hang diagnosis reads.

The finder (a daemon thread) wakes every POLL_S. When one of this rank's units has run, or its host has
waited, for STALL_S, it publishes its state (raydist.strict.deadlock) under `raydist/strict/state/<rank>` in
the world's store, reads every rank's fresh state and looks for a deadlock that includes it; one found with
the same states twice in a row (nothing moved in between) fails this rank's stuck units with the deadlock's
description, which the blocked host raises. A rank that does not answer (stopped, or its store is frozen)
simply never confirms one: the group's timeout then aborts the process, as NCCL's watchdog would.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import weakref

import torch.distributed as dist

from raydist.strict import deadlock
from raydist.strict.mode import StrictCollectiveError

POLL_S = 0.5
STALL_S = 1.0
FRESH_S = 3.0
PREFIX = "raydist/strict/"


def root_store(store: dist.Store) -> dist.Store:
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


class StrictRuntime:
    def __init__(self, store: dist.Store, rank: int):
        self.store = dist.PrefixStore(PREFIX, root_store(store))
        self.rank = rank
        self.groups: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()
        self.waits: dict[int, tuple[object, float]] = {}  # host thread id -> (unit, since)
        self.rendezvous: tuple[str, int, int, float] | None = None  # (kind, k, world, since) of a creation
        self.rendezvous_error: StrictCollectiveError | None = None
        self.version = 0
        self.splits = 0  # this rank's splits of the world so far (raydist.strict.splits)
        self.world_group = None  # the default group (StrictProcessGroup)
        self.bound = False  # whether the world group is device-bound (`bind`): groups are then splits of it
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.found: deadlock.Deadlock | None = None
        self._thread = threading.Thread(target=self._watch, daemon=True, name="raydist-strict-deadlocks")
        self._thread.start()

    # ---- bookkeeping ---------------------------------------------------------------------------------------
    def register(self, group) -> None:
        self.groups[group.group_name or f"unnamed-{id(group)}"] = group

    def changed(self) -> None:
        self.version += 1

    def wait(self, unit) -> bool:
        """The host blocks until `unit` completes (its error raised)."""
        if not unit.done.is_set():
            me = threading.get_ident()
            with self._lock:
                self.waits[me] = (unit, time.time())
            self.changed()
            try:
                while not unit.done.wait(POLL_S):
                    pass
            finally:
                with self._lock:
                    self.waits.pop(me, None)
                self.changed()
        if unit.error is not None:
            raise unit.error
        return True

    def _groups(self) -> list:
        return [g for g in list(self.groups.values()) if g is not None]

    def state(self) -> dict:
        with self._lock:
            waits = [[unit.group.group_name, unit.id] for unit, _ in self.waits.values()]
        rendezvous = self.rendezvous
        return {"rank": self.rank, "time": time.time(), "version": self.version, "waits": waits,
                "rendezvous": list(rendezvous[:2]) if rendezvous else None,
                "world": rendezvous[2] if rendezvous else 0,
                "posted": {"split": self.splits, "bind": self.bound or bool(rendezvous and rendezvous[0] == "bind")},
                "groups": {g.group_name: g.state() for g in self._groups()}}

    def stalled_since(self) -> float | None:
        times = [since for _, since in list(self.waits.values())]
        if self.rendezvous is not None:
            times.append(self.rendezvous[3])
        for group in self._groups():
            pending = list(group.stream.pending)
            if pending and pending[0].started is not None:
                times.append(pending[0].started)
        return min(times) if times else None

    # ---- the deadlock finder -----------------------------------------------------------------------------
    def _read(self, world: int) -> dict[int, dict]:
        states, now = {}, time.time()
        for r in range(world):
            key = f"state/{r}"
            if r == self.rank or not self.store.check([key]):
                continue
            state = json.loads(self.store.get(key))
            if now - state["time"] <= FRESH_S:
                states[r] = state
        return states

    def _watch(self) -> None:
        suspect = None
        while not self._stop.wait(POLL_S):
            try:
                since = self.stalled_since()
                if since is None or time.time() - since < STALL_S or not dist.is_initialized():
                    suspect = None
                    continue
                mine = self.state()
                self.store.set(f"state/{self.rank}", json.dumps(mine))
                states = self._read(dist.get_world_size())
                states[self.rank] = mine
                differ = deadlock.mismatch(states, self.rank)
                if differ is not None:
                    self._fail_groups(*differ)
                    continue
                found = deadlock.find(states, me=self.rank)
                if found is None:
                    suspect = None
                    continue
                key = (found.nodes, tuple(sorted((r, states[r]["version"]) for r in found.ranks)))
                if key == suspect:
                    self._fail(found)
                suspect = key
            except Exception:  # the store is slow or gone: the timeout stays the backstop
                continue

    def _fail(self, found: deadlock.Deadlock) -> None:
        self.found = found
        error = StrictCollectiveError(found.message())
        print(f"rank {self.rank}: {found.message()}", flush=True)
        for node in found.nodes:
            if node[1] != self.rank:
                continue
            if node[0] == "rendezvous":
                self.rendezvous_error = error
            else:
                group = self.groups.get(node[2])
                if group is not None:
                    group.stream.fail(error)

    def _fail_groups(self, message: str, names: list[str]) -> None:
        print(f"rank {self.rank}: {message}", flush=True)
        error = StrictCollectiveError(message)
        for name in names:
            group = self.groups.get(name)
            if group is not None:
                group.stream.fail(error)

    def watchdog_abort(self, group, unit, exc: BaseException) -> None:
        lines = [f"rank {self.rank}: strict collectives watchdog: {unit.describe()} on {group.describe()} did not "
                 f"complete ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); ending the "
                 "process as NCCL's watchdog does (TORCH_NCCL_ASYNC_ERROR_HANDLING), pending operations:"]
        lines += [f"  {p['group']} #{p['seq']} {p['op']} ({p['state']} for {time.time() - p['since']:.1f}s)"
                  for p in self.pending()]
        abort_process("\n".join(lines))

    # ---- the flight record ---------------------------------------------------------------------------------
    def pending(self) -> list[dict]:
        """Every strict group's operations issued and not completed, the running one first per group:
        {"group", "ranks", "seq", "op", "state" ("started" | "queued"), "since", "kind"} where seq is the
        collective's sequence number on its group (for a point-to-point unit: the unit's number on the group)."""
        out = []
        for group in self._groups():
            for unit in list(group.stream.pending):
                coll = [op for op in unit.ops if op.kind == "coll"]
                out.append({"group": group.group_name, "ranks": list(group.global_ranks),
                            "seq": coll[0].n if coll else unit.id, "op": unit.describe(),
                            "state": "started" if unit.started is not None else "queued", "since": unit.issued,
                            "kind": "collective" if coll else "p2p"})
        return out

    def counters(self) -> dict[str, dict[str, int]]:
        """Per group: collectives issued and completed (what a diagnosis compares across ranks)."""
        return {g.group_name: {"issued": g.state()["issued_coll"], "completed": g.stream.completed["coll"]}
                for g in self._groups()}

    def stop(self) -> None:
        self._stop.set()


_RUNTIME: StrictRuntime | None = None


def runtime_for(store: dist.Store, rank: int, world: bool) -> StrictRuntime:
    """This process's runtime: a new one with each world (default) group, which comes first; `rank` is the
    world rank."""
    global _RUNTIME
    if world or _RUNTIME is None:
        if _RUNTIME is not None:
            _RUNTIME.stop()
        _RUNTIME = StrictRuntime(store, rank)
    return _RUNTIME


def current() -> StrictRuntime | None:
    return _RUNTIME


def abort_process(message: str) -> None:
    """What NCCL's watchdog does on a timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING): say why, then abort."""
    print(message, file=sys.stderr, flush=True)
    os.abort()
