"""What the planner is given (`Workload`) and how it reads a `Layout` (raydist.parallel.layout: the one layout
class, the same the runtime trains with): plain data, no torch.

A planner layout is a `raydist.parallel.layout.Layout`: the five mesh degrees plus the knobs that change memory and
time without changing the math (micro-batch size, activation recompute, sequence parallelism, the
context-parallel and pipeline algorithms, FSDP resharding), and the pipeline's stage partition.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from raydist.config import Config, ModelConfig
from raydist.parallel.layout import Layout, stage_partition
from raydist.schedule.actions import stages_of_rank
from raydist.schedule.registry import placement_of

__all__ = ["Layout", "Workload", "rank_layer_counts", "holds_stage", "holders", "every_k_segment"]


@dataclass(frozen=True)
class Workload:
    """The model and the batch; independent of the layout."""

    model: ModelConfig
    seq_len: int
    global_batch: int  # samples per optimizer step
    compute_dtype_bytes: int = 2  # 2: bf16 autocast / FSDP mixed precision; 4: fp32
    name: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_config(cls, cfg: Config, compute_dtype_bytes: int, name: str = "") -> "Workload":
        if cfg.train.dtype == "fp32":
            compute_dtype_bytes = 4
        elif cfg.train.dtype == "bf16":
            compute_dtype_bytes = 2
        return cls(cfg.model, cfg.data.seq_len, cfg.train.global_batch, compute_dtype_bytes, name)

    @property
    def head_dim(self) -> int:
        return self.model.head_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


def rank_layer_counts(w: Workload, lay: Layout) -> list[int]:
    """Blocks each pipeline rank holds, from the layout's stage partition (computed as the runtime does
    when the layout does not carry one): rank r holds the virtual stages `lay.stages_of(r)` (c x pp + r,
    or r and 2 pp - 1 - r under zbv's V)."""
    stages = lay.stage_layers
    if not stages:
        stages = stage_partition(w.model, lay.num_stages) if lay.pp > 1 else (w.model.num_layers,)
    return list(_per_rank(stages, lay.pp, lay.virtual_stages, placement_of(lay.pp_schedule)))


@functools.lru_cache(maxsize=4096)
def _per_rank(stages: tuple[int, ...], pp: int, virtual_stages: int, placement: str) -> tuple[int, ...]:
    if pp == 1:
        return (sum(stages),)
    return tuple(sum(stages[s] for s in stages_of_rank(placement, pp, virtual_stages, r)) for r in range(pp))


def holds_stage(lay: Layout, rank: int, stage: str) -> bool:
    """Whether pipeline rank `rank` holds the "first" stage (embedding) or the "last" (final norm, head,
    loss): ranks 0 and pp - 1, both rank 0 under zbv."""
    return lay.pp == 1 or rank in holders(lay, stage)


def holders(lay: Layout, stage: str) -> frozenset[int]:
    """The pipeline ranks holding the "first" stage or the "last" (`holds_stage` for every rank at once)."""
    if lay.pp == 1:
        return frozenset({0})
    return _holders(lay.pp, lay.virtual_stages, placement_of(lay.pp_schedule), stage)


@functools.lru_cache(maxsize=4096)
def _holders(pp: int, virtual_stages: int, placement: str, stage: str) -> frozenset[int]:
    index = 0 if stage == "first" else pp * virtual_stages - 1
    return frozenset(r for r in range(pp) if index in stages_of_rank(placement, pp, virtual_stages, r))


def every_k_segment(layers: int, k: int) -> int:
    """raydist.parallel.checkpointing.segment_size for every_k: k, or round(sqrt(layers))."""
    return k or max(1, round(math.sqrt(layers)))
