"""The operations a strict group runs (raydist.strict.group): each is a `Unit` on the group's stream.

A unit is one collective, one send or receive, or one `batch_isend_irecv` batch; its `Op`s say what it holds
(a collective's sequence number on its group, a message's index on its (sender, receiver) pair). A unit's
`Work` (`StrictWork`) is waited on by the host (`StrictWork.wait`), or its future is read by DDP's reducer
and torch's functional collectives (the trampoline of torch's Python ProcessGroup routes them here).

A gloo operation of a unit that times out (counted from the unit's issue, as NCCL's watchdog counts) or
loses its peer is a `CommFailure`: what ProcessGroupNCCL's watchdog would abort the process for.
"""

from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.futures import Future

from raydist.strict.mode import StrictCollectiveError


@dataclass(frozen=True)
class Op:
    """One operation of a unit. `n`: a collective's sequence number on its group (1-based), or a message's
    index on its (sender, receiver) pair of the group (0-based); `peer`: the other rank (global), -1 for
    collectives."""

    kind: str  # "coll", "send" or "recv"
    name: str  # all_reduce, ..., isend, irecv
    n: int
    peer: int = -1
    tag: int = 0
    shape: tuple = ()
    dtype: torch.dtype | None = None

    @property
    def size(self) -> str:
        """Shape and dtype, formatted only when a message or a state needs them."""
        return f"{tuple(self.shape)} {str(self.dtype).replace('torch.', '')}" if self.dtype is not None else ""

    def describe(self) -> str:
        if self.kind == "coll":
            return f"{self.name} #{self.n}"
        arrow = f"to rank {self.peer}" if self.kind == "send" else f"from rank {self.peer}"
        return f"{self.name} {arrow} (message {self.n} of the pair, tag {self.tag}, {self.size})"

    def state(self) -> list:
        return [self.kind, self.name, self.n, self.peer, self.tag, self.size]


class CommFailure(Exception):
    """A gloo operation timed out or lost its peer: what NCCL's watchdog would abort the process for."""


class Unit:
    """What the stream runs as one: a collective, one send/receive, or one batch of them.

    `group` is the StrictProcessGroup whose stream it is on. A collective's `post()` starts its gloo
    operations (whichever thread makes it the stream's head: the issuing host, or the thread that completed
    the unit before it) and returns them, each with the check to run when gloo's worker threads complete it;
    a point-to-point unit's `run()` runs on the group's waiter thread (gloo completes a send or a receive
    only while something waits for it)."""

    def __init__(self, group: dist.ProcessGroup, uid: int, ops: list[Op], outputs: list[torch.Tensor], *,
                 post: Callable[["Unit"], list] | None = None, run: Callable[["Unit"], None] | None = None):
        self.group, self.id, self.ops, self.outputs = group, uid, ops, outputs
        self.post, self.run = post, run
        self.issued = time.time()
        self.claimed = False  # made the stream's head by some thread (under the group's lock)
        self.started: float | None = None
        self.left = 0  # gloo parts not completed
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._future: Future | None = None
        self._future_lock = threading.Lock()

    def describe(self) -> str:
        if len(self.ops) == 1:
            return self.ops[0].describe()
        return "batch [" + ", ".join(op.describe() for op in self.ops) + "]"

    @property
    def future(self) -> Future:
        """Made when first asked for (DDP's reducer and functional collectives ask; most callers wait)."""
        with self._future_lock:
            if self._future is None:
                self._future = Future()
                if self.done.is_set():
                    self._settle(self._future)
            return self._future

    def _settle(self, future: Future) -> None:
        if self.error is None:
            future.set_result(self.outputs)
        else:
            future.set_exception(self.error)

    def finish(self, error: BaseException | None) -> bool:
        """Complete (or fail) once; False if it already was."""
        with self._future_lock:
            if self.done.is_set():
                return False
            self.error = error
            self.done.set()
            future = self._future
        if future is not None:
            self._settle(future)
        return True

    def wait_gloo(self, work) -> None:
        """Wait for one of this unit's gloo works within the group's timeout (from the unit's issue, as
        NCCL's watchdog counts); a timeout or a lost peer is a `CommFailure` (the watchdog's business)."""
        timeout = self.group.timeout
        left = self.issued + timeout.total_seconds() - time.time()
        try:
            finished = left > 0 and work.wait(datetime.timedelta(seconds=left))
        except Exception as exc:
            raise CommFailure(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
        if not finished:
            raise CommFailure(f"timed out after {timeout.total_seconds():.0f}s")

    def state(self) -> dict:
        return {"id": self.id, "started": self.started is not None, "ops": [op.state() for op in self.ops]}


class StrictWork(dist.Work):
    def __init__(self, unit: Unit):
        super().__init__()
        self.unit = unit

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 (NCCL's wait is not bounded by the caller either)
        return self.unit.group.runtime.wait(self.unit)

    def is_completed(self) -> bool:
        return self.unit.done.is_set()

    def is_success(self) -> bool:
        return self.unit.done.is_set() and self.unit.error is None

    def get_future(self) -> Future:
        return self.unit.future


def as_strict(unit: Unit, exc: Exception) -> StrictCollectiveError:
    """`exc` as the error the host raises for `unit` (a StrictCollectiveError names the unit and its group)."""
    if isinstance(exc, StrictCollectiveError):
        return exc
    return StrictCollectiveError(f"strict collectives: {unit.describe()} on {unit.group.describe()} failed: "
                                 f"{type(exc).__name__}: {exc}")
