"""The Trainer's pipeline step: this rank's rows -> micro-batches -> the executor -> tied sync -> clipping.

With pp > 1, `Trainer.train_step` hands its rows (B_rank, T + 1) to `PipelineRunner.step` instead of the
gradient-accumulation loop: the M micro-batches (parallel.num_microbatches, or the accumulation steps)
flow through the schedule (parallel.pp_schedule) and their gradients accumulate in the chunks; then a
tied embedding split across the first and last stage gets its summed gradient, and the gradient is
clipped by the norm of the whole model across the pipeline.
"""

from __future__ import annotations

import torch

from raydist.config import Config, ConfigError
from raydist.mesh import Mesh
from raydist.parallel import ParallelModel
from raydist.parallel.pipeline import TiedEmbeddingSync, clip_grad_norm_pipeline
from raydist.schedule import make_schedule
from raydist.schedule.executor import (PipelineExecutor, PipelineStepStats, ddp_grad_sync, fsdp_grad_sync,
                                       stage_timings)


def num_microbatches(cfg: Config, per_rank_batch: int) -> int:
    m = cfg.parallel.num_microbatches or per_rank_batch // cfg.train.micro_batch
    if per_rank_batch % m:
        raise ConfigError(f"parallel.num_microbatches={m} does not divide the per-rank batch {per_rank_batch} "
                          "(train.global_batch / dp); pick a divisor of it")
    return m


class PipelineRunner:
    def __init__(self, pm: ParallelModel, mesh: Mesh, cfg: Config, device: torch.device):
        p = cfg.parallel
        self.pm, self.device = pm, device
        self.group = mesh["pp"].get_group()
        per_rank = cfg.train.global_batch // mesh.spec.dp
        self.num_microbatches = num_microbatches(cfg, per_rank)
        virtual = p.virtual_stages if p.pp_schedule == "interleaved" else 1
        schedule = make_schedule(p.pp_schedule, p.pp, self.num_microbatches, virtual)
        if pm.kind in ("fsdp", "hsdp"):
            before_backward = fsdp_grad_sync(pm.chunk_modules)
        elif pm.kind == "ddp":
            before_backward = ddp_grad_sync(pm.chunk_modules)
        else:
            before_backward = None
        self.tied = TiedEmbeddingSync(pm.chunks, self.group)
        # FSDP's mixed precision casts parameters (activations come out in the compute dtype); under
        # autocast the residual stream stays fp32.
        bf16_stream = pm.kind in ("fsdp", "hsdp") and pm.compute_dtype != torch.float32
        self.executor = PipelineExecutor(
            pm.chunk_modules, schedule, mesh.local_rank("pp"), self.group,
            activation_shape=(per_rank // self.num_microbatches, cfg.data.seq_len, cfg.model.d_model),
            loss_fn=pm.loss_fn, device=device, activation_dtype=pm.compute_dtype if bf16_stream else torch.float32,
            before_backward=before_backward)

    def _split(self, tokens: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        micro = tokens.chunk(self.num_microbatches)
        return [m[:, :-1] for m in micro], [m[:, 1:] for m in micro]

    def step(self, tokens: torch.Tensor) -> PipelineStepStats:
        """Forward/backward of all micro-batches of this rank's rows; gradients left in the chunks."""
        stats = self.executor.step(*self._split(tokens))
        self.tied()
        return stats

    def evaluate(self, tokens: torch.Tensor) -> float:
        return self.executor.evaluate(*self._split(tokens))

    def clip(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_pipeline(self.pm.chunks, max_norm, self.group)

    def gather_timeline(self) -> list[dict]:
        """The last step's actions with their start and end (seconds from the step's start) on every
        pipeline rank, for the report; a collective over the pipeline group. Set
        `executor.record_timeline` before the step."""
        gathered: list = [None] * torch.distributed.get_world_size(self.group)
        torch.distributed.all_gather_object(gathered, self.executor.timeline, group=self.group)
        return [{"rank": r, **a} for r, actions in enumerate(gathered) for a in actions]

    def timings(self, stats: PipelineStepStats) -> dict:
        """Every stage's busy and idle seconds of the step (a collective over the pipeline group)."""
        t = stage_timings(stats, self.group, device=self.device)
        return {"busy_s": t["pp_busy_s"], "idle_s": t["pp_idle_s"],
                "bubble": round(sum(t["pp_bubble"]) / len(t["pp_bubble"]), 4)}
