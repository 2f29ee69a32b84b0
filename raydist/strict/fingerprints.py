"""The collectives' fingerprints: how the members of a strict group (raydist.strict.group) find out that they
issued the same collectives, in the same order, before gloo runs a mismatched one.

A collective's fingerprint is (kind, sequence number, dtype, size, root, reduction). Each of a group's first
CHECK_EACH_UNTIL collectives starts only after an all-gather of the fingerprints over the group's side group
(connections of their own, which a mismatched collective cannot break) found them equal: run, a collective
of mismatched sizes would end the process inside gloo (a C++ enforce, before any Python sees it), or hang.
Then every CHECK_EVERY collectives the fingerprints since the last check go beside the collective and are
compared as they arrive, so a steady state pays no extra round trip: a mismatch there is named when they
arrive, unless gloo has ended the process first. Checks fall at the same sequence numbers on every member;
a mismatch fails the unit naming both ops. A mismatch that hangs before its check is named by the deadlock
finder (raydist.strict.deadlock.mismatch).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist

from raydist.strict.mode import StrictCollectiveError
from raydist.strict.units import Op

OPCODES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
           "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "reduce", "gather", "scatter",
           "all_reduce_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced",
           "all_gather_coalesced")
# dtypes NCCL carries (bool as uint8); the index is the fingerprint's code
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)
CHECK_EACH_UNTIL = 32  # a group's first collectives are each checked before the next runs (setup, short tests)
CHECK_EVERY = 8  # then the fingerprints of every 8 collectives in one all-gather


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype) if dtype in DTYPES else -1


def dtype_name(code: int) -> str:
    return str(DTYPES[code]).replace("torch.", "") if 0 <= code < len(DTYPES) else "none"


def fingerprint(op: Op, dtype: int, numel: int, root: int, reduction: int) -> list[int]:
    """Collective `op`'s fingerprint: its kind and sequence number, its dtype code, size (-1: not compared),
    root and reduction (-1: none)."""
    return [OPCODES.index(op.name), op.n, dtype, numel, root, reduction]


class Fingerprints:
    """One group's fingerprints not yet compared, and their comparison over its side group.

    `global_ranks[i]` is the world rank of group rank i; `describe()` names the group in messages."""

    def __init__(self, side: dist.ProcessGroup, global_ranks: list[int], describe: Callable[[], str]):
        self.side, self.global_ranks, self.describe = side, global_ranks, describe
        self.unchecked: list[tuple[Op, list[int]]] = []  # collectives run, fingerprints not yet compared

    def due(self, op: Op, fingerprint: list[int]) -> list[tuple[Op, list[int]]] | None:
        """Adds `op`'s fingerprint; returns the ones to compare with `op` (None: not a check's turn)."""
        self.unchecked.append((op, fingerprint))
        if self.side.size() > 1 and (op.n <= CHECK_EACH_UNTIL or len(self.unchecked) >= CHECK_EVERY):
            pending, self.unchecked = self.unchecked, []
            return pending
        return None

    def gather(self, pending: list[tuple[Op, list[int]]]) -> tuple[dist.Work, Callable[[], None]]:
        """Starts the all-gather of `pending`'s fingerprints; returns its work and the comparison to run when
        it completes."""
        mine = torch.tensor([fp for _, fp in pending], dtype=torch.int64).reshape(-1)
        rows = torch.empty(self.side.size() * mine.numel(), dtype=torch.int64)
        agree = functools.partial(self.agree, pending, rows)
        return self.side._allgather_base(rows, mine), agree

    def agree(self, pending: list[tuple[Op, list[int]]], rows: torch.Tensor) -> None:
        """Every member issued the same collectives, in the same order, as this rank since the last check;
        or name the first that differs."""
        width = len(pending[0][1])
        every = rows.view(self.side.size(), len(pending), width).tolist()
        for i, (op, fp) in enumerate(pending):
            for r, theirs in enumerate(every):
                row = theirs[i]
                same = row[:3] == fp[:3] and row[4:] == fp[4:]
                if same and (row[3] == fp[3] or -1 in (row[3], fp[3])):
                    continue
                other = (f"{OPCODES[row[0]] if 0 <= row[0] < len(OPCODES) else '?'} #{row[1]} "
                         f"({dtype_name(row[2])}, {row[3]} elements, root {row[4]}, reduction {row[5]})")
                ours = (f"{op.name} #{op.n} ({dtype_name(fp[2])}, {fp[3]} elements, root {fp[4]}, "
                        f"reduction {fp[5]})")
                raise StrictCollectiveError(
                    f"strict collectives: {self.describe()}: rank {self.global_ranks[self.side.rank()]} issued "
                    f"{ours} where rank {self.global_ranks[r]} issued {other}; NCCL needs every member to issue a "
                    "group's collectives in the same order with the same kind, dtype, size and root (it would "
                    "hang or mix the data)")
