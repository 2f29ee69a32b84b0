"""What the planner is given (`Workload`) and how it reads a `Layout` (raydist.parallel.layout: the one layout
class, the same the runtime trains with): plain data, no torch.

A planner layout is a `raydist.parallel.layout.Layout`: the five mesh degrees plus the knobs that change memory and
time without changing the math (micro-batch size, activation recompute, sequence parallelism, the
context-parallel and pipeline algorithms, FSDP resharding), and the pipeline's stage partition.

The workload carries the config's [peft] section, which decides what trains (raydist.models.peft): every
parameter (`none`); LoRA's adapters only, in every block (`lora`); or the last `trainable_last_layers` blocks
with the final norm and an untied head (`freeze`), whose earlier blocks run forward only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from raydist.config import Config, ModelConfig, PeftConfig
from raydist.parallel.layout import Layout, stage_partition
from raydist.schedule.actions import stages_of_rank
from raydist.schedule.registry import placement_of

__all__ = ["Layout", "Workload", "rank_layer_counts", "trained_layer_counts", "holds_stage", "holders",
           "every_k_segment"]


@dataclass(frozen=True)
class Workload:
    """The model and the batch; independent of the layout."""

    model: ModelConfig
    seq_len: int
    global_batch: int  # samples per optimizer step
    compute_dtype_bytes: int = 2  # 2: bf16 autocast / FSDP mixed precision; 4: fp32
    name: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    peft: PeftConfig = PeftConfig()  # what trains: everything, LoRA's adapters, or the last blocks
    loss: str = "auto"  # kernels.loss: `auto` (and `triton`) fuse the head's matmul and the loss (every layout)

    @property
    def fused_loss(self) -> bool:
        """Whether the loss runs fused (the head's matmul and the loss a chunk of tokens at a time, in every
        layout, vocabulary-parallel under TP) and so never holds the logits."""
        return self.loss != "plain"

    @classmethod
    def from_config(cls, cfg: Config, compute_dtype_bytes: int, name: str = "") -> "Workload":
        if cfg.train.dtype == "fp32":
            compute_dtype_bytes = 4
        elif cfg.train.dtype == "bf16":
            compute_dtype_bytes = 2
        return cls(cfg.model, cfg.data.seq_len, cfg.train.global_batch, compute_dtype_bytes, name, peft=cfg.peft,
                   loss=cfg.kernels.loss)

    def fully_trained(self) -> "Workload":
        """This workload with every parameter trained (peft.method none)."""
        return self if self.peft.method == "none" else dataclasses.replace(self, peft=PeftConfig())

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
    return list(_per_rank(_stage_layers(w, lay), lay.pp, lay.virtual_stages, placement_of(lay.pp_schedule)))


def _stage_layers(w: Workload, lay: Layout) -> tuple[int, ...]:
    """Blocks of each virtual stage: the layout's partition, or the runtime's when it carries none."""
    if lay.stage_layers:
        return lay.stage_layers
    return stage_partition(w.model, lay.num_stages) if lay.pp > 1 else (w.model.num_layers,)


@functools.lru_cache(maxsize=4096)
def _per_rank(stages: tuple[int, ...], pp: int, virtual_stages: int, placement: str) -> tuple[int, ...]:
    if pp == 1:
        return (sum(stages),)
    return tuple(sum(stages[s] for s in stages_of_rank(placement, pp, virtual_stages, r)) for r in range(pp))


def trained_layer_counts(w: Workload, lay: Layout) -> list[int]:
    """Blocks with trained parameters on each pipeline rank: `rank_layer_counts` under none and lora (LoRA
    adapts every block); under freeze the rank's blocks among the last k = trainable_last_layers. Nothing
    before a frozen prefix requires a gradient, so its blocks build no autograd graph: they run forward only,
    save no activations and are not recomputed."""
    counts = rank_layer_counts(w, lay)
    if w.peft.method != "freeze":
        return counts
    return list(_trained_per_rank(_stage_layers(w, lay), lay.pp, lay.virtual_stages, placement_of(lay.pp_schedule),
                                  w.peft.trainable_last_layers))


@functools.lru_cache(maxsize=4096)
def _trained_per_rank(stages: tuple[int, ...], pp: int, virtual_stages: int, placement: str,
                      k: int) -> tuple[int, ...]:
    starts = [sum(stages[:s]) for s in range(len(stages))]
    first_trained = sum(stages) - k  # blocks first_trained .. L - 1 train

    def trained(s: int) -> int:
        return max(0, starts[s] + stages[s] - max(starts[s], first_trained))

    if pp == 1:
        return (sum(trained(s) for s in range(len(stages))),)
    return tuple(sum(trained(s) for s in stages_of_rank(placement, pp, virtual_stages, r)) for r in range(pp))


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
