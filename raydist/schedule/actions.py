"""A pipeline schedule as data: per rank, an ordered list of compute actions and the transfers they imply.

Vocabulary (P pipeline ranks, V model chunks per rank, M micro-batches, S = P * V virtual stages):

- virtual stage s in [0, S) runs layers in model order; rank r holds chunks c = 0..V-1 with
  s = c * P + r (Megatron's interleaved assignment; with V = 1, stage == rank);
- `Action(kind, stage, microbatch)`: kind F (forward of one micro-batch through one chunk) or B (its
  backward: input and weight gradients together);
- the transfers an action implies are derived, not stored: F on stage s > 0 receives the activation of
  stage s - 1, F on s < S - 1 sends its output to s + 1; B on s < S - 1 receives the output gradient from
  s + 1, B on s > 0 sends its input gradient to s - 1. Every transfer is one (B_micro, T, D) tensor.

A `Schedule` is produced by a pure generator (`generators.py`), checked by `validate.py`, timed by
`timeline.py` and run by `executor.py`. Nothing here touches torch.
"""

from __future__ import annotations

from dataclasses import dataclass

FORWARD = "F"
BACKWARD = "B"
KINDS = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Action:
    kind: str  # FORWARD or BACKWARD
    stage: int  # virtual stage in [0, P * V)
    microbatch: int  # in [0, M)

    def label(self, num_ranks: int, virtual_stages: int) -> str:
        """`F3` (V = 1) or `F3.c1` (chunk 1 of this rank, V > 1)."""
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
        """Both stages on one rank (V > 1 with P = 1): handed over in memory, no point-to-point op."""
        return self.src_rank == self.dst_rank


@dataclass(frozen=True)
class Schedule:
    kind: str  # one of KINDS
    num_ranks: int  # P
    num_microbatches: int  # M
    virtual_stages: int  # V
    actions: tuple[tuple[Action, ...], ...]  # actions[r]: rank r's actions in execution order

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        return stage % self.num_ranks

    def chunk_of(self, stage: int) -> int:
        return stage // self.num_ranks

    def stages_of(self, rank: int) -> list[int]:
        """The virtual stages rank `rank` holds, by chunk index."""
        return [c * self.num_ranks + rank for c in range(self.virtual_stages)]

    def recv_of(self, action: Action) -> Transfer | None:
        """The tensor `action` must receive before it can run (None on the first/last stage)."""
        s, m = action.stage, action.microbatch
        if action.kind == FORWARD and s > 0:
            return Transfer("activation", s - 1, s, m, self.rank_of(s - 1), self.rank_of(s))
        if action.kind == BACKWARD and s < self.num_stages - 1:
            return Transfer("gradient", s + 1, s, m, self.rank_of(s + 1), self.rank_of(s))
        return None

    def send_of(self, action: Action) -> Transfer | None:
        """The tensor `action` produces for another stage (None on the last/first stage)."""
        s, m = action.stage, action.microbatch
        if action.kind == FORWARD and s < self.num_stages - 1:
            return Transfer("activation", s, s + 1, m, self.rank_of(s), self.rank_of(s + 1))
        if action.kind == BACKWARD and s > 0:
            return Transfer("gradient", s, s - 1, m, self.rank_of(s), self.rank_of(s - 1))
        return None

    def tag(self, transfer: Transfer) -> int:
        """A point-to-point tag unique within one step: (what, receiving stage, micro-batch) numbered densely
        (gloo matches on it; NCCL ignores tags and relies on the per-channel order `validate` checks)."""
        what = int(transfer.what == "gradient")
        return (what * self.num_stages + transfer.dst_stage) * self.num_microbatches + transfer.microbatch

    def last_backward(self, rank: int) -> dict[int, Action]:
        """{chunk: the chunk's final B on this rank}: where gradient sync (DDP/FSDP) must be switched on."""
        last: dict[int, Action] = {}
        for action in self.actions[rank]:
            if action.kind == BACKWARD:
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
