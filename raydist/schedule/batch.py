"""One batch plan: how a step's global batch splits over the data-parallel ranks and into micro-batches.

    global_batch = dp x per_rank,   per_rank = micro_batch x num_microbatches

Whatever needs a rank's rows, the micro-batch or the micro-batch count derives it here: the layout policy
(`plan_batch`, planner/policy.py), the planner's enumeration and cost model, live recovery's micro-batch of
a replica's share (`largest_divisor`, elastic/live.py), a data-parallel rank's slice of the global batch
(`per_rank_rows`, data/position.py) and the pipeline runner's split of a batch (`microbatch_count`,
training/runners.py).

An unset micro-batch (train.micro_batch = 0), or a set one in a run where it is an upper bound (elastic
ranges, where dp changes with the worker count), is the largest divisor of the per-rank rows not above the
limit; with a pipeline, one that also gives the schedule the micro-batch count it needs (at least pp, a
multiple of pp when interleaved) where such a divisor exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from raydist.errors import ConfigError
from raydist.schedule.registry import DEFAULT_KIND, SCHEDULE_KINDS

AUTO_MICRO_BATCH_LIMIT = 8


def divisors(n: int) -> list[int]:
    """Every divisor of n >= 1, ascending."""
    return [k for k in range(1, n + 1) if n % k == 0]


def largest_divisor(n: int, limit: int) -> int:
    """The largest divisor of `n` not above `limit` (1 at least): equal micro-batches, so their mean loss is
    the mean over the rows."""
    return max(d for d in range(1, min(n, max(limit, 1)) + 1) if n % d == 0)


def per_rank_rows(global_batch: int, dp: int) -> int:
    """The rows each of `dp` data-parallel ranks takes of a global batch; a ValueError when they differ."""
    if global_batch % dp:
        raise ValueError(f"global_batch={global_batch} is not divisible by the data-parallel size {dp}")
    return global_batch // dp


def microbatch_count(rows: int, micro_batch: int) -> int:
    """How many `micro_batch`-row micro-batches `rows` rows make; a ValueError when not a whole number."""
    if rows % micro_batch:
        raise ValueError(f"{rows} rows are no whole number of {micro_batch}-row micro-batches")
    return rows // micro_batch


def splits(global_batch: int, dp: int, micro_batch: int) -> bool:
    """Whether global_batch = dp x micro_batch x M for a whole M."""
    return global_batch % (dp * micro_batch) == 0


@dataclass(frozen=True)
class BatchPlan:
    """One step's batch: `global_batch` rows over `dp` ranks, each running micro-batches of `micro_batch`."""

    global_batch: int
    dp: int
    micro_batch: int

    def __post_init__(self):
        microbatch_count(per_rank_rows(self.global_batch, self.dp), self.micro_batch)

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.dp

    @property
    def num_microbatches(self) -> int:
        return self.per_rank // self.micro_batch


def auto_micro_batch(per_rank: int, limit: int, pp: int = 1, schedule: str = DEFAULT_KIND) -> int:
    """The largest divisor of `per_rank` not above `limit`; with a pipeline, one giving M >= pp micro-batches
    (and what else the schedule needs of M: a multiple of pp when interleaved), when such a divisor exists."""
    if pp > 1:
        kind = SCHEDULE_KINDS.get(schedule)
        fitting = [d for d in divisors(per_rank) if d <= limit and per_rank // d >= pp and
                   (kind is None or kind.microbatch_problem(kind.name, pp, per_rank // d, True) is None)]
        if fitting:
            return max(fitting)
    return largest_divisor(per_rank, limit)


def plan_batch(global_batch: int, dp: int, *, micro_batch: int = 0, limit: int | None = None, pp: int = 1,
               schedule: str = DEFAULT_KIND, num_microbatches: int = 0) -> BatchPlan:
    """The batch plan of a config on `dp` data-parallel ranks, or a ConfigError naming the value and the fix.

    With a pipeline and `num_microbatches` (parallel.num_microbatches) set: per-rank rows / M. Else
    `micro_batch` (train.micro_batch) as given, which must divide the per-rank rows; when it is unset (0),
    or `limit` is given (it is then an upper bound: elastic runs), `auto_micro_batch` up to the limit
    (AUTO_MICRO_BATCH_LIMIT when none)."""
    if global_batch % dp:
        micro = f" x train.micro_batch ({micro_batch})" if micro_batch else ""
        raise ConfigError(f"train.global_batch={global_batch} must be divisible by dp ({dp}){micro}; change "
                          "global_batch, micro_batch or the layout (the worker count)")
    per_rank = global_batch // dp
    if pp > 1 and num_microbatches:
        if per_rank % num_microbatches:
            raise ConfigError(f"parallel.num_microbatches={num_microbatches} does not divide the per-rank batch "
                              f"{per_rank} (train.global_batch / dp); pick a divisor of it")
        return BatchPlan(global_batch, dp, per_rank // num_microbatches)
    if micro_batch and limit is None:
        if per_rank % micro_batch:
            raise ConfigError(f"train.global_batch={global_batch} must be divisible by dp ({dp}) x "
                              f"train.micro_batch ({micro_batch}); change global_batch, micro_batch or the layout")
        return BatchPlan(global_batch, dp, micro_batch)
    return BatchPlan(global_batch, dp, auto_micro_batch(per_rank, limit or AUTO_MICRO_BATCH_LIMIT, pp, schedule))
