"""`StrictProcessGroup`: a process group over gloo that runs its operations as NCCL runs them.

torch creates one for every group of the strict backend (raydist.strict.registration) and routes
`torch.distributed`'s calls, DDP's reducer and the functional collectives to its methods. Each group holds
two gloo process groups (`inner` for the operations, `side` for the collectives' fingerprints) and a stream
(raydist.strict.stream): every operation the group is asked for becomes a `Unit` (raydist.strict.units: one
collective, one send or receive, or one `batch_isend_irecv` batch) queued on the stream, which runs only its
head, in issue order (NCCL's one stream per communicator).

    collective:  the gloo collective; each of the group's first collectives starts only after the members'
                 fingerprints (kind, sequence number, dtype, size, root, reduction) were found equal, later
                 ones are compared beside it (raydist.strict.fingerprints)
    point-to-point batch:  every send and receive posted at once, each message a header and the data,
                 matched by issue order per (sender, receiver) pair whatever the caller's tags
                 (raydist.strict.p2p)

Before a unit is made the group refuses, naming the fix, what NCCL would refuse: host tensors on a device
group, sparse tensors, dtypes NCCL does not carry, bitwise reductions, receives from any source,
monitored_barrier.

Timeouts: an operation not done at the group's timeout ends the process (os.abort after one line on stderr
and the rank's pending operations), as ProcessGroupNCCL's watchdog does; so does a lost peer. A unit that the
deadlock finder fails (raydist.strict.runtime) raises `StrictCollectiveError` in the waiting host instead,
naming the cycle, and the group stays broken (a communicator that failed stays failed).
"""

from __future__ import annotations

import collections
import datetime
from typing import Callable

import torch
import torch.distributed as dist

from raydist.strict import p2p
from raydist.strict.fingerprints import CHECK_EACH_UNTIL, DTYPES, Fingerprints, dtype_code, dtype_name, fingerprint
from raydist.strict.mode import BACKEND, StrictCollectiveError
from raydist.strict.runtime import runtime_for
from raydist.strict.stream import Stream, works
from raydist.strict.units import Op, StrictWork, Unit, as_strict

NCCL_REDUCTIONS = (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX,
                   dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM)  # (RedOpType values)


class StrictProcessGroup(dist.ProcessGroup):
    """See the module docstring. `global_ranks[i]` is the world rank of group rank i."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, name: str,
                 global_ranks: list[int]):
        super().__init__(rank, size)
        self._name, self._desc = name, "undefined"
        self.global_ranks = list(global_ranks) or list(range(size))
        self.timeout = timeout
        self.inner = dist.ProcessGroupGloo(dist.PrefixStore("strict_gloo/", store), rank, size, timeout)
        # the collectives' fingerprints travel on connections of their own (raydist.strict.fingerprints)
        self.side = dist.ProcessGroupGloo(dist.PrefixStore("strict_side/", store), rank, size, timeout)
        self.runtime = runtime_for(store, self.global_ranks[rank], world=not global_ranks)
        if not global_ranks:
            self.runtime.world_group = self
        self._collectives = 0
        self._issued: dict[tuple[str, int], int] = collections.defaultdict(int)  # (send|recv, peer group rank)
        self.fingerprints = Fingerprints(self.side, self.global_ranks, self.describe)
        self.stream = Stream(self, self.runtime, name)
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

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """The timeout of operations issued from now on, as ProcessGroupNCCL::setTimeout sets the one each new
        work reads (torch's `_set_pg_timeout` knows only gloo and NCCL; raydist.elastic.hang.timeouts calls this).
        A unit waits `timeout` from its issue (`Unit.wait_gloo`); the gloo groups beneath get it too."""
        self.timeout = timeout
        for inner in (self.inner, self.side):
            inner._set_default_timeout(timeout)

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
            if dtype_code(t.dtype) < 0:
                raise StrictCollectiveError(f"strict collectives: {name} of a {t.dtype} tensor on {self.describe()}: "
                                            f"NCCL carries {', '.join(dtype_name(i) for i in range(len(DTYPES)))}")

    def _reduction(self, name: str, op) -> int:
        kind = getattr(op, "op", op)  # a ReduceOp's RedOpType
        if not any(kind == allowed for allowed in NCCL_REDUCTIONS):
            raise StrictCollectiveError(f"strict collectives: {name} with reduction {kind} on {self.describe()}: "
                                        "NCCL has no bitwise reductions (SUM, PRODUCT, MIN, MAX, AVG only)")
        return int(kind)

    def _collective(self, name: str, tensors: list[torch.Tensor], outputs: list[torch.Tensor],
                    run: Callable[[], "dist.Work | list[dist.Work]"], *, numel: int = -1, root: int = -1, reduce_op=None) -> StrictWork:
        self._check(name, tensors)
        reduction = -1 if reduce_op is None else self._reduction(name, reduce_op)
        dtype = dtype_code(tensors[0].dtype) if tensors else -1
        shape, torch_dtype = (tuple(tensors[0].shape), tensors[0].dtype) if tensors else ((), None)

        def make(uid: int) -> Unit:
            self._collectives += 1
            op = Op("coll", name, self._collectives, shape=shape, dtype=torch_dtype)
            fp = fingerprint(op, dtype, numel, root, reduction)

            def post(unit: Unit) -> list:
                # Each of the first CHECK_EACH_UNTIL collectives starts only once the fingerprints agree;
                # later checks go beside the collective (raydist.strict.fingerprints).
                pending = self.fingerprints.due(op, fp)
                if pending is None:
                    return works(run())
                gathered, agree = self.fingerprints.gather(pending)
                if op.n > CHECK_EACH_UNTIL:
                    return [(gathered, agree), *works(run())]  # later checks ride beside it

                def agree_then_run() -> None:
                    agree()
                    try:
                        started = run()
                    except Exception as exc:  # refused by gloo (bad arguments): the host raises it
                        raise as_strict(unit, exc) from exc
                    self.stream.attach(unit, works(started))

                return [(gathered, agree_then_run)]

            return Unit(self, uid, [op], outputs, post=post)

        return self.stream.enqueue(make)

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
            return Unit(self, uid, ops, [e[1] for e in entries], run=lambda unit: p2p.run(unit, entries))

        work = self.stream.enqueue(make)
        return [work] * len(entries)

    # ---- for the runtime ---------------------------------------------------------------------------------
    def state(self) -> dict:
        """For the deadlock finder: pending units in order, and what completed (global peers)."""
        stream = self.stream
        with stream.lock:
            return {"ranks": self.global_ranks, "units": [u.state() for u in stream.pending],
                    "coll": stream.completed["coll"],
                    "send": {str(p): n for p, n in stream.completed["send"].items()},
                    "recv": {str(p): n for p, n in stream.completed["recv"].items()},
                    "issued_coll": self._collectives}

    def shutdown(self) -> None:
        self.stream.stop()
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
