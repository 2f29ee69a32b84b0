"""A pipeline schedule as data: per rank, an ordered list of compute actions and the transfers they imply.

Vocabulary (P pipeline ranks, V model chunks per rank, M micro-batches, S = P * V virtual stages):

- virtual stage s in [0, S) runs layers in model order. Placement "loop" (Megatron's interleaved
  assignment): rank r holds chunks c = 0..V-1 with s = c * P + r (with V = 1, stage == rank). Placement
  "v" (ZB-V, V = 2): rank r holds s = r (chunk 0) and s = 2P - 1 - r (chunk 1), so a micro-batch goes
  down the ranks and back up, and rank 0 holds both the first and the last stage;
- `Action(kind, stage, microbatch)`: kind F (forward of one micro-batch through one chunk), B (its
  backward) or W. Schedules that split the backward (Qi, Wan, Huang, Lin, "Zero Bubble Pipeline
  Parallelism", ICLR 2024) run B as the input gradient only (dL/dx, what the previous stage waits for)
  and W as the weight gradient (dL/dtheta = x^T dL/dy, needed by nobody until the optimizer step) of the
  same (stage, micro-batch) on the same rank, any time after its B. Schedules that do not split (GPipe,
  1F1B, interleaved) have no W: their B computes both gradients;
- the transfers an action implies are derived, not stored: F on stage s > 0 receives the activation of
  stage s - 1, F on s < S - 1 sends its output to s + 1; B on s < S - 1 receives the output gradient from
  s + 1, B on s > 0 sends its input gradient to s - 1; W neither sends nor receives. Every transfer is one
  (B_micro, T, D) tensor; it is local (no point-to-point op) when both stages sit on one rank (V > 1 with
  P = 1, or stages P - 1 and P under the V placement).

A `Schedule` is produced by a pure generator (`generators.py`, `zero_bubble.py`; each kind's entry in
`registry.py`), checked by `validate.py`, timed by `timeline.py` and run by `executor.py`. Nothing here
touches torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from raydist.errors import ConfigError

FORWARD = "F"
BACKWARD = "B"  # the whole backward, or only the input gradient when the schedule splits the backward
WEIGHT = "W"  # the weight gradient of a split backward
PLACEMENTS = ("loop", "v")


def check_dims(num_ranks: int, num_microbatches: int, virtual_stages: int) -> None:
    """ConfigError naming the value and the fix for a P, M or V below 1 (what a kind needs beyond that:
    `registry.check_shape`)."""
    if num_ranks < 1:
        raise ConfigError(f"pipeline stages={num_ranks} must be >= 1")
    if num_microbatches < 1:
        raise ConfigError(f"num_microbatches={num_microbatches} must be >= 1")
    if virtual_stages < 1:
        raise ConfigError(f"virtual_stages={virtual_stages} must be >= 1")


def stages_of_rank(placement: str, num_ranks: int, virtual_stages: int, rank: int) -> list[int]:
    """The virtual stages rank `rank` holds, by chunk index: c * P + r ("loop"), or r and 2P - 1 - r ("v").
    The one place this rule lives (the schedule, the model split and the planner all ask it)."""
    if placement == "v":
        return [rank, 2 * num_ranks - 1 - rank]
    return [c * num_ranks + rank for c in range(virtual_stages)]


def dependency_key(kind: str, stage: int, microbatch: int, last_stage: int) -> tuple[str, int, int] | None:
    """(kind, stage, micro-batch) of the action on another stage whose output the action (kind, stage,
    microbatch) receives: the previous stage's F for an F, the next stage's B for a B; None at the pipeline's
    ends and for W (it needs only its own B, earlier on the same rank, which the order check guarantees).
    The one place this rule lives: `Schedule.recv_of` builds its transfer from it, and the dependency order
    (raydist.schedule.progress) and the timeline ask it of every action, as tuples: an Action's dataclass hash
    costs more than the whole check."""
    if kind == FORWARD and stage > 0:
        return FORWARD, stage - 1, microbatch
    if kind == BACKWARD and stage < last_stage:
        return BACKWARD, stage + 1, microbatch
    return None


@dataclass(frozen=True)
class Action:
    kind: str  # FORWARD, BACKWARD or WEIGHT
    stage: int  # virtual stage in [0, P * V)
    microbatch: int  # in [0, M)

    def label(self, num_ranks: int, virtual_stages: int) -> str:
        """`F3` (V = 1) or `F3.c1` (chunk 1 of this rank, V > 1; stage // P is the chunk under both
        placements, since the V placement has exactly two chunks)."""
        chunk = f".c{self.stage // num_ranks}" if virtual_stages > 1 else ""
        return f"{self.kind}{self.microbatch}{chunk}"


@dataclass(frozen=True)
class Transfer:
    """One tensor moving between stages: an activation (forward) or a gradient (backward)."""

    what: str  # "activation" or "gradient"
    src_stage: int
    dst_stage: int
    microbatch: int
    src_rank: int
    dst_rank: int

    @property
    def local(self) -> bool:
        """Both stages on one rank (V > 1 with P = 1, or stages P - 1 -> P under the V placement): handed
        over in memory, no point-to-point op."""
        return self.src_rank == self.dst_rank


@dataclass(frozen=True)
class Schedule:
    kind: str  # one of registry.KINDS
    num_ranks: int  # P
    num_microbatches: int  # M
    virtual_stages: int  # V
    actions: tuple[tuple[Action, ...], ...]  # actions[r]: rank r's actions in execution order
    placement: str = "loop"  # "loop": stage c * P + r on rank r; "v": stages r and 2P - 1 - r (V = 2)

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"schedule placement={self.placement!r} is not one of {', '.join(PLACEMENTS)}")
        if self.placement == "v" and self.virtual_stages != 2:
            raise ConfigError(f"placement 'v' puts exactly 2 chunks on each rank, not virtual_stages="
                              f"{self.virtual_stages}; use virtual_stages=2 or placement 'loop'")

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.virtual_stages

    @property
    def split_backward(self) -> bool:
        """Whether B is the input gradient only and W the weight gradient (any W action present)."""
        return any(a.kind == WEIGHT for actions in self.actions for a in actions)

    def rank_of(self, stage: int) -> int:
        if self.placement == "v" and stage >= self.num_ranks:
            return self.num_stages - 1 - stage
        return stage % self.num_ranks

    def chunk_of(self, stage: int) -> int:
        return stage // self.num_ranks  # the same under both placements ("v": stages P..2P-1 are chunk 1)

    def stages_of(self, rank: int) -> list[int]:
        """The virtual stages rank `rank` holds, by chunk index."""
        return stages_of_rank(self.placement, self.num_ranks, self.virtual_stages, rank)

    def recv_of(self, action: Action) -> Transfer | None:
        """The tensor `action` must receive before it can run (None on the first/last stage, and for W)."""
        return self._transfers_of(action)[0]

    def send_of(self, action: Action) -> Transfer | None:
        """The tensor `action` produces for another stage (None on the last/first stage, and for W)."""
        return self._transfers_of(action)[1]

    @functools.cached_property
    def _transfers(self) -> dict[Action, tuple[Transfer | None, Transfer | None]]:
        return {}  # (a memo: the transfer plans and their NCCL replay ask for each action's several times)

    def _transfers_of(self, action: Action) -> tuple[Transfer | None, Transfer | None]:
        known = self._transfers.get(action)
        if known is None:
            s, m, last = action.stage, action.microbatch, self.num_stages - 1
            what = "activation" if action.kind == FORWARD else "gradient"
            source = dependency_key(action.kind, s, m, last)
            recv = None if source is None else Transfer(what, source[1], s, m, self.rank_of(source[1]), self.rank_of(s))
            send = None
            if action.kind == FORWARD and s < last:
                send = Transfer(what, s, s + 1, m, self.rank_of(s), self.rank_of(s + 1))
            elif action.kind == BACKWARD and s > 0:
                send = Transfer(what, s, s - 1, m, self.rank_of(s), self.rank_of(s - 1))
            known = self._transfers[action] = (recv, send)
        return known

    def tag(self, transfer: Transfer) -> int:
        """A point-to-point tag unique within one step: (what, receiving stage, micro-batch) numbered densely
        (gloo matches on it; NCCL ignores tags and relies on the per-channel order `validate` checks)."""
        what = int(transfer.what == "gradient")
        return (what * self.num_stages + transfer.dst_stage) * self.num_microbatches + transfer.microbatch

    def last_backward(self, rank: int) -> dict[int, Action]:
        """{chunk: the chunk's final B on this rank}: where gradient sync (DDP/FSDP) must be switched on
        when the backward is not split (with a split backward the weight gradients come from the Ws:
        use `last_weight_gradient`)."""
        last: dict[int, Action] = {}
        for action in self.actions[rank]:
            if action.kind == BACKWARD:
                last[self.chunk_of(action.stage)] = action
        return last

    def last_weight_gradient(self, rank: int) -> dict[int, Action]:
        """{chunk: the chunk's final action that accumulates weight gradients on this rank}: its final W
        when the backward is split, else its final B (== `last_backward`)."""
        kind = WEIGHT if self.split_backward else BACKWARD
        last: dict[int, Action] = {}
        for action in self.actions[rank]:
            if action.kind == kind:
                last[self.chunk_of(action.stage)] = action
        return last

    def describe_action(self, action: Action) -> str:
        """`F3.c1 <act s2@r0 >act s4@r0`: the action with its receive (<) and send (>)."""
        parts = [action.label(self.num_ranks, self.virtual_stages)]
        recv, send = self.recv_of(action), self.send_of(action)
        if recv is not None:
            parts.append(f"<{recv.what[:3]} s{recv.src_stage}@r{recv.src_rank}")
        if send is not None:
            parts.append(f">{send.what[:3]} s{send.dst_stage}@r{send.dst_rank}")
        return " ".join(parts)

    def format(self, with_transfers: bool = False) -> str:
        """One line per rank: its action sequence (with transfers: one action per line)."""
        lines = []
        for rank, actions in enumerate(self.actions):
            if with_transfers:
                lines.append(f"rank {rank} (stages {self.stages_of(rank)}):")
                lines.extend(f"  {self.describe_action(a)}" for a in actions)
            else:
                lines.append(f"rank {rank}: " + " ".join(a.label(self.num_ranks, self.virtual_stages)
                                                         for a in actions))
        return "\n".join(lines)
