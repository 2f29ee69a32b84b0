"""A strict group's stream (raydist.strict.group): its units run one at a time, in issue order, as on NCCL's
one stream per communicator.

Units (raydist.strict.units) are appended under a lock, so issue order is queue order, and only the queue's
head runs. A unit starts when it becomes the head, from the thread that made it so: the issuing host when the
stream was idle, else the thread that completed the unit before it. So a synchronous collective on an idle
group costs no thread hand-off beyond gloo's own. A collective's gloo works complete on gloo's worker threads
(futures); point-to-point units, and gloo works that have no future, run on the stream's waiter thread: gloo
completes them only while something waits for them.

A gloo operation that times out or loses its peer ends the process (the runtime's watchdog abort, as
ProcessGroupNCCL's watchdog does). A unit that fails otherwise (a fingerprint or a header that does not
match, arguments gloo refuses, the deadlock finder) breaks the stream: every unit not yet completed fails
with its error, and so does every later issue (a communicator that failed stays failed).
"""

from __future__ import annotations

import collections
import functools
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist

from raydist.strict.mode import StrictCollectiveError
from raydist.strict.runtime import StrictRuntime
from raydist.strict.units import CommFailure, StrictWork, Unit, as_strict


@dataclass
class _Part:
    """A collective's gloo work that has no future (the waiter thread waits for it)."""

    unit: Unit
    work: object
    check: Callable[[], None] | None


def works(started) -> list:
    """A collective's gloo works (one, or several for the coalesced collectives gloo lacks), unchecked."""
    return [(work, None) for work in (started if isinstance(started, list) else [started])]


class Stream:
    """`group`'s queue of units and its waiter thread (see the module docstring). `lock` is held while a
    unit is made and queued, retired, or the queue read. The waiter thread keeps the group alive until
    `stop()`."""

    def __init__(self, group: dist.ProcessGroup, runtime: StrictRuntime, name: str):
        self.group, self.runtime = group, runtime
        self.lock = threading.Lock()
        self._units = 0
        self.completed = {"coll": 0, "send": collections.Counter(), "recv": collections.Counter()}
        self.pending: collections.deque[Unit] = collections.deque()  # issued, not completed; [0] runs
        self.broken: StrictCollectiveError | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"raydist-strict-p2p-{name}")
        self._thread.start()

    def enqueue(self, make: Callable[[int], Unit]) -> StrictWork:
        """Queues the unit `make(uid)` returns (made under the lock: issue order is queue order)."""
        if self.broken is not None:
            raise self.broken
        with self.lock:
            self._units += 1
            unit = make(self._units)
            self.pending.append(unit)
            head = len(self.pending) == 1
            unit.claimed = head
        self.runtime.changed()
        if head:  # nothing runs on the stream: it starts now, from this thread
            self._start(unit)
        return StrictWork(unit)

    def _start(self, unit: Unit) -> None:
        """`unit` is the stream's head (claimed by this thread): start it."""
        unit.started = time.time()
        self.runtime.changed()
        if self.broken is not None:
            self._complete(unit, self.broken)
            return
        if unit.post is None:
            self._queue.put(unit)  # point-to-point: the waiter thread
            return
        try:
            parts = unit.post(unit)
        except Exception as exc:  # refused on issue (bad arguments): the host raises it
            self._complete(unit, as_strict(unit, exc))
            return
        if not parts:
            self._complete(unit, None)
        self.attach(unit, parts)

    def attach(self, unit: Unit, parts: list) -> None:
        """Complete `unit` when its gloo `parts` ((work, check to run when it is done)) all are."""
        with self.lock:
            unit.left += len(parts)
        for work, early_check in parts:
            try:
                future = work.get_future()
            except RuntimeError:  # gloo's reduce_scatter has none: the waiter thread waits for it
                self._queue.put(_Part(unit, work, early_check))
                continue
            future.add_done_callback(functools.partial(self._part_done, unit, early_check))

    def _part_done(self, unit: Unit, early_check, future) -> None:
        """A gloo part of a collective completed (on gloo's worker thread)."""
        try:
            future.value()
        except Exception as exc:
            self._part_failed(unit, exc)
            return
        self._part_succeeded(unit, early_check)

    def _part_failed(self, unit: Unit, exc: Exception) -> None:
        """A timeout, or the peer's connection lost: NCCL's watchdog aborts the process."""
        if not unit.done.is_set():  # (else the deadlock finder failed it already and told the host)
            self.runtime.watchdog_abort(self.group, unit, CommFailure(str(exc).splitlines()[0] if str(exc) else
                                                                      type(exc).__name__))

    def _part_succeeded(self, unit: Unit, early_check) -> None:
        if early_check is not None:  # the fingerprints: a mismatch fails the unit without waiting for the rest
            try:
                early_check()
            except StrictCollectiveError as exc:
                self._complete(unit, exc)
                return
        with self.lock:
            unit.left -= 1
            last = unit.left == 0
        if last:
            self._complete(unit, None)

    def _complete(self, unit: Unit, error: BaseException | None) -> None:
        """The stream's head is done (or failed): retire it, tell the host, start the next."""
        if unit.done.is_set():
            return
        self._retire(unit)
        unit.finish(error)
        if error is not None:
            self.fail(error)
        self.runtime.changed()
        with self.lock:
            following = self.pending[0] if self.pending and not self.pending[0].claimed else None
            if following is not None:
                following.claimed = True
        if following is not None:
            self._start(following)

    def _loop(self) -> None:
        """The waiter: runs point-to-point units, which gloo completes only while waited for."""
        while True:
            unit = self._queue.get()
            if unit is None:
                return
            if isinstance(unit, _Part):  # a collective's part without a future
                part = unit
                try:
                    part.unit.wait_gloo(part.work)
                except CommFailure as exc:
                    self._part_failed(part.unit, exc)
                    continue
                self._part_succeeded(part.unit, part.check)
                continue
            if unit.done.is_set():  # failed while queued (the group broke)
                continue
            error = None
            try:
                unit.run(unit)
            except CommFailure as exc:  # a timeout, or the peer's connection lost: NCCL's watchdog aborts
                if unit.done.is_set():  # the deadlock finder already failed it and told the host: stop here
                    return
                self.runtime.watchdog_abort(self.group, unit, exc)
            except Exception as exc:  # a header that does not match what was asked for
                error = as_strict(unit, exc)
            self._complete(unit, error)

    def _retire(self, unit: Unit) -> None:
        with self.lock:
            if self.pending and self.pending[0] is unit:
                self.pending.popleft()
            for op in unit.ops:
                if op.kind == "coll":
                    self.completed["coll"] = op.n
                else:
                    self.completed[op.kind][op.peer] = op.n + 1

    def fail(self, error: StrictCollectiveError) -> None:
        """Break the stream: every unit not yet completed fails with `error` (so no host waits forever)."""
        self.broken = self.broken or error
        with self.lock:
            units = list(self.pending)
        for unit in units:
            unit.finish(error)

    def stop(self) -> None:
        """Ends the waiter thread."""
        self._queue.put(None)
