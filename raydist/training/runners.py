"""Step runners: one rank's forward and backward of a step's rows, the same interface with and without a
pipeline, so the Trainer has no pipeline branches.

    runner.step(batch) -> StepOutput    forward + backward of this rank's part of its dp rank's rows; gradients
                                        left in the parameters, synchronised across data-parallel ranks
    runner.evaluate(batch) -> loss      forwards only
    runner.clip(max_norm) -> norm       clip by the whole model's gradient norm
    runner.timings(outputs) -> figures  per step: every pipeline stage's times and, when asked, its actions
                                        (a collective: at a logged step; None without a pipeline)

Nothing in `step` or `clip` makes the host wait for the device: losses, norms and times stay on the device
(or in unread CUDA events) until the Trainer reads them at a logged step, so the host runs ahead of the GPU.

`AccumulationRunner`: the rows in micro-batches of layout.micro_batch, gradients accumulated, the
data-parallel strategy communicating only on the last (`accumulate`). `PipelineRunner`: the M micro-batches
flow through the schedule (`raydist.schedule`), then a tied embedding split across the first and last stage
gets its summed gradient. Losses are this rank's means over its tokens; the Trainer averages them over the
data ranks. Autocast and gradient sync come from the model's data-parallel strategy.

A batch is a `LocalBatch` (raydist.data.peers: the columns of the rows this rank uses, its context-parallel
tokens, none on a middle pipeline stage) or the dp rank's whole rows (B_rank, T + 1), which the runner
cuts to the same columns itself (`_local`).

Prompt/response data (`masked`): targets that do not count are IGNORE, each micro-batch's loss is the sum
over counted targets / all its targets (what every plan's `pm.loss_fn` computes, the vocabulary-parallel
one included), times the step's global targets / counted targets (`MaskScale`: one all-reduce over the
dp x cp ranks), so the averages above give the mean over counted tokens (raydist.data.sft). Both
runners do it: under a pipeline the last stage's loss of each micro-batch carries the scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from raydist.data.peers import BatchNeeds, LocalBatch
from raydist.parallel.clip import clip_grad_norm
from raydist.parallel.layout import Layout
from raydist.parallel.mesh import Mesh
from raydist.parallel.parallelize import ParallelModel
from raydist.parallel.pipeline import TiedEmbeddingSync, clip_grad_norm_pipeline
from raydist.schedule.batch import microbatch_count
from raydist.schedule.clock import ActionClock
from raydist.schedule.registry import SCHEDULE_KINDS, make_schedule

if TYPE_CHECKING:
    from raydist.parallel.pipeline_executor import PipelineExecutor, PipelineStepStats


@dataclass
class MicroBatch:
    inputs: torch.Tensor  # (B, T) token ids (T local under context parallelism)
    targets: torch.Tensor  # (B, T)
    positions: torch.Tensor | None  # (T,) positions in the full sequence, when the sequence is sharded


@dataclass
class StepOutput:
    loss: torch.Tensor  # 0-d fp32 on the device: this rank's mean loss over the step's rows
    compute_s: Callable[[], float] | None = None  # this rank's own compute time (on CUDA, reading it reads events)
    pipeline: PipelineStepStats | None = None  # pp > 1: the schedule's step on this rank, read by `timings`
    timeline: bool = False  # pp > 1: every stage's actions are wanted for this step (gathered by `timings`)


# per step: (every stage's busy and idle seconds and the mean bubble, every stage's actions when asked)
StepTimings = tuple[dict | None, list[dict] | None]


class MaskScale:
    """The step's N_targets / N_counted over every data-parallel rank's rows (1 for unmasked data), on the
    ranks that compute a loss. cp ranks hold disjoint targets of the same rows and tp ranks the same ones,
    so summing the local counts over the dp x cp group (`dp_cp_group`) gives the global counts everywhere."""

    def __init__(self, masked: bool, dp_cp_group, device: torch.device):
        self.masked, self.group, self.device = masked, dp_cp_group, device
        self.value = torch.ones((), device=device)

    def update(self, batch: LocalBatch) -> None:
        if not self.masked:
            return
        targets, counted = batch.target_counts()
        # (a fill, not a copy of host data: a blocking host-to-device copy would wait for the device)
        total = torch.full((), targets, dtype=torch.float64, device=counted.device)
        counts = torch.stack([total, counted.to(torch.float64)]).to(self.device)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(counts, group=self.group)
        self.value = (counts[0] / counts[1].clamp_min(1)).float()


def _local(tokens: torch.Tensor | LocalBatch, needs: BatchNeeds) -> LocalBatch:
    """A LocalBatch as is; the dp rank's whole rows cut to `needs` (no communication)."""
    return tokens if isinstance(tokens, LocalBatch) else LocalBatch.of_rows(tokens, needs)


class AccumulationRunner:
    rows_multiple = 1  # any number of rows: `step` takes the micro-batch that divides them (live recovery)

    def __init__(self, pm: ParallelModel, layout: Layout, device: torch.device, needs: BatchNeeds,
                 masked: bool = False, dp_cp_group=None):
        self.pm, self.layout, self.device = pm, layout, device
        self.params = [p for p in pm.model.parameters() if p.requires_grad]
        self.needs = needs
        self.masked = masked
        self.mask_scale = MaskScale(masked, dp_cp_group, device)
        self.clock = ActionClock(device)  # the forwards' times (CUDA events on a GPU)

    def autocast(self):
        return self.pm.data_parallel.autocast(self.device.type)

    def micro_batches(self, tokens: torch.Tensor | LocalBatch, micro_batch: int | None = None) -> list[MicroBatch]:
        """(inputs, targets, positions) per micro-batch of this rank's rows; `positions` is None unless the
        sequence is sharded (context parallelism: this rank's tokens, raydist.data.peers). `micro_batch` must
        divide the rows (equal micro-batches keep the mean of their means the mean over the rows)."""
        batch = _local(tokens, self.needs)
        return [MicroBatch(part.inputs(self.masked), part.targets(self.masked), part.positions(self.device))
                for part in batch.split(micro_batch or self.layout.micro_batch)]

    def forward_loss(self, micro: MicroBatch) -> torch.Tensor:
        """The mean loss over this rank's tokens of one micro-batch (the one place a parallel plan may
        change how logits become a loss: `pm.loss`, the head's fused loss or `pm.loss_fn` of the logits, e.g.
        a vocabulary-parallel cross-entropy)."""
        with self.autocast():
            return self.pm.loss(micro.inputs, micro.positions, micro.targets,
                                scale=self.mask_scale.value if self.masked else None)

    def step(self, tokens: torch.Tensor | LocalBatch, record_timeline: bool = False,
             micro_batch: int | None = None) -> StepOutput:
        """`micro_batch` overrides the layout's for this step (live recovery: a replica's share of the global
        batch changes with the number of live replicas)."""
        batch = _local(tokens, self.needs)
        micro = self.micro_batches(batch, micro_batch)
        self.pm.set_micro_batches(len(micro))
        self.mask_scale.update(batch)
        total = torch.zeros((), device=self.device)
        # The forwards' durations: with DDP the forward runs no collective, so this is the rank's own compute
        # however long its peers take (the straggler signal; backward waits for the slowest rank's gradients).
        self.clock.start_step()
        for i, mb in enumerate(micro):
            with self.pm.data_parallel.accumulate(self.pm.module, i == len(micro) - 1):
                began = self.clock.begin()
                loss = self.forward_loss(mb) / len(micro)
                self.clock.end(began, {"kind": "F", "microbatch": i})
                loss.backward()
            total += loss.detach().float()
        times = self.clock.finish()
        return StepOutput(total, compute_s=lambda: times.busy_s)

    @torch.no_grad()
    def evaluate(self, tokens: torch.Tensor | LocalBatch) -> torch.Tensor:
        batch = _local(tokens, self.needs)
        micro = self.micro_batches(batch)
        self.mask_scale.update(batch)
        total = torch.zeros((), device=self.device)
        for mb in micro:
            total += self.forward_loss(mb).float() / len(micro)
        return total

    def clip(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(self.params, max_norm)

    def timings(self, outputs: list[StepOutput]) -> list[StepTimings]:
        return [(None, None)] * len(outputs)


class PipelineRunner:
    """pp > 1: this rank's rows -> M micro-batches -> the executor -> tied sync; clipping across stages."""

    def __init__(self, pm: ParallelModel, layout: Layout, mesh: Mesh, device: torch.device, needs: BatchNeeds,
                 masked: bool = False):
        self.pm, self.layout, self.device = pm, layout, device
        self.needs = needs  # inputs on the rank holding the first stage, targets on the one holding the last
        self.masked = masked
        self.mask_scale = MaskScale(masked, mesh.dp_cp.get_group() if masked else None, device)
        self.group = mesh["pp"].get_group()
        self.pp_rank = mesh.local_rank("pp")
        self.tied = TiedEmbeddingSync(pm.chunks, self.group)
        # between stages: this rank's part of the sequence (T / cp; a tp-th of that under sequence parallelism)
        self.seq_len = pm.model.max_seq_len // layout.cp // (layout.tp if layout.sequence_parallel else 1)
        self.hooks = pm.data_parallel.pipeline_hooks(pm.modules, SCHEDULE_KINDS[layout.pp_schedule].split_backward)
        self._executors: dict[tuple[int, int], PipelineExecutor] = {}
        self._executor(layout.micro_batch, layout.num_microbatches)  # the layout's own, checked now

    @property
    def rows_multiple(self) -> int:
        """A dp rank's rows must be a multiple of this for `step(micro_batch=layout.micro_batch)`: whole
        micro-batches, and a count interleaved 1F1B can run (a multiple of pp). Live recovery's replicas take
        whole multiples of it, at least the whole run's M micro-batches per rank (zero-bubble schedules need
        M >= pp, which the layout already has)."""
        kind = SCHEDULE_KINDS[self.layout.pp_schedule]
        return self.layout.micro_batch * (self.layout.pp if kind.microbatches_multiple_of_ranks else 1)

    def _executor(self, micro_batch: int, num_microbatches: int) -> "PipelineExecutor":
        """The executor of the layout's schedule for M = num_microbatches micro-batches of micro_batch rows,
        built once per shape (a live replica's share of the global batch changes M with the quorum)."""
        from raydist.parallel.pipeline_executor import PipelineExecutor

        key = (micro_batch, num_microbatches)
        if key not in self._executors:
            layout, pm = self.layout, self.pm
            schedule = make_schedule(layout.pp_schedule, layout.pp, num_microbatches, layout.virtual_stages)
            before, after = self.hooks
            self._executors[key] = PipelineExecutor(
                pm.modules, schedule, self.pp_rank, self.group,
                activation_shape=(micro_batch, self.seq_len, pm.model.cfg.d_model),
                stage_loss=self._stage_loss, device=self.device,
                activation_dtype=pm.data_parallel.activation_dtype, before_backward=before, after_backward=after)
        return self._executors[key]

    def _stage_loss(self, chunk: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor | None,
                    targets: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch (the executor divides it by M): `pm.loss` through the
        chunk, the head's fused loss or `pm.loss_fn` of its logits, rescaled for masked data."""
        return self.pm.loss(x, positions, targets, module=chunk, scale=self.mask_scale.value if self.masked else None)

    def _split(self, tokens: torch.Tensor | LocalBatch, micro_batch: int | None = None
               ) -> tuple["PipelineExecutor", list[torch.Tensor] | None, list[torch.Tensor] | None, torch.Tensor | None]:
        """The executor for this batch's M = rows / micro_batch (the layout's), M micro-batches of inputs (the
        first stage's rank; None elsewhere) and of targets (the last stage's; IGNORE targets for masked
        data), this rank's sequence shard of them under context parallelism, and the shard's positions (the
        same for every micro-batch and every stage)."""
        batch = _local(tokens, self.needs)
        micro = micro_batch or self.layout.micro_batch
        count = microbatch_count(batch.count, micro)
        executor = self._executor(micro, count)
        self.pm.set_micro_batches(count)
        if self.needs.targets:
            self.mask_scale.update(batch)
        parts = batch.split(micro)
        inputs = [p.inputs(self.masked) for p in parts] if self.needs.inputs else None
        targets = [p.targets(self.masked) for p in parts] if self.needs.targets else None
        return executor, inputs, targets, batch.positions(self.device)

    def step(self, tokens: torch.Tensor | LocalBatch, record_timeline: bool = False,
             micro_batch: int | None = None) -> StepOutput:
        """`micro_batch`: as the AccumulationRunner's (live recovery), a divisor of the rows; the schedule
        then runs rows / micro_batch micro-batches."""
        executor, inputs, targets, positions = self._split(tokens, micro_batch)
        with self.pm.data_parallel.autocast(self.device.type):
            stats = executor.step(inputs, targets, positions=positions)
        self.tied()
        return StepOutput(stats.loss, compute_s=lambda: stats.busy_s, pipeline=stats, timeline=record_timeline)

    def evaluate(self, tokens: torch.Tensor | LocalBatch) -> torch.Tensor:
        executor, inputs, targets, positions = self._split(tokens)
        with self.pm.data_parallel.autocast(self.device.type):
            return executor.evaluate(inputs, targets, positions)

    def clip(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_pipeline(self.pm.chunks, max_norm, self.group)

    def timings(self, outputs: list[StepOutput]) -> list[StepTimings]:
        """Per step of `outputs`: every stage's busy and idle seconds and the mean bubble, and every stage's
        actions where the step asked for them. Collectives over the pipeline group (one all-gather for all
        the steps' times, one object gather per timeline): every pipeline rank calls it with the same
        steps, at a logged step."""
        from raydist.parallel.pipeline_executor import stage_timings

        figures = [{"busy_s": t["pp_busy_s"], "idle_s": t["pp_idle_s"],
                    "bubble": round(sum(t["pp_bubble"]) / len(t["pp_bubble"]), 4)}
                   for t in stage_timings([o.pipeline for o in outputs], self.group, device=self.device)]
        return [(f, self._gather_timeline(o.pipeline) if o.timeline else None) for f, o in zip(figures, outputs)]

    def _gather_timeline(self, stats: PipelineStepStats) -> list[dict]:
        """The step's actions with their start and end (seconds from the step's start) on every pipeline
        rank, for the report; a collective over the pipeline group."""
        gathered: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, stats.timeline, group=self.group)
        return [{"rank": r, **a} for r, actions in enumerate(gathered) for a in actions]


def make_runner(pm: ParallelModel, layout: Layout, mesh: Mesh, device: torch.device, needs: BatchNeeds,
                masked: bool = False):
    """`needs`: what this rank uses of its dp rank's rows (raydist.data.peers.rank_needs); `masked`: the data
    has loss masks (prompt/response, raydist.data.sft)."""
    if layout.pp > 1:
        return PipelineRunner(pm, layout, mesh, device, needs, masked)
    return AccumulationRunner(pm, layout, device, needs, masked, mesh.dp_cp.get_group() if masked else None)
