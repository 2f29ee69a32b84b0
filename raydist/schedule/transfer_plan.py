"""When each rank posts its pipeline transfers, so that the step cannot deadlock on NCCL (pure: no torch).

NCCL runs a communicator's operations one at a time on one stream, in issue order, and a batch of
point-to-point operations (one `batch_isend_irecv`) ends only when every operation in it is matched. With a
device-bound (eagerly initialised) group even single sends and receives use that stream. So a receive posted
early blocks every later operation of the rank on the pipeline group, its own sends included: posting the
receive of the first backward's gradient before the first forward's activation is sent deadlocks every
schedule at its first step (rank 0 waits for rank 1's gradient, rank 1 for rank 0's activation).

The plan orders every rank's operations by one global clock, the schedule's simulated timeline
(raydist.schedule.timeline; ties broken by start, then rank): a transfer happens at the time its producing
action finishes. Rank r

    sends action i's output right after computing action i, and
    posts the receive of a tensor produced at time t right after its own last action that finishes before t
    (before its first action if none does),

so every rank issues its operations in the order of the global clock. That cannot deadlock: take the
earliest transfer not yet done; everything before it on both of its ranks' streams is earlier, hence done,
and neither rank's host can be blocked waiting for something later, so both operations reach the head of
their streams and match. Then the next one.

A posting point p (before action p; p = len(actions) is after the last) posts one batch: the send of action
p - 1, and the receive of action p when it comes due here (Megatron's send_forward_recv_backward pairs: both
directions in one group call); every other receive due at p goes out on its own, so that waiting for the
next action's input never waits for a later action's. Merging operations that are adjacent in a rank's
order cannot create a wait the order did not already have: the stream would run them in that order anyway.
`raydist.schedule.nccl_model` replays these plans under NCCL's stream rules for every schedule `validate`
accepts.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from raydist.schedule.actions import Action, Schedule, Transfer


@dataclass(frozen=True)
class ActionTransfers:
    """One action's receive and send (None when it has none) and their point-to-point tags."""

    recv: Transfer | None
    recv_tag: int
    send: Transfer | None
    send_tag: int


@dataclass(frozen=True)
class Posting:
    """What a rank posts at one point of its step: batches of (send action index | None, receive action
    indices), each batch one group call, in this order."""

    batches: tuple[tuple[int | None, tuple[int, ...]], ...] = ()


@dataclass
class TransferPlan:
    """One rank's transfers for an ordered list of its actions, derived once."""

    of_action: tuple[ActionTransfers, ...]
    postings: tuple[Posting, ...]  # [p]: posted before action p; [len(actions)]: after the last
    release_after: dict[int, list[int]]  # see send_release_points

    @classmethod
    def of(cls, schedule: Schedule, rank: int, clock: dict[tuple[int, Action], tuple] | None = None) -> "TransferPlan":
        actions = schedule.actions[rank]
        of_action = []
        for action in actions:
            recv, send = schedule.recv_of(action), schedule.send_of(action)
            of_action.append(ActionTransfers(recv, -1 if recv is None else schedule.tag(recv),
                                             send, -1 if send is None else schedule.tag(send)))
        return cls(tuple(of_action), postings(schedule, rank, clock or global_clock(schedule)),
                   send_release_points(schedule, rank))


def global_clock(schedule: Schedule) -> dict[tuple[int, Action], tuple]:
    """(rank, action) -> a sortable time: its finish in the simulated timeline, then start, then rank. The
    times are exact integers (in units of the timeline's finest step: every time is a multiple of it), which
    the plans sort and bisect several times faster than Fractions."""
    from raydist.schedule.timeline import simulate

    intervals = simulate(schedule).intervals
    unit = math.lcm(*{t.denominator for iv in intervals for t in (iv.start, iv.finish)})

    def ticks(t) -> int:
        return t.numerator * (unit // t.denominator)

    return {(iv.rank, iv.action): (ticks(iv.finish), ticks(iv.start), iv.rank) for iv in intervals}


def postings(schedule: Schedule, rank: int, clock: dict[tuple[int, Action], tuple]) -> tuple[Posting, ...]:
    actions = schedule.actions[rank]
    mine = [clock[(rank, a)] for a in actions]  # increasing: a rank runs its actions in order
    due: list[list[tuple[tuple, int]]] = [[] for _ in range(len(actions) + 1)]  # [p]: (produced at, action)
    for i, action in enumerate(actions):
        recv = schedule.recv_of(action)
        if recv is None or recv.local:
            continue
        produced = clock[(recv.src_rank, Action(action.kind, recv.src_stage, action.microbatch))]
        due[bisect.bisect_left(mine, produced)].append((produced, i))
    out = []
    for p in range(len(actions) + 1):
        send = None
        if p > 0:
            transfer = schedule.send_of(actions[p - 1])
            send = p - 1 if transfer is not None and not transfer.local else None
        receives = [i for _, i in sorted(due[p])]
        batches: list[tuple[int | None, tuple[int, ...]]] = []
        if send is not None or receives:
            # the send, with the receive the next action waits for when it is the earliest due here
            paired = receives[:1] if receives and receives[0] == p else []
            if send is not None or paired:
                batches.append((send, tuple(paired)))
            batches.extend((None, (i,)) for i in receives[len(paired):])
        out.append(Posting(tuple(batches)))
    return tuple(out)


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
    # each of this rank's remote receives once: (its sender, the sender's position of the producing action)
    received: list[tuple[int, int] | None] = []
    for action in mine:
        recv = schedule.recv_of(action)
        received.append(None if recv is None or recv.local else (
            recv.src_rank, position[recv.src_rank][Action(action.kind, recv.src_stage, recv.microbatch)]))
    release: dict[int, list[int]] = {}
    for i, action in enumerate(mine):
        send = schedule.send_of(action)
        if send is None or send.local:
            continue
        consumed_at = position[send.dst_rank][Action(action.kind, send.dst_stage, send.microbatch)]
        for k in range(i + 1, len(mine)):
            got = received[k]
            if got is not None and got[0] == send.dst_rank and got[1] > consumed_at:
                release.setdefault(k, []).append(i)
                break
    return release
