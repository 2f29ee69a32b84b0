"""What each batch peer uses of its data-parallel rank's rows, and how the batch leader hands it over.

One dp rank's rows are (B, T + 1) int64 (raydist.data.sft: a flag bit marks targets that do not count):
the inputs are columns 0..T-1, the targets columns 1..T. Only the batch leader (pp = cp = tp = 0) reads
them; its batch peers (the pp x cp x tp ranks of its dp index, `Mesh.batch_peers`) use

- under context parallelism, their own tokens only: cp rank r's positions P_r (T / cp of them; one run of
  consecutive positions under Ulysses' contiguous split, two under ring attention's zig-zag split,
  raydist.parallel.context), so input columns P_r and target columns P_r + 1;
- under pipeline parallelism, the inputs on the rank holding the first stage, the targets on the rank
  holding the last (the same rank under ZB-V's V placement), nothing on the others;
- under tensor parallelism, what their tp = 0 peer uses.

`BatchNeeds` says that for one rank as columns of the rows. Per run of positions (first a, length n), a
rank that needs inputs and targets receives columns a..a+n (n + 1 columns: the run's inputs and, one to the
right, its targets), one that needs only the inputs a..a+n-1, only the targets a+1..a+n. So a cp rank
receives (T / cp + runs) of the T + 1 columns (runs: 1 under Ulysses, 2 under ring), a middle pipeline
stage none, a first or last stage T / cp.

`BatchTransfer.share` moves them: the leader sends every tp = 0 peer that needs anything its columns,
point-to-point on the batch-peer group (a scatter whose pieces differ in width), then each tp group that
needs anything broadcasts its piece from its tp = 0 rank. Both groups are DeviceMesh groups, DEVICE groups
in raydist.parallel.runtime's terms (NCCL on CUDA): the pieces live on the training device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from raydist.data import sft


@dataclass(frozen=True)
class BatchNeeds:
    """The columns of the (B, T + 1) rows one rank uses."""

    runs: tuple[tuple[int, int], ...]  # (first position, length) of the rank's tokens, in its local order
    inputs: bool  # the rank embeds the tokens (no pipeline, or it holds the first stage)
    targets: bool  # the rank computes the loss (no pipeline, or it holds the last stage)
    sharded: bool  # context parallelism: the model is told the positions of the local tokens

    @property
    def empty(self) -> bool:
        return not (self.inputs or self.targets)

    def _block(self, n: int) -> int:
        """Columns a run of n positions takes in the piece."""
        return n + 1 if self.inputs and self.targets else n if not self.empty else 0

    @property
    def width(self) -> int:
        return sum(self._block(n) for _, n in self.runs)

    def _spans(self) -> list[tuple[int, int]]:
        """[start, stop) of each run's columns."""
        if self.empty:
            return []
        return [(a if self.inputs else a + 1, a + n + 1 if self.targets else a + n) for a, n in self.runs]

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's piece (B, width) of the whole rows (B, T + 1), contiguous: slices, no index tensor
        (one made from host data would be a blocking copy to the device on every step)."""
        parts = [rows[:, start:stop] for start, stop in self._spans()]
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=1)

    def _parts(self, piece: torch.Tensor, shift: int) -> torch.Tensor:
        parts, offset = [], 0
        for _, n in self.runs:
            parts.append(piece[:, offset + shift:offset + shift + n])
            offset += self._block(n)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def positions(self, device: torch.device) -> torch.Tensor:
        """(T_local,) the local tokens' positions in the whole sequence (made once per device)."""
        return _positions(self.runs, device)


@functools.lru_cache(maxsize=8)
def _positions(runs: tuple[tuple[int, int], ...], device: torch.device) -> torch.Tensor:
    return torch.cat([torch.arange(a, a + n, device=device) for a, n in runs])


def _runs(positions: list[int]) -> tuple[tuple[int, int], ...]:
    """Runs of consecutive positions, in order: [4, 5, 6, 12, 13] -> ((4, 3), (12, 2))."""
    runs: list[list[int]] = []
    for p in positions:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return tuple((a, n) for a, n in runs)


def rank_needs(layout, seq_len: int, pp_rank: int, cp_rank: int) -> BatchNeeds:
    """What the rank at pipeline index `pp_rank` and context-parallel index `cp_rank` of `layout` uses."""
    if layout.cp > 1:
        from raydist.parallel.context import POSITIONS

        runs = _runs(POSITIONS[layout.cp_impl](seq_len, layout.cp, cp_rank).tolist())
    else:
        runs = ((0, seq_len),)
    inputs = targets = True
    if layout.pp > 1:
        stages = layout.stages_of(pp_rank)
        inputs, targets = 0 in stages, layout.num_stages - 1 in stages
    return BatchNeeds(runs, inputs, targets, sharded=layout.cp > 1)


@dataclass
class LocalBatch:
    """This rank's part of its dp rank's rows: `piece` (B, needs.width), None where it needs nothing."""

    needs: BatchNeeds
    count: int  # B: the dp rank's rows
    piece: torch.Tensor | None

    @classmethod
    def of_rows(cls, rows: torch.Tensor, needs: BatchNeeds) -> LocalBatch:
        """From the whole rows, without communication (callers that hold them: tests, tools)."""
        return cls(needs, rows.shape[0], None if needs.empty else needs.take(rows))

    def split(self, size: int) -> list[LocalBatch]:
        """Row blocks of `size` (the last may be shorter), as `Tensor.split`."""
        counts = [min(size, self.count - start) for start in range(0, self.count, size)]
        if self.piece is None:
            return [LocalBatch(self.needs, c, None) for c in counts]
        return [LocalBatch(self.needs, c, p) for c, p in zip(counts, self.piece.split(size))]

    def chunk(self, parts: int) -> list[LocalBatch]:
        """`parts` row blocks, as `Tensor.chunk`."""
        return self.split(-(-self.count // parts))

    def inputs(self, masked: bool) -> torch.Tensor | None:
        """(B, T_local) token ids, None off the ranks that embed them."""
        if not self.needs.inputs:
            return None
        x = self.needs._parts(self.piece, 0)
        return sft.strip_mask(x) if masked else x

    def targets(self, masked: bool) -> torch.Tensor | None:
        """(B, T_local) target ids (IGNORE where a masked target does not count), None off the last stage."""
        if not self.needs.targets:
            return None
        y = self.needs._parts(self.piece, 1 if self.needs.inputs else 0)
        return sft.as_targets(y) if masked else y

    def target_counts(self) -> tuple[int, torch.Tensor]:
        """(local targets, of them the ones that count) for the masked loss's scale
        (raydist.training.runners.MaskScale)."""
        y = self.needs._parts(self.piece, 1 if self.needs.inputs else 0)
        return y.numel(), (y < sft.NOT_TARGET).sum()

    def positions(self, device: torch.device) -> torch.Tensor | None:
        """(T_local,) positions of the local tokens under context parallelism, else None (every stage needs
        them, for RoPE, whether it holds tokens or not)."""
        return self.needs.positions(device) if self.needs.sharded else None


class BatchTransfer:
    """Hands each batch peer its `BatchNeeds` of the leader's rows (the module docstring's transfer)."""

    def __init__(self, mesh, layout, seq_len: int, device: torch.device):
        self.mesh, self.device = mesh, device
        self.peers = [int(r) for r in mesh.batch_peers.mesh.flatten().tolist()]
        self.leader = mesh.batch_leader_rank
        coords = {r: mesh.spec.coordinates(r) for r in self.peers}
        self.needs_of = {r: rank_needs(layout, seq_len, c["pp"], c["cp"]) for r, c in coords.items()}
        self.needs = self.needs_of[mesh.rank]
        self.is_tp_source = mesh.local_rank("tp") == 0
        # the tp = 0 peers that need something receive from the leader; their tp peers from them
        self.receivers = [r for r in self.peers
                          if r != self.leader and coords[r]["tp"] == 0 and not self.needs_of[r].empty]
        self.group = mesh.batch_peers.get_group() if len(self.peers) > 1 else None
        self.tp_group = mesh["tp"].get_group() if layout.tp > 1 else None
        self.tp_source = int(mesh["tp"].mesh[0]) if layout.tp > 1 else mesh.rank

    def share(self, rows: torch.Tensor | None, count: int) -> LocalBatch:
        """`rows` (count, T + 1) on the leader (None elsewhere) -> every peer's LocalBatch; a collective
        over the batch peers that need anything (the others return at once)."""
        needs = self.needs
        if self.group is None:
            return LocalBatch.of_rows(rows, needs)
        if needs.empty:
            return LocalBatch(needs, count, None)
        sends, piece = [], None
        if self.mesh.rank == self.leader:
            for r in self.receivers:
                part = self.needs_of[r].take(rows)
                sends.append((part, dist.isend(part, dst=r, group=self.group)))
            piece = needs.take(rows)
        elif self.is_tp_source:
            piece = torch.empty(count, needs.width, dtype=torch.int64, device=self.device)
            dist.recv(piece, src=self.leader, group=self.group)
        if self.tp_group is not None:
            if piece is None:
                piece = torch.empty(count, needs.width, dtype=torch.int64, device=self.device)
            dist.broadcast(piece, src=self.tp_source, group=self.tp_group)
        for _, work in sends:
            work.wait()
        return LocalBatch(needs, count, piece)
