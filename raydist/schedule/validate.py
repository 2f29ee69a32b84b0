"""Check a schedule before anything runs it, and measure its activation memory.

`validate(schedule)` raises `ScheduleError` (a ConfigError: one line naming the problem) unless

1. completeness: rank r runs exactly one F and one B per (stage it holds, micro-batch), and, when the
   schedule splits the backward (kind zbh1/zbv: B = input gradient, W = weight gradient; Qi, Wan, Huang,
   Lin, "Zero Bubble Pipeline Parallelism"), exactly one W too; nothing else (no W otherwise);
2. order: on every stage, a micro-batch's F comes before its B, and its B before its W (W reads the
   output gradient B received and the input F saved, on the same rank);
3. progress: executing each rank's list in order, where an action waits only for the tensor it receives
   (W receives nothing, so it never waits), every rank finishes (raydist.schedule.progress);
4. channel order: on each directed rank pair, the receiver expects tensors in the order the sender sends
   them (NCCL matches point-to-point messages by order, not by tag);
5. NCCL: the executor's transfers (raydist.schedule.transfer_plan), replayed under NCCL's stream rules
   (one stream per communicator, a batch ends only when all of it is matched, sends do not buffer), let
   every rank finish (raydist.schedule.nccl_model).

It returns a `ScheduleReport` with the peak number of micro-batches in flight per virtual stage, and per
rank in micro-batch equivalents of activation memory: a chunk holds 1/V of the rank's layers, so a rank's
peak is max over time of sum_c inflight_c / V. A micro-batch is in flight on a stage from its F until its
backward no longer needs the saved inputs: its B, or its W when the backward is split (W needs x).
For 1F1B the peak on rank r is min(P - r, M); for GPipe it is M; for ZB-H1 it is min(P, M) on every rank
(the peak over ranks stays 1F1B's); for ZB-V, P (2P chunks of half a rank's layers) on every rank.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction

from raydist.schedule import nccl_model
from raydist.schedule.actions import BACKWARD, FORWARD, WEIGHT, Action, Schedule
from raydist.schedule.progress import ScheduleError, execution_order
from raydist.schedule.registry import SCHEDULE_KINDS, SPLIT_BACKWARD_KINDS


@dataclass(frozen=True)
class ScheduleReport:
    peak_inflight_per_stage: tuple[int, ...]  # indexed by virtual stage
    peak_activations_per_rank: tuple[Fraction, ...]  # micro-batch equivalents, indexed by rank

    @property
    def peak_activations(self) -> Fraction:
        return max(self.peak_activations_per_rank)


def _check_split(schedule: Schedule) -> None:
    """A kind that splits the backward has W actions; one that does not has none."""
    entry = SCHEDULE_KINDS.get(schedule.kind)
    if entry is None or schedule.split_backward == entry.split_backward:
        return
    if schedule.split_backward:
        rank, w = next((r, a) for r, acts in enumerate(schedule.actions) for a in acts if a.kind == WEIGHT)
        raise ScheduleError(f"kind {schedule.kind!r} does not split the backward (its B computes both gradients) "
                            f"but rank {rank} runs {w}; drop the W actions or use kind "
                            f"{'/'.join(SPLIT_BACKWARD_KINDS)}")
    raise ScheduleError(f"kind {schedule.kind!r} splits the backward into B (input gradient) and W (weight "
                        "gradient) but the schedule has no W action; add one W after each B")


def _check_complete(schedule: Schedule) -> None:
    m_all = range(schedule.num_microbatches)
    kinds = (FORWARD, BACKWARD, WEIGHT) if schedule.split_backward else (FORWARD, BACKWARD)
    for rank, actions in enumerate(schedule.actions):
        expected = {Action(kind, s, m) for kind in kinds for s in schedule.stages_of(rank) for m in m_all}
        seen: set[Action] = set()
        for a in actions:
            if a not in expected:
                raise ScheduleError(f"rank {rank} runs {a}, which is not one of its stages {schedule.stages_of(rank)} "
                                    f"x micro-batches 0..{schedule.num_microbatches - 1}")
            if a in seen:
                raise ScheduleError(f"rank {rank} runs {a} twice")
            seen.add(a)
        missing = sorted(expected - seen, key=lambda a: (a.stage, a.microbatch, a.kind))
        if missing:
            raise ScheduleError(f"rank {rank} never runs {missing[0]} ({len(missing)} action(s) missing)")


def _check_forward_before_backward(schedule: Schedule) -> None:
    for rank, actions in enumerate(schedule.actions):
        forwarded: set[tuple[int, int]] = set()
        backwarded: set[tuple[int, int]] = set()
        for a in actions:
            key = (a.stage, a.microbatch)
            if a.kind == FORWARD:
                forwarded.add(key)
            elif a.kind == BACKWARD:
                if key not in forwarded:
                    raise ScheduleError(f"rank {rank}: backward of micro-batch {a.microbatch} on stage {a.stage} "
                                        "comes before its forward")
                backwarded.add(key)
            elif key not in backwarded:
                raise ScheduleError(f"rank {rank}: weight gradient (W) of micro-batch {a.microbatch} on stage "
                                    f"{a.stage} comes before its input-gradient backward (B); move it after the B")


def _check_channel_order(schedule: Schedule) -> None:
    sent: dict[tuple[int, int], list] = defaultdict(list)
    received: dict[tuple[int, int], list] = defaultdict(list)
    for actions in schedule.actions:
        for a in actions:
            for transfer, log in ((schedule.send_of(a), sent), (schedule.recv_of(a), received)):
                if transfer is not None and not transfer.local:
                    log[(transfer.src_rank, transfer.dst_rank)].append(transfer)
    for channel, sends in sent.items():
        recvs = received[channel]
        for i, (s, r) in enumerate(zip(sends, recvs)):
            if s != r:
                raise ScheduleError(f"ranks {channel[0]}->{channel[1]}: message {i} is sent as {s.what} of "
                                    f"micro-batch {s.microbatch} for stage {s.dst_stage} but received as {r.what} "
                                    f"of micro-batch {r.microbatch} for stage {r.dst_stage}")


def peak_inflight(schedule: Schedule) -> ScheduleReport:
    """Micro-batches held from F until B (or until W when the backward is split)."""
    per_stage = [0] * schedule.num_stages
    per_rank = []
    release = WEIGHT if schedule.split_backward else BACKWARD
    for rank, actions in enumerate(schedule.actions):
        live: dict[int, int] = defaultdict(int)
        peak_rank = Fraction(0)
        for a in actions:
            live[a.stage] += 1 if a.kind == FORWARD else -1 if a.kind == release else 0
            per_stage[a.stage] = max(per_stage[a.stage], live[a.stage])
            peak_rank = max(peak_rank, Fraction(sum(live.values()), schedule.virtual_stages))
        per_rank.append(peak_rank)
    return ScheduleReport(tuple(per_stage), tuple(per_rank))


def validate(schedule: Schedule) -> ScheduleReport:
    """Raise ScheduleError unless `schedule` is complete, ordered (F, B, W), deadlock-free, channel-ordered
    and deadlock-free on NCCL with the executor's transfers."""
    if len(schedule.actions) != schedule.num_ranks:
        raise ScheduleError(f"schedule has {len(schedule.actions)} rank lists for {schedule.num_ranks} ranks")
    _check_split(schedule)
    _check_complete(schedule)
    _check_forward_before_backward(schedule)
    execution_order(schedule)
    _check_channel_order(schedule)
    nccl_model.replay(schedule)
    return peak_inflight(schedule)
