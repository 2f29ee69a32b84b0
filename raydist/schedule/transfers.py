"""The point-to-point side of one rank's pipeline step, carried out as its `TransferPlan` says.

`raydist.schedule.transfer_plan` decides when each transfer is posted (every rank in the order of one
global clock, so that NCCL's single stream per communicator cannot deadlock); `StepTransfers` is one step's
state on top of it:

    post(p, produced)   the batches of posting point p: action p - 1's output (sent, or handed over in
                        memory when the next stage is on this rank: stages P - 1 and P under ZB-V), and the
                        receives that come due there; before action 0 (p = 0) and after each action
    receive(i)          the tensor action i receives (waits for its batch)
    finish()            every remaining send, at the step's end

Sends are waited on only once a later message proves them received (`send_release_points`), or at the
step's end. Receives go into fresh buffers of the activation shape (B_micro, T_local, D).

Backends. Each batch is one `batch_isend_irecv` (one NCCL group call) on NCCL and under the strict mode
(raydist.strict), whose rules are NCCL's. On plain gloo each op runs on its own anyway
(`batch_isend_irecv` without coalescing is a loop of isend/irecv), so the ops are issued directly, without
the batch's per-call checks (about 20 us a call on a 2-core machine).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from raydist.schedule.actions import Transfer
from raydist.schedule.transfer_plan import ActionTransfers, Posting, TransferPlan, send_release_points

__all__ = ["ActionTransfers", "Posting", "StepTransfers", "TransferPlan", "send_release_points", "coalesces"]


def coalesces(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether a batch goes out as one group call: on CUDA (NCCL) and on any backend but plain gloo."""
    if device.type != "cpu":
        return True
    return dist.is_initialized() and dist.get_backend(group) != "gloo"


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
        self.coalesce = coalesces(group, device)
        self.mailbox: dict[Transfer, torch.Tensor] = {}
        self.received: dict[int, tuple[_PostedBatch, dist.P2POp]] = {}  # action index -> its posted receive
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

    def post(self, point: int, produced: torch.Tensor | None) -> None:
        """Posting point `point`: action point - 1's output and the receives due here, batch by batch."""
        if point > 0:
            local = self.plan.of_action[point - 1].send
            if local is not None and local.local:
                self.mailbox[local] = produced
        for send, receives in self.plan.postings[point].batches:
            ops, send_op, recv_ops = [], None, []
            if send is not None:
                transfers = self.plan.of_action[send]
                send_op = dist.P2POp(c10d.isend, produced.contiguous(), group=self.group,
                                     group_peer=transfers.send.dst_rank, tag=transfers.send_tag)
                ops.append(send_op)
            for index in receives:
                transfers = self.plan.of_action[index]
                buffer = torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)
                op = dist.P2POp(c10d.irecv, buffer, group=self.group, group_peer=transfers.recv.src_rank,
                                tag=transfers.recv_tag)
                ops.append(op)
                recv_ops.append((index, op))
            batch = _PostedBatch(ops, self._issue(ops))
            self.batches.append(batch)
            if send_op is not None:
                self.sent[send] = (batch, send_op)
            for index, op in recv_ops:
                self.received[index] = (batch, op)

    def receive(self, index: int) -> torch.Tensor:
        """The tensor action `index` receives (waits for it)."""
        transfer = self.plan.of_action[index].recv
        if transfer.local:
            return self.mailbox.pop(transfer)
        batch, op = self.received.pop(index)  # posted at or before this action's point (the plan's rule)
        batch.wait_op(op)
        # Sends this message proves complete: free their tensors now rather than at the step's end.
        release = self.plan.release_after.get(index)
        if release:
            for send_index in release:
                sent_batch, send_op = self.sent.pop(send_index)
                sent_batch.wait_op(send_op)
            self.batches = [b for b in self.batches if b.pending]
        return op.tensor

    def finish(self) -> None:
        """Wait for every op still pending (the sends nothing later proved received)."""
        for batch in self.batches:
            batch.wait_all()
        self.batches, self.sent = [], {}
