"""The order of training samples as a pure function of (seed, epoch), addressed by a global position.

Position p (the number of samples consumed before it, across all ranks and restarts) names one sample:

    epoch = p // N,   q = p % N
    shards are visited in permutation(seed, epoch) order; rows inside shard s in permutation(seed, epoch, s)
    sample(p) = the q-th row of that walk

The two-level shuffle keeps the walk local (one shard at a time, so a reader streams shards in order)
and costs O(num_shards + rows_per_shard) memory instead of O(N).

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


def _rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in keys]))


@dataclass(frozen=True)
class Location:
    epoch: int
    shard: int  # index into the manifest's shard list
    row: int  # row inside that shard


class SampleOrder:
    def __init__(self, shard_rows: list[int], seed: int, shuffle: bool = True):
        if not shard_rows or sum(shard_rows) == 0:
            raise ValueError("an empty dataset has no sample order")
        self.shard_rows = list(shard_rows)
        self.seed = seed
        self.shuffle = shuffle
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
        n = self.shard_rows[shard]
        return _rng(self.seed, epoch, 2, shard).permutation(n) if self.shuffle else np.arange(n)

    def locate(self, position: int) -> Location:
        epoch, q = divmod(position, self.num_samples)
        starts = self._epoch_starts(epoch)
        k = bisect.bisect_right(starts, q) - 1
        shard = int(self.shard_order(epoch)[k])
        return Location(epoch, shard, int(self.row_order(epoch, shard)[q - starts[k]]))

    def sample_id(self, position: int) -> int:
        loc = self.locate(position)
        return int(self.first_id[loc.shard] + loc.row)

    def sample_ids(self, start: int, count: int) -> np.ndarray:
        return np.array([self.sample_id(p) for p in range(start, start + count)], dtype=np.int64)

    def shards_from(self, position: int):
        """Yields (epoch, shard) in the order the walk from `position` visits them, forever."""
        epoch, q = divmod(position, self.num_samples)
        starts = self._epoch_starts(epoch)
        k = bisect.bisect_right(starts, q) - 1
        while True:
            order = self.shard_order(epoch)
            for shard in order[k:]:
                if self.shard_rows[int(shard)]:
                    yield epoch, int(shard)
            epoch, k = epoch + 1, 0


def rank_slice(position: int, global_batch: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """[start, stop) positions that dp rank `dp_rank` of `dp_size` takes from the global batch at
    `position`. global_batch must be divisible by dp_size (the layout policy guarantees it)."""
    if global_batch % dp_size:
        raise ValueError(f"global_batch={global_batch} is not divisible by the data-parallel size {dp_size}")
    per_rank = global_batch // dp_size
    start = position + dp_rank * per_rank
    return start, start + per_rank
