"""`StrictProcessGroup`: a process group over gloo that runs its operations as NCCL runs them.

Each group holds two gloo process groups (`inner` for the operations, `side` for the collectives'
fingerprints) and a queue: every operation the group is asked for becomes a `Unit` (one collective, one
send or receive, or one `batch_isend_irecv` batch) appended under a lock, so issue order is queue order,
and only the queue's head runs (NCCL's one stream per communicator). A unit starts when it becomes the
head, from the thread that made it so: the issuing host when the stream was idle, else the thread that
completed the unit before it. So a synchronous collective on an idle group costs no thread hand-off beyond
gloo's own.

    collective:  the gloo collective; each of the group's first CHECK_EACH_UNTIL collectives starts only
                 after an all-gather of the fingerprints (kind, sequence number, dtype, size, root,
                 reduction) over the side group found them equal (a mismatch fails the unit naming both
                 ops; run, a collective of mismatched sizes would end the process inside gloo, or hang);
                 then every CHECK_EVERY collectives the fingerprints since the last check go beside the
                 collective and are compared as they arrive. gloo's worker threads complete both (futures)
    point-to-point batch:  every send and receive posted at once (none of the unit waits for another, as in
                 an NCCL group call), each message one gloo message of a header (the sender's tag, size,
                 dtype) and the data, on a gloo tag made from the message's index on its (sender, receiver)
                 pair, so messages match by issue order per pair whatever the caller's tags; the receiver
                 checks the header. gloo completes sends and receives only while something waits for them,
                 so these units run on the group's waiter thread; gloo's TCP sends do not complete before
                 their receive is posted: nothing buffers

A unit's `Work` is waited on by the host (`StrictWork.wait`), or its future is read by DDP's reducer and
torch's functional collectives (the trampoline of torch's Python ProcessGroup routes them here).

Timeouts: an operation not done at the group's timeout ends the process (os.abort after one line on stderr
and the rank's pending operations), as ProcessGroupNCCL's watchdog does; so does a lost peer. A unit that the
deadlock finder fails (raydist.strict.runtime) raises `StrictCollectiveError` in the waiting host instead,
naming the cycle, and the group stays broken (a communicator that failed stays failed).
"""

from __future__ import annotations

import collections
import datetime
import functools
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.futures import Future

from raydist.strict.mode import BACKEND, StrictCollectiveError
from raydist.strict.runtime import runtime_for

OPCODES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
           "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "reduce", "gather", "scatter",
           "all_reduce_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced",
           "all_gather_coalesced")
# dtypes NCCL carries (bool as uint8); the index is the fingerprint's code
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)
HEADER_BYTES = 24  # a message's header: tag, numel, dtype code (int64 each)
CHECK_EACH_UNTIL = 32  # a group's first collectives are each checked before the next runs (setup, short tests)
CHECK_EVERY = 8  # then the fingerprints of every 8 collectives in one all-gather
NCCL_REDUCTIONS = (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX,
                   dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM)  # (RedOpType values)


def _dtype_code(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype) if dtype in DTYPES else -1


def _dtype_name(code: int) -> str:
    return str(DTYPES[code]).replace("torch.", "") if 0 <= code < len(DTYPES) else "none"


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

    A collective's `post()` starts its gloo operations (whichever thread makes it the stream's head: the
    issuing host, or the thread that completed the unit before it) and returns them, each with the check to
    run when gloo's worker threads complete it; a point-to-point unit's `run()` runs on the group's waiter thread (gloo
    completes a send or a receive only while something waits for it)."""

    def __init__(self, group: "StrictProcessGroup", uid: int, ops: list[Op], outputs: list[torch.Tensor], *,
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

    def state(self) -> dict:
        return {"id": self.id, "started": self.started is not None, "ops": [op.state() for op in self.ops]}


@dataclass
class _Part:
    """A collective's gloo work that has no future (the waiter thread waits for it)."""

    unit: Unit
    work: object
    check: Callable[[], None] | None


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


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.is_contiguous() else tensor.contiguous()


class StrictProcessGroup(dist.ProcessGroup):
    """See the module docstring. `global_ranks[i]` is the world rank of group rank i."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, name: str,
                 global_ranks: list[int]):
        super().__init__(rank, size)
        self._name, self._desc = name, "undefined"
        self.global_ranks = list(global_ranks) or list(range(size))
        self.timeout = timeout
        self.inner = dist.ProcessGroupGloo(dist.PrefixStore("strict_gloo/", store), rank, size, timeout)
        # the collectives' fingerprints travel on connections of their own (see _collective)
        self.side = dist.ProcessGroupGloo(dist.PrefixStore("strict_side/", store), rank, size, timeout)
        self.runtime = runtime_for(store, self.global_ranks[rank], world=not global_ranks)
        if not global_ranks:
            self.runtime.world_group = self
        self._lock = threading.Lock()
        self._units = 0
        self._collectives = 0
        self._issued: dict[tuple[str, int], int] = collections.defaultdict(int)  # (send|recv, peer group rank)
        self.completed = {"coll": 0, "send": collections.Counter(), "recv": collections.Counter()}
        self._unchecked: list[tuple[Op, list[int]]] = []  # collectives run, fingerprints not yet compared
        self.pending: collections.deque[Unit] = collections.deque()  # issued, not completed; [0] runs
        self.broken: StrictCollectiveError | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"raydist-strict-p2p-{name}")
        self._thread.start()
        self.runtime.register(self)

    # ---- identity (what torch asks a Python process group) ---------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 (torch's C++ name)
        return BACKEND

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    @property
    def group_name(self) -> str:
        return self._name

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device("cpu")]

    def describe(self) -> str:
        return f"group '{self._name}' (ranks {self.global_ranks})"

    # ---- issue -----------------------------------------------------------------------------------------
    def _check(self, name: str, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if getattr(t, "_raydist_host", False):
                raise StrictCollectiveError(
                    f"strict collectives: {name} of a host tensor {tuple(t.shape)} {t.dtype} on device "
                    f"{self.describe()}: NCCL rejects CPU tensors; create it on the training device "
                    "(device=...) or use a HOST group (raydist.strict.purposes.new_group(..., HOST, ...))")
            if t.is_sparse:
                raise StrictCollectiveError(f"strict collectives: {name} of a sparse tensor on {self.describe()}: "
                                            "NCCL takes dense tensors only")
            if _dtype_code(t.dtype) < 0:
                raise StrictCollectiveError(f"strict collectives: {name} of a {t.dtype} tensor on {self.describe()}: "
                                            f"NCCL carries {', '.join(_dtype_name(i) for i in range(len(DTYPES)))}")

    def _reduction(self, name: str, op) -> int:
        kind = getattr(op, "op", op)  # a ReduceOp's RedOpType
        if not any(kind == allowed for allowed in NCCL_REDUCTIONS):
            raise StrictCollectiveError(f"strict collectives: {name} with reduction {kind} on {self.describe()}: "
                                        "NCCL has no bitwise reductions (SUM, PRODUCT, MIN, MAX, AVG only)")
        return int(kind)

    def _enqueue(self, make: Callable[[int], Unit]) -> StrictWork:
        if self.broken is not None:
            raise self.broken
        with self._lock:
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
            self._complete(unit, _as_strict(unit, self, exc))
            return
        if not parts:
            self._complete(unit, None)
        self._attach(unit, parts)

    @staticmethod
    def _works(started) -> list:
        """A collective's gloo works (one, or several for the coalesced collectives gloo lacks), unchecked."""
        return [(work, None) for work in (started if isinstance(started, list) else [started])]

    def _attach(self, unit: Unit, parts: list) -> None:
        """Complete `unit` when its gloo `parts` ((work, check to run when it is done)) all are."""
        with self._lock:
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
            self.runtime.watchdog_abort(self, unit, CommFailure(str(exc).splitlines()[0] if str(exc) else
                                                                type(exc).__name__))

    def _part_succeeded(self, unit: Unit, early_check) -> None:
        if early_check is not None:  # the fingerprints: a mismatch fails the unit without waiting for the rest
            try:
                early_check()
            except StrictCollectiveError as exc:
                self._complete(unit, exc)
                return
        with self._lock:
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
        with self._lock:
            following = self.pending[0] if self.pending and not self.pending[0].claimed else None
            if following is not None:
                following.claimed = True
        if following is not None:
            self._start(following)

    def _collective(self, name: str, tensors: list[torch.Tensor], outputs: list[torch.Tensor],
                    run: Callable[[], "dist.Work | list[dist.Work]"], *, numel: int = -1, root: int = -1, reduce_op=None) -> StrictWork:
        self._check(name, tensors)
        reduction = -1 if reduce_op is None else self._reduction(name, reduce_op)
        dtype = _dtype_code(tensors[0].dtype) if tensors else -1
        shape, torch_dtype = (tuple(tensors[0].shape), tensors[0].dtype) if tensors else ((), None)

        def make(uid: int) -> Unit:
            self._collectives += 1
            op = Op("coll", name, self._collectives, shape=shape, dtype=torch_dtype)
            fingerprint = [OPCODES.index(name), op.n, dtype, numel, root, reduction]

            def post(unit: Unit) -> list:
                # Each of the first CHECK_EACH_UNTIL collectives starts only once the fingerprints agree:
                # gloo ends the process (a C++ enforce, before any Python sees it) on a collective of
                # mismatched sizes, which the check names instead. Later checks (every CHECK_EVERY) go
                # beside the collective, so a steady state pays no extra round trip: a mismatch there is
                # named when they arrive, unless gloo has ended the process first. The side group's
                # connections are ones such a collective cannot break.
                self._unchecked.append((op, fingerprint))
                if self.size() > 1 and (op.n <= CHECK_EACH_UNTIL or len(self._unchecked) >= CHECK_EVERY):
                    pending, self._unchecked = self._unchecked, []
                    mine = torch.tensor([fp for _, fp in pending], dtype=torch.int64).reshape(-1)
                    rows = torch.empty(self.size() * mine.numel(), dtype=torch.int64)
                    agree = functools.partial(self._agree, pending, rows)

                    def agree_then_run() -> None:
                        agree()
                        try:
                            started = run()
                        except Exception as exc:  # refused by gloo (bad arguments): the host raises it
                            raise _as_strict(unit, self, exc) from exc
                        self._attach(unit, self._works(started))

                    gathered = self.side._allgather_base(rows, mine)
                    if op.n <= CHECK_EACH_UNTIL:
                        return [(gathered, agree_then_run)]
                    return [(gathered, agree), *self._works(run())]  # later checks ride beside it
                return self._works(run())

            return Unit(self, uid, [op], outputs, post=post)

        return self._enqueue(make)

    def _agree(self, pending: list[tuple[Op, list[int]]], rows: torch.Tensor) -> None:
        """Every member issued the same collectives, in the same order, as this rank since the last check;
        or name the first that differs. Each of the group's first CHECK_EACH_UNTIL collectives is checked on
        its own, then every CHECK_EVERY together, always at the same sequence numbers on every member. A
        mismatch that hangs before its check is named by the deadlock finder (deadlock.mismatch)."""
        width = len(pending[0][1])
        every = rows.view(self.size(), len(pending), width).tolist()
        for i, (op, fp) in enumerate(pending):
            for r, theirs in enumerate(every):
                row = theirs[i]
                same = row[:3] == fp[:3] and row[4:] == fp[4:]
                if same and (row[3] == fp[3] or -1 in (row[3], fp[3])):
                    continue
                other = (f"{OPCODES[row[0]] if 0 <= row[0] < len(OPCODES) else '?'} #{row[1]} "
                         f"({_dtype_name(row[2])}, {row[3]} elements, root {row[4]}, reduction {row[5]})")
                ours = (f"{op.name} #{op.n} ({_dtype_name(fp[2])}, {fp[3]} elements, root {fp[4]}, "
                        f"reduction {fp[5]})")
                raise StrictCollectiveError(
                    f"strict collectives: {self.describe()}: rank {self.global_ranks[self.rank()]} issued {ours} "
                    f"where rank {self.global_ranks[r]} issued {other}; NCCL needs every member to issue a "
                    "group's collectives in the same order with the same kind, dtype, size and root (it would "
                    "hang or mix the data)")

    def _p2p(self, entries: list[tuple[str, torch.Tensor, int, int]]) -> list[StrictWork]:
        """entries: (send|recv, tensor, peer group rank, caller's tag); one unit."""
        self._check("batch_isend_irecv" if len(entries) > 1 else entries[0][0], [e[1] for e in entries])
        for kind, _, peer, _ in entries:
            if not 0 <= peer < self.size():
                raise ValueError(f"{kind} peer {peer} is not a rank of {self.describe()}")

        def make(uid: int) -> Unit:
            ops = []
            for kind, tensor, peer, tag in entries:
                n = self._issued[(kind, peer)]
                self._issued[(kind, peer)] += 1
                ops.append(Op(kind, "isend" if kind == "send" else "irecv", n, self.global_ranks[peer], tag,
                              tuple(tensor.shape), tensor.dtype))
            return Unit(self, uid, ops, [e[1] for e in entries], run=lambda unit: self._run_p2p(unit, entries))

        work = self._enqueue(make)
        return [work] * len(entries)

    def _slot(self, sender: int, receiver: int, n: int, data: bool) -> int:
        """A gloo tag for message n of the (sender, receiver) pair: its header or its data."""
        return (n * 2 + int(data)) * 2 + int(sender < receiver)

    def _run_p2p(self, unit: Unit, entries: list[tuple[str, torch.Tensor, int, int]]) -> None:
        """Every operation is posted at once (NCCL's group semantics: none waits for another of the unit). A
        message is one gloo message: a header (the sender's tag, size, dtype) then the tensor's bytes; the
        receiver checks the header against what it asked for."""
        me = self.rank()
        works, receives = [], []
        for op, (kind, tensor, peer, tag) in zip(unit.ops, entries):
            data = _contiguous(tensor).view(-1).view(torch.uint8)
            if kind == "send":
                header = torch.tensor([tag, tensor.numel(), _dtype_code(tensor.dtype)], dtype=torch.int64)
                message = torch.cat([header.view(torch.uint8), data])
                works.append((self.inner.send([message], peer, self._slot(me, peer, op.n, True)), message))
            else:
                message = torch.empty(HEADER_BYTES + data.numel(), dtype=torch.uint8)
                receives.append((op, tensor, message))
                works.append((self.inner.recv([message], peer, self._slot(peer, me, op.n, True)), message))
        for work, _ in works:
            self._wait_inner(unit, work)
        for op, tensor, message in receives:
            tag, numel, dtype = message[:HEADER_BYTES].view(torch.int64).tolist()
            if (numel, dtype) != (tensor.numel(), _dtype_code(tensor.dtype)) or tag != op.tag:
                raise StrictCollectiveError(
                    f"strict collectives: {self.describe()}: rank {self.global_ranks[me]}'s {op.describe()} is "
                    f"matched by rank {op.peer}'s message {op.n} to it, sent with tag {tag}, {numel} elements of "
                    f"{_dtype_name(dtype)}: NCCL matches messages by issue order per pair, not by tag, so the "
                    "two ranks must issue them in the same order")
            payload = message[HEADER_BYTES:]
            if tensor.is_contiguous():
                tensor.view(-1).view(torch.uint8).copy_(payload)
            else:
                tensor.copy_(payload.view(tensor.dtype).view(tensor.shape))

    def _wait_inner(self, unit: Unit, work) -> None:
        """Wait for a gloo work within the unit's timeout (from its issue, as NCCL's watchdog counts); a
        timeout or a lost peer is a `CommFailure` (the watchdog's business)."""
        left = unit.issued + self.timeout.total_seconds() - time.time()
        try:
            finished = left > 0 and work.wait(datetime.timedelta(seconds=left))
        except Exception as exc:
            raise CommFailure(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
        if not finished:
            raise CommFailure(f"timed out after {self.timeout.total_seconds():.0f}s")

    # ---- the stream --------------------------------------------------------------------------------------
    def _loop(self) -> None:
        """The waiter: runs point-to-point units, which gloo completes only while waited for."""
        while True:
            unit = self._queue.get()
            if unit is None:
                return
            if isinstance(unit, _Part):  # a collective's part without a future
                part = unit
                try:
                    self._wait_inner(part.unit, part.work)
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
                self.runtime.watchdog_abort(self, unit, exc)
            except Exception as exc:  # a header that does not match what was asked for
                error = _as_strict(unit, self, exc)
            self._complete(unit, error)

    def _retire(self, unit: Unit) -> None:
        with self._lock:
            if self.pending and self.pending[0] is unit:
                self.pending.popleft()
            for op in unit.ops:
                if op.kind == "coll":
                    self.completed["coll"] = op.n
                else:
                    self.completed[op.kind][op.peer] = op.n + 1

    def fail(self, error: StrictCollectiveError) -> None:
        """Break the group: every unit not yet completed fails with `error` (so no host waits forever)."""
        self.broken = self.broken or error
        with self._lock:
            units = list(self.pending)
        for unit in units:
            unit.finish(error)

    def state(self) -> dict:
        """For the deadlock finder: pending units in order, and what completed (global peers)."""
        with self._lock:
            return {"ranks": self.global_ranks, "units": [u.state() for u in self.pending],
                    "coll": self.completed["coll"],
                    "send": {str(p): n for p, n in self.completed["send"].items()},
                    "recv": {str(p): n for p, n in self.completed["recv"].items()},
                    "issued_coll": self._collectives}

    def shutdown(self) -> None:
        self._queue.put(None)
        if self.global_ranks == list(range(self.size())) and self.runtime.world_group is self:
            try:  # a rank leaving the world: a creation waiting for it fails at once (raydist.strict.splits)
                self.runtime.store.set(f"gone/{self.runtime.rank}", "1")
            except Exception:
                pass

    # ---- torch's ProcessGroup methods (names across torch 2.11-2.13) ------------------------------------
    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        return self._collective("all_reduce", tensors, tensors, lambda: self.inner.allreduce(tensors, opts),
                                numel=sum(t.numel() for t in tensors), reduce_op=opts.reduceOp)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        return self._collective("all_reduce_coalesced", tensors, tensors,
                                lambda: self.inner.allreduce_coalesced(tensors, opts),
                                numel=sum(t.numel() for t in tensors), reduce_op=opts.reduceOp)

    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        return self._collective("broadcast", tensors, tensors, lambda: self.inner.broadcast(tensors, opts),
                                numel=sum(t.numel() for t in tensors), root=opts.rootRank)

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts or dist.AllgatherOptions()
        return self._collective("all_gather", inputs, [t for ts in output_lists for t in ts],
                                lambda: self.inner.allgather(output_lists, inputs, opts),
                                numel=sum(t.numel() for t in inputs))

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        opts = opts or dist.AllgatherOptions()
        return self._collective("all_gather_coalesced", inputs, [t for ts in output_lists for t in ts],
                                lambda: self.inner.allgather_coalesced(output_lists, inputs, opts),
                                numel=sum(t.numel() for t in inputs))

    def _allgather_base(self, output, input, opts=None):  # noqa: A002 (torch's names)
        opts = opts or dist.AllgatherOptions()
        return self._collective("all_gather_into_tensor", [input], [output],
                                lambda: self.inner._allgather_base(output, input, opts), numel=input.numel())

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts or dist.AllgatherOptions()
        return self._collective("all_gather_into_tensor_coalesced", inputs, outputs,
                                lambda: [self.inner._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)],
                                numel=sum(t.numel() for t in inputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return self._collective("reduce_scatter", outputs, outputs,
                                lambda: self.inner.reduce_scatter(outputs, input_lists, opts),
                                numel=sum(t.numel() for t in outputs), reduce_op=opts.reduceOp)

    def _reduce_scatter_base(self, output, input, opts=None):  # noqa: A002
        opts = opts or dist.ReduceScatterOptions()
        return self._collective("reduce_scatter_tensor", [input], [output],
                                lambda: self.inner._reduce_scatter_base(output, input, opts),
                                numel=input.numel(), reduce_op=opts.reduceOp)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return self._collective("reduce_scatter_tensor_coalesced", inputs, outputs,
                                lambda: [self.inner._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)],
                                numel=sum(t.numel() for t in inputs), reduce_op=opts.reduceOp)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall_base(self, output, input, output_splits, input_splits, opts=None):  # noqa: A002
        opts = opts or dist.AllToAllOptions()
        return self._collective("all_to_all_single", [input], [output],
                                lambda: self.inner.alltoall_base(output, input, output_splits, input_splits, opts))

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):  # noqa: A002
        return self.alltoall_base(output, input, output_splits, input_splits, opts)

    def alltoall(self, outputs, inputs, opts=None):
        opts = opts or dist.AllToAllOptions()
        return self._collective("all_to_all", inputs, outputs, lambda: self.inner.alltoall(outputs, inputs, opts))

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        return self._collective("reduce", tensors, tensors, lambda: self.inner.reduce(tensors, opts),
                                numel=sum(t.numel() for t in tensors), root=opts.rootRank, reduce_op=opts.reduceOp)

    def gather(self, output_lists, inputs, opts=None):
        opts = opts or dist.GatherOptions()
        return self._collective("gather", inputs, [t for ts in output_lists for t in ts],
                                lambda: self.inner.gather(output_lists, inputs, opts),
                                numel=sum(t.numel() for t in inputs), root=opts.rootRank)

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts or dist.ScatterOptions()
        return self._collective("scatter", outputs, outputs, lambda: self.inner.scatter(outputs, input_lists, opts),
                                numel=sum(t.numel() for t in outputs), root=opts.rootRank)

    def barrier(self, opts=None):
        opts = opts or dist.BarrierOptions()
        return self._collective("barrier", [], [], lambda: self.inner.barrier(opts))

    def send(self, tensors, dst, tag=0):
        return self._p2p([("send", tensors[0], dst, tag)])[0]

    def recv(self, tensors, src, tag=0):
        return self._p2p([("recv", tensors[0], src, tag)])[0]

    def recv_anysource(self, tensors, tag=0):
        raise StrictCollectiveError(f"strict collectives: a receive from any source on {self.describe()}: NCCL "
                                    "has none; name the sender")

    def monitored_barrier(self, *args, **kwargs):
        raise StrictCollectiveError(f"strict collectives: monitored_barrier on {self.describe()}: gloo only, NCCL "
                                    "has none; use it on a HOST group")

    def batch(self, p2p_ops: list) -> list[StrictWork]:
        """`batch_isend_irecv` on this group: the whole batch is one unit (NCCL's group call)."""
        entries = []
        for op in p2p_ops:
            peer = op.group_peer if getattr(op, "group_peer", None) is not None else dist.get_group_rank(self, op.peer)
            kind = "send" if getattr(op.op, "__name__", "") == "isend" else "recv"
            entries.append((kind, op.tensor, peer, op.tag))
        return self._p2p(entries)


def _as_strict(unit: Unit, group: "StrictProcessGroup", exc: Exception) -> StrictCollectiveError:
    if isinstance(exc, StrictCollectiveError):
        return exc
    return StrictCollectiveError(f"strict collectives: {unit.describe()} on {group.describe()} failed: "
                                 f"{type(exc).__name__}: {exc}")


_REGISTERED = False


def _create(options, backend_options=None) -> StrictProcessGroup:
    """torch's creator for the registered backend (extended API)."""
    return StrictProcessGroup(options.store, options.group_rank, options.group_size, options.timeout,
                              str(options.group_id), list(options.global_ranks_in_group))


def _batch_isend_irecv(p2p_op_list):
    c10d._check_p2p_op_list(p2p_op_list)
    group = p2p_op_list[0].group
    group = group if group is not None else c10d._get_default_group()
    if isinstance(group, StrictProcessGroup):
        return group.batch(p2p_op_list)
    return _ORIGINAL_BATCH(p2p_op_list)


_ORIGINAL_BATCH = c10d.batch_isend_irecv


def register() -> None:
    """The backend, and `batch_isend_irecv` taking a strict group's batch as one unit (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    c10d.batch_isend_irecv = _batch_isend_irecv
    dist.batch_isend_irecv = _batch_isend_irecv
    _REGISTERED = True
