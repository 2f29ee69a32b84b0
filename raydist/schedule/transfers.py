"""The point-to-point side of one rank's pipeline step: what each action receives and sends, posted and
waited so that a rank blocks only on a receive whose sender is still computing.

`TransferPlan` is what a rank's loop would otherwise derive from its actions at every step: each action's
receive and send with their tags, the next receiving action from any point, and when sends may be freed
(`send_release_points`). `StepTransfers` is one step's state on top of it:

    post(send of action i, receive for the next receiving action)   right after action i computes
    receive(i)                                                       before action i computes
    finish()                                                         every remaining send, at the step's end

The send goes out first, then the receive is posted: the send is what a peer may be waiting for. Sends
are waited on only once a later message proves them received, or at the step's end. Receives go into
fresh buffers of the activation shape (B_micro, T_local, D). Transfers between two stages on one rank
(V = 2 under the ZB-V placement: stages P - 1 and P on rank P - 1) are handed over in memory.

Backends. NCCL runs a rank's point-to-point ops in order on one stream, so a send and the receive posted
with it go in one `batch_isend_irecv` (a group call: neither blocks the other), as
torch.distributed.pipelining fuses them. gloo runs each op on its own (`batch_isend_irecv` without
coalescing is a loop of isend/irecv), so on CPU tensors the ops are issued directly, without the batch's
per-call checks (about 20 us a call on a 2-core machine). gloo's TCP transport moves a message once its
receive is posted (the sender announces it, the receiver answers ready, then the data flows: gloo
`transport/tcp/pair.cc`), which suggests posting receives earlier; neither posting the next receive
before the current compute nor keeping two receives out shortened a step of the sleep-stage benchmark
(`benchmarks/pipeline_bubble.py`), since a receive that is waited on was posted before its send anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from raydist.schedule.actions import Action, Schedule, Transfer


@dataclass(frozen=True)
class ActionTransfers:
    """One action's receive and send (None when it has none) and their point-to-point tags."""

    recv: Transfer | None
    recv_tag: int
    send: Transfer | None
    send_tag: int


@dataclass
class TransferPlan:
    """One rank's transfers for an ordered list of its actions, derived once."""

    of_action: tuple[ActionTransfers, ...]
    next_receiving: list[int | None]  # [i]: the first action at or after i that receives (post it then)
    release_after: dict[int, list[int]]  # see send_release_points

    @classmethod
    def of(cls, schedule: Schedule, rank: int) -> "TransferPlan":
        actions = schedule.actions[rank]
        of_action = []
        for action in actions:
            recv, send = schedule.recv_of(action), schedule.send_of(action)
            of_action.append(ActionTransfers(recv, -1 if recv is None else schedule.tag(recv),
                                             send, -1 if send is None else schedule.tag(send)))
        next_receiving: list[int | None] = [None] * (len(actions) + 1)
        for i in range(len(actions) - 1, -1, -1):
            next_receiving[i] = i if of_action[i].recv is not None else next_receiving[i + 1]
        return cls(tuple(of_action), next_receiving, send_release_points(schedule, rank))


class _PostedBatch:
    """The works of ops posted together. Backends without coalescing (gloo) give one work per op;
    coalescing ones (NCCL) may return one for the whole batch, which then stands for every op.
    Each work is waited exactly once: a second `wait()` on a gloo receive waits for another message."""

    def __init__(self, ops: list[dist.P2POp], works: list):
        self.per_op = len(works) == len(ops)
        self.ops, self.works = ops, works
        self.pending = set(range(len(works)))

    def _wait(self, indices) -> None:
        for i in sorted(self.pending.intersection(indices)):
            self.works[i].wait()
            self.pending.discard(i)

    def wait_op(self, op: dist.P2POp) -> None:
        self._wait([next(i for i, o in enumerate(self.ops) if o is op)] if self.per_op else range(len(self.works)))

    def wait_all(self) -> None:
        self._wait(range(len(self.works)))


class StepTransfers:
    """One step's point-to-point state for one rank (make a new one per step)."""

    def __init__(self, plan: TransferPlan, group: dist.ProcessGroup | None, activation_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device):
        self.plan, self.group = plan, group
        self.activation_shape, self.dtype, self.device = activation_shape, dtype, device
        self.coalesce = device.type != "cpu"  # NCCL: one group call per batch (see the module docstring)
        self.mailbox: dict[Transfer, torch.Tensor] = {}
        self.posted_recv: dict[int, dist.P2POp | None] = {}
        self.recv_batch: dict[int, _PostedBatch] = {}
        self.batches: list[_PostedBatch] = []
        self.sent: dict[int, tuple[_PostedBatch, dist.P2POp]] = {}

    def _issue(self, ops: list[dist.P2POp]) -> list:
        if self.coalesce:
            return dist.batch_isend_irecv(ops)
        # by name: P2POp holds c10d's own isend/irecv while dist's names may be a wrapper (an audit, a
        # communication counter); calling through dist's names keeps those wrappers seeing every transfer
        return [dist.isend(op.tensor, group=op.group, tag=op.tag, group_dst=op.group_peer)
                if op.op.__name__ == "isend" else
                dist.irecv(op.tensor, group=op.group, tag=op.tag, group_src=op.group_peer) for op in ops]

    def post(self, send_index: int | None, tensor: torch.Tensor | None, recv_index: int | None) -> None:
        """The send produced by action `send_index` (first), and the receive for action `recv_index`
        unless already posted."""
        ops, send_op, recv_op = [], None, None
        if send_index is not None:
            transfers = self.plan.of_action[send_index]
            if transfers.send.local:
                self.mailbox[transfers.send] = tensor
            else:
                send_op = dist.P2POp(c10d.isend, tensor.contiguous(), group=self.group,
                                     group_peer=transfers.send.dst_rank, tag=transfers.send_tag)
                ops.append(send_op)
        if recv_index is not None and recv_index not in self.posted_recv:
            transfers = self.plan.of_action[recv_index]
            if not transfers.recv.local:
                buffer = torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)
                recv_op = dist.P2POp(c10d.irecv, buffer, group=self.group, group_peer=transfers.recv.src_rank,
                                     tag=transfers.recv_tag)
                ops.append(recv_op)
            self.posted_recv[recv_index] = recv_op
        if not ops:
            return
        batch = _PostedBatch(ops, self._issue(ops))
        self.batches.append(batch)
        if send_op is not None:
            self.sent[send_index] = (batch, send_op)
        if recv_op is not None:
            self.recv_batch[recv_index] = batch

    def receive(self, index: int) -> torch.Tensor:
        """The tensor action `index` receives (waits for it)."""
        transfer = self.plan.of_action[index].recv
        if transfer.local:
            return self.mailbox.pop(transfer)
        if index not in self.posted_recv:
            self.post(None, None, index)
        op = self.posted_recv.pop(index)
        self.recv_batch.pop(index).wait_op(op)
        # Sends this message proves complete: free their tensors now rather than at the step's end.
        release = self.plan.release_after.get(index)
        if release:
            for send_index in release:
                batch, send_op = self.sent.pop(send_index)
                batch.wait_op(send_op)
            self.batches = [b for b in self.batches if b.pending]
        return op.tensor

    def finish(self) -> None:
        """Wait for every op still pending (the sends nothing later proved received)."""
        for batch in self.batches:
            batch.wait_all()
        self.batches, self.sent = [], {}


def send_release_points(schedule: Schedule, rank: int) -> dict[int, list[int]]:
    """{receiving action index k: [sending action indices i]}: once rank `rank` has received at its action
    k, the sends of actions i are certainly complete, so their tensors can be freed.

    gloo cannot tell a send's completion without blocking on it, so it is derived from the schedule: a
    send to peer q is consumed by q's action j; a later message from q produced by q's action p > j
    proves q has received it (q runs its actions in order). Sends with no such message (e.g. the last
    gradients of a step) are waited at the step's end. For 1F1B this frees the activation sent for
    micro-batch m when its gradient comes back, so sent tensors obey the same min(P - r, M) bound.
    """
    position = [{a: i for i, a in enumerate(acts)} for acts in schedule.actions]
    mine = schedule.actions[rank]
    release: dict[int, list[int]] = {}
    for i, action in enumerate(mine):
        send = schedule.send_of(action)
        if send is None or send.local:
            continue
        consumed_at = position[send.dst_rank][Action(action.kind, send.dst_stage, send.microbatch)]
        for k in range(i + 1, len(mine)):
            recv = schedule.recv_of(mine[k])
            if recv is None or recv.local or recv.src_rank != send.dst_rank:
                continue
            produced_at = position[recv.src_rank][Action(mine[k].kind, recv.src_stage, recv.microbatch)]
            if produced_at > consumed_at:
                release.setdefault(k, []).append(i)
                break
    return release
