"""The order of training samples as a pure function of (seed, epoch), addressed by a global position.

Position p (the number of samples consumed before it, across all ranks and restarts) names one sample:

    epoch = p // N,   q = p % N
    shards are visited in permutation(seed, epoch) order; inside shard s, its blocks of b consecutive rows
    in permutation(seed, epoch, s) order, and the rows inside each block in a random order too
    sample(p) = the q-th row of that walk

The two-level shuffle keeps the walk local (one shard at a time, so a reader streams shards in order)
and costs O(num_shards + rows_per_shard) memory instead of O(N). The block level (b = the dataset's
parquet row group size, `row_group_rows` in its manifest) keeps the walk local inside a shard too: b
consecutive positions of the walk are the rows of one row group, so a data-parallel rank whose slice of
each global batch is a multiple of b long reads only the row groups holding its own rows (`RankPlan`,
stream.py). b = 1 is the plain row permutation, with the same random draws as before blocks existed.

Step s of a run with global batch G covers positions [P_s, P_s + G); data-parallel rank r of d takes the
r-th contiguous slice of G/d. Because the slices are cut from the same global sequence, resuming with
another dp size continues with exactly the samples an uninterrupted run would have seen: no sample is
lost or repeated, only who computes it changes.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import numpy as np

from raydist.schedule.batch import per_rank_rows


def _rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in keys]))


@dataclass(frozen=True)
class Location:
    epoch: int
    shard: int  # index into the manifest's shard list
    row: int  # row inside that shard


class SampleOrder:
    def __init__(self, shard_rows: list[int], seed: int, shuffle: bool = True, block: int = 1):
        if not shard_rows or sum(shard_rows) == 0:
            raise ValueError("an empty dataset has no sample order")
        if block < 1:
            raise ValueError(f"block={block} must be >= 1 (rows per row group; 1: rows shuffled one by one)")
        self.shard_rows = list(shard_rows)
        self.seed = seed
        self.shuffle = shuffle
        self.block = block
        self.num_samples = sum(shard_rows)
        self.first_id = np.concatenate([[0], np.cumsum(shard_rows)[:-1]]).astype(np.int64)

    @functools.lru_cache(maxsize=4)
    def shard_order(self, epoch: int) -> np.ndarray:
        n = len(self.shard_rows)
        return _rng(self.seed, epoch, 1).permutation(n) if self.shuffle else np.arange(n)

    @functools.lru_cache(maxsize=8)
    def _epoch_starts(self, epoch: int) -> list[int]:
        rows = np.asarray(self.shard_rows)[self.shard_order(epoch)]
        return np.concatenate([[0], np.cumsum(rows)]).tolist()

    @functools.lru_cache(maxsize=64)
    def row_order(self, epoch: int, shard: int) -> np.ndarray:
        """(rows,) the shard's rows in the order the walk visits them. Blocks of `block` rows: the full
        blocks in a random order, each block's rows in a random order, then the short last block (rows % block
        rows, if any; `prepare` writes none) so that every full block starts at a multiple of `block` in
        the shard's walk. block = 1: exactly permutation(rows) (the order of datasets without row groups)."""
        n, b = self.shard_rows[shard], self.block
        if not self.shuffle:
            return np.arange(n)
        rng = _rng(self.seed, epoch, 2, shard)
        if b == 1:
            return rng.permutation(n)
        full = n // b
        blocks = rng.permutation(full)  # (full,) block visited k-th
        inner = np.argsort(rng.random((full, b)), axis=1)  # (full, b) a random permutation per block
        tail = full * b + rng.permutation(n - full * b)
        return np.concatenate([(blocks[:, None] * b + inner).reshape(-1), tail])

    def locate(self, position: int) -> Location:
        epoch, q = divmod(position, self.num_samples)
        starts = self._epoch_starts(epoch)
        k = bisect.bisect_right(starts, q) - 1
        shard = int(self.shard_order(epoch)[k])
        return Location(epoch, shard, int(self.row_order(epoch, shard)[q - starts[k]]))

    def locate_range(self, start: int, stop: int) -> list[tuple[int, int, np.ndarray]]:
        """Positions [start, stop) as runs [(epoch, shard, rows (n,))] in walk order: the vectorised `locate`."""
        out = []
        p = start
        while p < stop:
            epoch, q = divmod(p, self.num_samples)
            starts = self._epoch_starts(epoch)
            k = bisect.bisect_right(starts, q) - 1
            shard = int(self.shard_order(epoch)[k])
            end = min(stop, p + starts[k + 1] - q)  # the run ends with the shard (or at stop)
            offset = q - starts[k]
            out.append((epoch, shard, self.row_order(epoch, shard)[offset:offset + end - p]))
            p = end
        return out

    def sample_id(self, position: int) -> int:
        loc = self.locate(position)
        return int(self.first_id[loc.shard] + loc.row)

    def sample_ids(self, start: int, count: int) -> np.ndarray:
        return np.array([self.sample_id(p) for p in range(start, start + count)], dtype=np.int64)

    def shards_from(self, position: int):
        """Yields (epoch, shard) in the order the walk from `position` visits them, forever."""
        for epoch, shard, _ in self.walk_from(position):
            yield epoch, shard

    def walk_from(self, position: int):
        """Yields (epoch, shard, first position) in the order the walk from `position` visits shards,
        forever: the shard's rows are positions [first, first + shard_rows[shard])."""
        epoch, q = divmod(position, self.num_samples)
        starts = self._epoch_starts(epoch)
        k = bisect.bisect_right(starts, q) - 1
        while True:
            order, starts = self.shard_order(epoch), self._epoch_starts(epoch)
            for j in range(k, len(order)):
                shard = int(order[j])
                if self.shard_rows[shard]:
                    yield epoch, shard, epoch * self.num_samples + starts[j]
            epoch, k = epoch + 1, 0


def rank_slice(position: int, global_batch: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """[start, stop) positions that dp rank `dp_rank` of `dp_size` takes from the global batch at
    `position`. global_batch must be divisible by dp_size (the layout policy guarantees it)."""
    per_rank = per_rank_rows(global_batch, dp_size)
    start = position + dp_rank * per_rank
    return start, start + per_rank


@dataclass(frozen=True)
class RankPlan:
    """The positions one data-parallel rank takes, known ahead: with step boundaries at positions
    P = phase (mod global_batch), rank r of d takes [P + r G/d, P + (r + 1) G/d) of every step
    (`rank_slice`). A reader uses it to read only the rows, and so the row groups, this rank needs."""

    global_batch: int
    dp_rank: int
    dp_size: int
    phase: int = 0  # step boundaries are the positions = phase (mod global_batch)

    def __post_init__(self):
        per_rank_rows(self.global_batch, self.dp_size)  # (a ValueError when the ranks' shares differ)
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank={self.dp_rank} is outside 0..{self.dp_size - 1}")

    @classmethod
    def at(cls, position: int, global_batch: int, dp_rank: int, dp_size: int) -> "RankPlan":
        """The plan of a rank whose steps start at step boundary `position`."""
        return cls(global_batch, dp_rank, dp_size, position % global_batch)

    @property
    def per_rank(self) -> int:
        return per_rank_rows(self.global_batch, self.dp_size)

    def taken(self, positions: np.ndarray) -> np.ndarray:
        """(n,) bool: which of `positions` this rank takes."""
        offset = (np.asarray(positions, dtype=np.int64) - self.phase) % self.global_batch - self.dp_rank * self.per_rank
        return (offset >= 0) & (offset < self.per_rank)

    def covers(self, start: int, stop: int) -> bool:
        return bool(self.taken(np.arange(start, stop)).all())
