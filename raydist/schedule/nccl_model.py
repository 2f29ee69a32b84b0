"""Replay every rank's pipeline transfers under NCCL's rules and find a deadlock before anything runs (pure).

Each rank's program, from its `TransferPlan` (raydist.schedule.transfer_plan), is what the executor does:

    post the batches of point 0; for each action i: wait for its receive (and for the sends it proves
    received); compute; post the batches of point i + 1; at the end wait for everything

The model's rules are NCCL's on a device-bound group: a rank's posted batches run on one stream, one at a
time, in posting order; a batch ends only when every operation in it is matched; a send matches the receive
of the same index on its (sender, receiver) pair (issue order, tags ignored) and completes only when that
receive runs (no buffering); the host blocks only where it waits. A schedule whose replay leaves a rank
blocked is refused with the ranks, the operations they wait for and what runs on their streams; a receive
matched with a message other than its own (a channel out of order) is refused too.
"""

from __future__ import annotations

from collections import defaultdict, deque

from raydist.schedule.actions import Schedule
from raydist.schedule.progress import ScheduleError
from raydist.schedule.transfer_plan import TransferPlan, global_clock

OpKey = tuple  # ("send" | "recv", rank, peer, index on the (sender, receiver) pair)


def _programs(schedule: Schedule, plans: list[TransferPlan]):
    """Per rank: events ("post", [ops]) / ("wait", op) / ("end",), and every op's Transfer."""
    programs, transfer_of = [], {}
    for rank, plan in enumerate(plans):
        counts: dict[tuple[str, int], int] = defaultdict(int)
        op_of: dict[tuple[str, int], OpKey] = {}  # (send | recv, action index) -> op
        events: list[tuple] = []

        def post(batch) -> None:
            send, recvs = batch
            ops = []
            if send is not None:
                t = plan.of_action[send].send
                key = ("send", rank, t.dst_rank, counts[("send", t.dst_rank)])
                counts[("send", t.dst_rank)] += 1
                op_of[("send", send)], transfer_of[key] = key, t
                ops.append(key)
            for i in recvs:
                t = plan.of_action[i].recv
                key = ("recv", rank, t.src_rank, counts[("recv", t.src_rank)])
                counts[("recv", t.src_rank)] += 1
                op_of[("recv", i)], transfer_of[key] = key, t
                ops.append(key)
            events.append(("post", ops))

        n = len(plan.of_action)
        for p in range(n + 1):
            for batch in plan.postings[p].batches:
                post(batch)
            if p == n:
                break
            if plan.of_action[p].recv is not None and not plan.of_action[p].recv.local:
                if ("recv", p) not in op_of:
                    raise ScheduleError(f"rank {rank}'s transfer plan never posts the receive of action {p} "
                                        f"({schedule.actions[rank][p]}) before running it")
                events.append(("wait", op_of[("recv", p)]))
                events.extend(("wait", op_of[("send", i)]) for i in plan.release_after.get(p, ()))
        events.append(("end",))
        programs.append(events)
    return programs, transfer_of


def _describe(key: OpKey, transfer) -> str:
    kind, _, peer, index = key
    arrow = f"to rank {peer}" if kind == "send" else f"from rank {peer}"
    return f"{kind} {arrow} #{index} ({transfer.what} of micro-batch {transfer.microbatch} for stage {transfer.dst_stage})"


def replay(schedule: Schedule, plans: list[TransferPlan] | None = None) -> None:
    """Raise ScheduleError unless every rank finishes its transfer program under NCCL's rules."""
    if plans is None:
        clock = global_clock(schedule)
        plans = [TransferPlan.of(schedule, r, clock) for r in range(schedule.num_ranks)]
    programs, transfer_of = _programs(schedule, plans)
    counterpart = {}
    for key in transfer_of:
        kind, rank, peer, index = key
        other = ("recv" if kind == "send" else "send", peer, rank, index)
        if other not in transfer_of:
            raise ScheduleError(f"rank {rank}'s {_describe(key, transfer_of[key])} has no match on rank {peer}")
        if transfer_of[other] != transfer_of[key]:
            raise ScheduleError(f"NCCL matches messages by order: rank {rank}'s {_describe(key, transfer_of[key])} "
                                f"meets rank {peer}'s {_describe(other, transfer_of[other])}")
        counterpart[key] = other
    pc = [0] * len(programs)
    streams: list[deque[set]] = [deque() for _ in programs]
    done: set[OpKey] = set()
    progressed = True
    while progressed:
        progressed = False
        for rank, events in enumerate(programs):
            while pc[rank] < len(events):
                event = events[pc[rank]]
                if event[0] == "post":
                    streams[rank].append(set(event[1]))
                elif event[0] == "wait" and event[1] not in done:
                    break
                elif event[0] == "end" and streams[rank]:
                    break
                pc[rank] += 1
                progressed = True
        for rank, stream in enumerate(streams):
            if not stream:
                continue
            for key in list(stream[0]):
                other = counterpart[key]
                peer_stream = streams[other[1]]
                if peer_stream and other in peer_stream[0]:
                    stream[0].discard(key)
                    peer_stream[0].discard(other)
                    done.update((key, other))
                    progressed = True
        for stream in streams:
            while stream and not stream[0]:
                stream.popleft()
                progressed = True
    stuck = [r for r, events in enumerate(programs) if pc[r] < len(events)]
    if not stuck:
        return
    lines = []
    for r in stuck:
        event = programs[r][pc[r]]
        waiting = "the end of its step" if event[0] == "end" else _describe(event[1], transfer_of[event[1]])
        head = ", ".join(_describe(k, transfer_of[k]) for k in sorted(streams[r][0])) if streams[r] else "nothing"
        lines.append(f"rank {r} waits for {waiting} while its stream runs [{head}]")
    raise ScheduleError(f"{schedule.kind} P={schedule.num_ranks} M={schedule.num_microbatches} would deadlock on "
                        "NCCL (one stream per communicator, batches end only when matched): " + "; ".join(lines))
