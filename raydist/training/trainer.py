"""One rank's training state and step: mesh -> model -> parallelize -> optimizer -> data -> step.

`Trainer` runs under any initialised process group: a Ray Train worker or a `torch.multiprocessing`
test (`raydist.parallel.runtime.spawn`). One optimizer step:

    positions [P, P + G) of the sample order  ->  this dp rank's slice (G / dp samples)
    -> the step runner: micro-batches of layout.micro_batch forward/backward (gradient sync on the last)
    -> clip by the global norm  ->  AdamW  ->  LR schedule  ->  P += G

Losses are means over every target token of the global batch, so any layout computes the same number.
Layout-specific: the `Layout` (`planner.policy.plan_layout`), the parallelized model and its step runner
(`raydist.training.runners`). The loop around it (logging, evaluation, checkpoints, restarts) is `training.loop.fit`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from raydist.checkpoint.compat import compat_record
from raydist.checkpoint.state import AttributeState, ModelOptimizerState, RNGState, SchedulerState, Stateful
from raydist.config import Config, ConfigError, hf_dir_of
from raydist.data.peers import BatchTransfer, LocalBatch
from raydist.data.position import RankPlan, SampleOrder, rank_slice
from raydist.data.prepare import read_manifest
from raydist.data.readers import make_reader
from raydist.data.sft import check_masked_layout
from raydist.data.stream import SampleStream, Split
from raydist.elastic.hang.trigger import group_timeout_s
from raydist.elastic.diloco import OuterState, outer_optimizer
from raydist.elastic.live import Replicas, SingleReplica
from raydist.kernels import apply_kernels
from raydist.kernels.select import Workload, shared_choices
from raydist.metrics.actions import ACTIONS, doing
from raydist.metrics.kernels import kernel_calls, kernels_ran
from raydist.models.gpt import GPT
from raydist.models.hf_load import load_into_shards
from raydist.models.init import init_weights, materialize
from raydist.models.peft import apply_peft, check_pipeline_stages, is_adapter, parameter_counts
from raydist.parallel.layout import Layout
from raydist.parallel.mesh import Mesh
from raydist.parallel.parallelize import ParallelModel, parallelize
from raydist.parallel.runtime import keep_large_host_allocations_unpooled, set_default_timeout, to_device
from raydist.planner.policy import plan_layout
from raydist.strict.purposes import DEVICE, HOST, group_backend, new_group
from raydist.training.optim import (build_optimizer, compute_dtype_for, full_gradients,  # noqa: F401
                                    lr_lambda, peak_memory_mb)
from raydist.training.runners import StepOutput, StepTimings, make_runner

# the (0-based) step whose pipeline actions are kept for the report, after warm-up (read with the next logged step)
TIMELINE_STEP = 2


class StepStats:
    """One step's figures. Nothing in a step makes the host wait for the device: loss, gradient norm and the
    pipeline's stage times stay on the device (or in unread CUDA events) until read, and reading any of them
    settles every pending step (`Trainer.settle`: one all-reduce over dp x cp and one host read for all their
    losses and norms; with a pipeline one all-gather and one more read for all their stage times), so a loop
    that reads them on logged steps only lets the host run ahead of the GPU in between. Reading is a
    collective: all ranks read on the same steps (`records_timeline` is not a read)."""

    def __init__(self, trainer: "Trainer | None", local_loss: torch.Tensor | float, grad_norm: torch.Tensor | float,
                 lr: float, step_time_s: float, data_wait_s: float, sample_ids: np.ndarray | None = None,
                 output: StepOutput | None = None):
        self._trainer = trainer
        self._local_loss, self._grad_norm = local_loss, grad_norm
        self._loss: float | None = None
        self.lr, self.step_time_s, self.data_wait_s, self.sample_ids = lr, step_time_s, data_wait_s, sample_ids
        self.replicas: int | None = None  # live recovery: replicas in this step's quorum
        self.weight = 1.0  # live recovery: this replica's rows / the global batch
        self._output = output  # the runner's: this rank's compute time, the pipeline's step
        self.records_timeline = output is not None and output.timeline  # its `pipeline_timeline` will be read
        self._pipeline: dict | None = None
        self._timeline: list[dict] | None = None
        if not isinstance(local_loss, torch.Tensor):  # already reduced over the whole batch (a replica quorum's)
            self._resolve(float(local_loss), float(grad_norm), trainer.runner.timings([output])[0])

    @property
    def busy_s(self) -> float:
        """This rank's own work in the step: data wait + its forwards (its pipeline actions with pp > 1),
        the straggler signal (raydist.metrics.stragglers). Not a collective; on CUDA it reads events (after
        a settle: without waiting)."""
        compute = self._output.compute_s if self._output is not None else None
        return self.data_wait_s + (compute() if compute is not None else 0.0)

    @property
    def settled(self) -> bool:
        return self._loss is not None

    def _resolve(self, loss: float, grad_norm: float, timings: StepTimings) -> None:
        self._loss, self._grad_norm = loss, grad_norm
        self._pipeline, self._timeline = timings
        self._trainer = None

    def _read(self) -> None:
        if self._loss is None:
            self._trainer.settle()

    @property
    def loss(self) -> float:
        """The mean loss over the global batch (every rank the same number)."""
        self._read()
        return self._loss

    @property
    def grad_norm(self) -> float:
        self._read()
        return self._grad_norm

    @property
    def pipeline(self) -> dict | None:
        """pp > 1: every stage's busy and idle seconds and the mean bubble."""
        self._read()
        return self._pipeline

    @property
    def pipeline_timeline(self) -> list[dict] | None:
        """Where the step recorded it (`records_timeline`): every action's start and end on every stage."""
        self._read()
        return self._timeline


@dataclass
class TrainerOptions:
    record_samples: bool = False  # keep every sample id this rank's batch leader consumed (tests)
    capture_grads: bool = False  # keep each step's full (unsharded) gradients before clipping, by name (tests)
    grads_at_step: int = 0  # with capture_grads: gather them at this step only (0: every step; a gather each)
    start_time: float = field(default_factory=time.time)  # the run's wall-clock origin for elapsed_s
    # Leave the weights uninitialised until `init_weights()` or a checkpoint load (`fit` resumes first and
    # initialises only when there was nothing to resume); the step methods refuse to run before either.
    defer_init: bool = False
    data_path: str = ""  # the prepared data (the driver's RunFacts.data_path); "" reads the config's data.path


class Trainer:
    def __init__(self, cfg: Config, device: torch.device, layout: Layout | None = None,
                 options: TrainerOptions | None = None):
        """`layout` (from `planner.policy.plan_layout`; planned here when None) says which ranks train in
        which mesh; ranks beyond `layout.world_size` are idle and must not construct a Trainer."""
        keep_large_host_allocations_unpooled()  # gathered shards must not stay resident (see there)
        self.cfg = cfg  # the user's config, never rewritten
        self.layout = layout or plan_layout(cfg, dist.get_world_size())
        self.device = device
        self.options = options or TrainerOptions()
        self.data_path = self.options.data_path or cfg.data.path
        self.world_size = self.layout.world_size  # active ranks
        if cfg.train.deterministic:
            # cuBLAS needs a fixed workspace to be deterministic (torch.use_deterministic_algorithms docs)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        # Groups over the active ranks only (idle workers take part in no collective), both on the host:
        # CPU bookkeeping in the training thread, and the checkpoint writer's thread on a group of its own.
        # Every group, the mesh's included, times out after elastic.collective_timeout_s; the mesh's later where
        # raydist's hang monitor watches and ends a stuck collective itself first (Ray workers on NCCL or under
        # the strict mode: raydist.elastic.hang.trigger.group_timeout_s).
        timeout_s = cfg.elastic.collective_timeout_s
        device_backend = group_backend(DEVICE, device.type)
        set_default_timeout(group_timeout_s(timeout_s, device_backend, cfg.monitor.heartbeat_interval_s))
        active = list(range(self.world_size))
        self.group = new_group(active, HOST, device.type, timeout_s)
        self.checkpoint_group = new_group(active, HOST, device.type, timeout_s)
        self.mesh: Mesh = self.layout.spec.build(device.type)
        self.compute_dtype = compute_dtype_for(cfg, device)
        # Built on the meta device (no storage), parallelized there, then each rank allocates and
        # initialises only what it holds (`materialize`: to_empty, RoPE tables, init keyed by parameter name)
        with torch.device("meta"):
            model = GPT(cfg.model, cfg.data.seq_len)
        check_pipeline_stages(cfg.peft.method, cfg.peft.trainable_last_layers, self.layout)
        apply_peft(model, cfg.peft, cfg.train.seed)  # adapters / frozen weights, before any parallel wrap
        self.param_counts = parameter_counts(model)  # trainable and total, unsharded (summary.json)
        # `auto` on CUDA: rank 0 times the kernels at this run's shapes now, before any weight exists (no timing
        # inside a step), and every rank installs its picks (raydist.kernels.select.shared_choices)
        workload = Workload.of(cfg, self.layout, self.compute_dtype)
        choices = shared_choices(model, cfg.kernels, device, workload, self.group)
        self.kernels = apply_kernels(model, cfg.kernels, device, workload, choices)  # the paths chosen
        self.kernel_choices = [p.record() for p in choices.picks()] if choices else []  # (summary.json)
        self._kernel_calls_at_start = kernel_calls()  # what ran since: kernels_ran()
        # "init" (keyed random init, then model.init_from's pretrained weights), "checkpoint" (loaded), or
        # None (deferred: neither yet)
        self.weights_from: str | None = None
        self._materialized: list[torch.nn.Module] = []

        def materialize_module(module: torch.nn.Module) -> None:
            materialize(module, device, cfg.model, cfg.train.seed, init=False)
            self._materialized.append(module)

        self.pm: ParallelModel = parallelize(model, self.mesh, self.layout, device, self.compute_dtype,
                                             materialize=materialize_module, fused_loss=cfg.kernels.loss != "plain")
        if not self.options.defer_init:
            self.init_weights()
        masked = bool(read_manifest(self.data_path).get("loss_mask"))  # prompt/response: response tokens count
        if masked:
            check_masked_layout(cfg.elastic.live_recovery)
        # what each batch peer uses of its dp rank's rows: middle pipeline stages nothing, cp ranks their tokens
        self.batches = BatchTransfer(self.mesh, self.layout, cfg.data.seq_len, device)
        self.runner = make_runner(self.pm, self.layout, self.mesh, device, self.batches.needs, masked)
        self.optimizer = build_optimizer(self.pm.model, cfg)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        # replicas that meet every elastic.sync_every steps: the outer step (raydist.elastic.diloco)
        self.outer = outer_optimizer(self.pm.model, cfg.elastic)
        self.step = 0  # optimizer steps done
        self.position = 0  # training samples consumed (global sample index of the next one)
        self.sample_log: list[np.ndarray] = []
        self._sample_log_steps: list[int] = []  # the step of each entry (a rewound window drops its own)
        self.notes: dict = {}  # small JSON facts that survive restarts with the checkpoint (first_val_loss)
        self._unsettled: list[StepStats] = []  # steps whose loss is not yet reduced (`settle`)
        # the replica manager (raydist.elastic.live): a live replica's quorum, set before training; else one replica
        self.replicas: Replicas = SingleReplica()
        self.retried_steps = 0  # steps redone because a replica was lost inside them
        self._open_data()

    # ---- data --------------------------------------------------------------------------------------
    def _open_data(self) -> None:
        manifest = read_manifest(self.data_path)
        if manifest["seq_len"] != self.cfg.data.seq_len:
            raise ConfigError(f"data.seq_len={self.cfg.data.seq_len} but {self.data_path} was prepared "
                              f"with seq_len={manifest['seq_len']}; set data.seq_len={manifest['seq_len']}")
        self.manifest = manifest
        self.train_split = Split.open(self.data_path, "train", manifest)
        self.val_split = Split.open(self.data_path, "val", manifest) if self.cfg.train.eval_every else None
        self.train_order = SampleOrder(self.train_split.shard_rows, self.cfg.train.seed,  # block: a row group
                                       block=int(manifest.get("row_group_rows", 1)))  # (older datasets: a row)
        self._stream: SampleStream | None = None
        self._val_batches: dict[int, np.ndarray] = {}

    def _share(self, rows: np.ndarray | None, count: int, whole: bool) -> torch.Tensor | LocalBatch:
        """The leader's rows (count, window) on every batch peer (`whole`), else each peer's LocalBatch."""
        tokens = to_device(torch.from_numpy(rows), self.device) if rows is not None else None  # CUDA: pinned
        if not whole:
            return self.batches.share(tokens, count)
        if tokens is None:
            tokens = torch.empty(count, self.train_split.window, dtype=torch.int64, device=self.device)
        if self.layout.pp * self.layout.cp * self.layout.tp > 1:
            dist.broadcast(tokens, src=self.mesh.batch_leader_rank, group=self.mesh.batch_peers.get_group())
        return tokens

    def next_batch(self, span: tuple[int, int] | None = None, whole: bool = True
                   ) -> tuple[torch.Tensor | LocalBatch, np.ndarray | None]:
        """This dp rank's rows of the next global batch (or positions `span`), sample ids on the leader.
        `whole`: the rows on every batch peer (tests, tools), else each peer's LocalBatch (raydist.data.peers).
        The stream reads this rank's rows only (`RankPlan`); live recovery's spans read whole shards."""
        g, dp_rank, dp = self.layout.global_batch, self.mesh.dp_rank, self.layout.dp
        start, stop = span or rank_slice(self.position, g, dp_rank, dp)
        ids = rows = None
        if self.mesh.is_batch_leader:
            plan = RankPlan.at(self.position, g, dp_rank, dp) if span is None else None
            if self._stream is not None and (start < self._stream.position or self._stream.plan != plan):
                self.close()  # a step redone with another split reads its rows again: reopen there
            if self._stream is None:
                reader = make_reader(self.cfg.data.reader, self.cfg.data.prefetch_shards)
                self._stream = SampleStream(self.train_split, self.train_order, reader, start, plan)
            ids, rows = self._stream.take(start, stop)
        return self._share(rows, stop - start, whole), ids

    def val_batch(self, index: int, whole: bool = True) -> torch.Tensor | LocalBatch:
        """Validation batch `index`: the val split in file order, sliced like training (`whole`: next_batch)."""
        g = self.layout.global_batch
        start, stop = rank_slice(index * g, g, self.mesh.dp_rank, self.layout.dp)
        rows = None
        if self.mesh.is_batch_leader:
            if index not in self._val_batches:
                order = SampleOrder(self.val_split.shard_rows, seed=0, shuffle=False)
                stream = SampleStream(self.val_split, order, make_reader("arrow", 1), start,
                                      RankPlan.at(index * g, g, self.mesh.dp_rank, self.layout.dp))
                try:
                    self._val_batches[index] = stream.take(start, stop)[1]
                finally:
                    stream.close()
            rows = self._val_batches[index]
        return self._share(rows, stop - start, whole)

    # ---- compute -----------------------------------------------------------------------------------
    def _data_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean over the ranks that hold different tokens (dp x cp; each holds the same number), on the
        device: `value` may hold several steps' losses (one collective for all of them)."""
        ranks = self.layout.dp * self.layout.cp
        if ranks > 1:
            value = value.clone()
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.mesh.dp_cp.get_group())
            value /= ranks
        return value

    def moe_metrics(self) -> dict:
        """MoE runs: the mean load-balancing loss of the training micro-batches' blocks since the last call
        (`moe_aux`), the tokens each expert received summed over blocks and data ranks
        (`moe_tokens_per_expert`) and the busiest expert's share over the mean (`moe_load_max`, 1.0
        balanced); under expert parallelism the seconds a rank spent in the experts' all-to-alls, forward and
        backward, averaged over ranks (`moe_all_to_all_s`). A collective over every rank (pipeline stages hold
        different blocks); {} for a dense model."""
        if not self.cfg.model.moe_experts:
            return {}
        from raydist.models.moe import take_all_to_all_seconds, take_stats

        total, count, load = take_stats(self.pm.model)
        experts = self.cfg.model.moe_experts
        figures = torch.zeros(3 + experts, dtype=torch.float64)  # on the host: self.group is a host group
        figures[1] = count
        figures[-1] = take_all_to_all_seconds(self.pm.model)
        if total is not None:
            figures[0] = total.cpu()
        if load is not None:
            figures[2:-1] = load.cpu()
        if self.world_size > 1:
            dist.all_reduce(figures, group=self.group)
        figures[:-1] /= self.layout.tp  # tensor-parallel ranks route the same tokens: count them once
        total, count, load = float(figures[0]), float(figures[1]), figures[2:-1]
        out = {"moe_aux": round(total / max(count, 1), 6),
               "moe_load_max": round(float(load.max() / load.mean().clamp_min(1e-9)), 4),
               "moe_tokens_per_expert": [int(round(v)) for v in load.tolist()]}
        if self.layout.ep > 1:
            out["moe_all_to_all_s"] = round(float(figures[-1]) / self.world_size, 6)
        return out

    def settle(self) -> None:
        """Reads every step not yet read (see `StepStats`): their losses (reduced over dp x cp) and gradient
        norms in one host read, then the pipeline's stage times (`runner.timings`). A collective."""
        pending, self._unsettled = self._unsettled, []
        if not pending:
            return
        local = torch.stack([s._local_loss.detach().float().reshape(()) for s in pending])
        norms = torch.stack([s._grad_norm.detach().float().reshape(()) for s in pending])
        losses, norms = torch.stack([self._data_mean(local), norms]).tolist()  # the host waits here
        timings = self.runner.timings([s._output for s in pending])
        for stats, loss, norm, figures in zip(pending, losses, norms, timings):
            stats._resolve(loss, norm, figures)

    def init_weights(self) -> None:
        """The keyed random init (raydist.models.init) into this rank's shards, the same values in every
        layout, then `model.init_from`'s pretrained weights (read straight into the shards). The Trainer does
        this itself unless `options.defer_init` (a resumed checkpoint then replaces both)."""
        for module in self._materialized:
            init_weights(module, self.cfg.model, self.cfg.train.seed)
        if self.cfg.model.init_from:  # pretrained weights into this rank's shards (adapters keep their init)
            load_into_shards(self.pm.model, hf_dir_of(self.cfg.model.init_from), self.pm.aliases, skip=is_adapter)
        self.weights_from = "init"

    def _weights_loaded(self) -> None:
        self.weights_from = "checkpoint"

    def _require_weights(self) -> None:
        if self.weights_from is None:
            raise RuntimeError("the model's weights are neither initialised nor loaded (TrainerOptions.defer_init):"
                               " call Trainer.init_weights() or load a checkpoint into state_parts() first")

    def loss_on(self, tokens: torch.Tensor | LocalBatch) -> float:
        """Mean loss over the global batch whose local rows (or LocalBatch) are `tokens`, without gradients."""
        self._require_weights()
        return float(self._data_mean(self.runner.evaluate(tokens).detach().float().reshape(())))

    def train_step(self, batch: tuple[torch.Tensor | LocalBatch, np.ndarray | None] | None = None) -> StepStats:
        """One optimizer step, as the replica manager (`self.replicas`) shares it: an ordinary run's single
        replica computes the whole global batch (`batch`, when given, is its rows); a live replica of a quorum
        its share, reduced over the quorum, committed only if the whole quorum finished, else redone with the
        next quorum over the same global batch (raydist.elastic.live). Replicas that synchronise every H steps
        (raydist.elastic.diloco) step alone; a window whose synchronisation failed is rewound to its start
        and its steps are taken again here, to its end."""
        self._require_weights()
        while True:
            stats = self._step(batch)
            reached = self.step
            if self.replicas.end_step(reached, stats.weight):
                return stats
            if self.step < reached:  # rewound: those steps' samples will be trained again
                self.retried_steps += reached - self.step
                kept = sum(1 for s in self._sample_log_steps if s <= self.step)
                del self.sample_log[kept:], self._sample_log_steps[kept:]
            batch = None

    def _step(self, batch: tuple[torch.Tensor | LocalBatch, np.ndarray | None] | None) -> StepStats:
        g, dp = self.layout.global_batch, self.layout.dp
        start = time.perf_counter()
        ACTIONS.step = self.step + 1  # what this rank is doing, for hang diagnosis (raydist.elastic.hang.heartbeat)
        data_wait = 0.0
        while True:
            share = self.replicas.share(self.position, g, self.mesh.dp_rank, dp, self.runner.rows_multiple,
                                        self.layout.micro_batch)  # the quorum: a replacement heals here
            wait_start = time.perf_counter()
            with doing("data: next batch"):
                tokens, ids = (batch if batch is not None and share.span is None
                               else self.next_batch(share.span, whole=False))
            data_wait += time.perf_counter() - wait_start
            with doing("forward/backward"):
                out = self.runner.step(tokens, micro_batch=share.micro_batch,
                                       record_timeline=self.step == TIMELINE_STEP)
            loss = self.replicas.reduce(self.pm.model, out.loss, self._data_mean, share.weight)
            # (before clipping, which would hide a gradient's scale)
            if self.options.capture_grads and self.options.grads_at_step in (0, self.step + 1):
                self.last_grads = full_gradients(self.pm.model, self.pm.aliases)
            with doing("clip: gradient norm"):
                grad_norm = self.runner.clip(self.cfg.train.grad_clip)
            if self.options.capture_grads:  # what clipping left (max_norm 0: measure only)
                self.last_clipped_norm = float(self.runner.clip(0.0))
            if self.replicas.should_commit():
                break
            self.optimizer.zero_grad(set_to_none=True)  # a replica was lost inside the step: redo it
            self.retried_steps += 1
        lr = self.scheduler.get_last_lr()[0]
        with doing("optimizer step"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        self.position += g
        self.last_span, self.last_replica_span, self.last_quorum = share.span, share.replica_span, share.quorum
        if self.options.record_samples and ids is not None:
            self.sample_log.append(ids)
            self._sample_log_steps.append(self.step)
        stats = StepStats(self, loss, grad_norm, lr, time.perf_counter() - start, data_wait, ids, out)
        stats.replicas, stats.weight = share.replicas, share.weight
        if not stats.settled:
            self._unsettled.append(stats)
        return stats

    def evaluate(self) -> float:
        batches = self.cfg.train.eval_batches
        with doing("evaluate"):
            return sum(self.loss_on(self.val_batch(b, whole=False)) for b in range(batches)) / batches

    # ---- checkpoint state ---------------------------------------------------------------------------
    def state_parts(self) -> dict[str, Stateful]:
        """The checkpoint's stateful parts (raydist.checkpoint.state)."""
        return {
            "model_optim": ModelOptimizerState(self.pm.model, self.optimizer, self.pm.aliases,
                                               on_load=self._weights_loaded),
            "schedule": SchedulerState(self.scheduler),
            # the stream restarts at the restored position
            "data": AttributeState(self, "step", "position", fixed={"global_batch": self.layout.global_batch},
                                   on_load=self.close),
            "rng": RNGState(),
            **({"outer": OuterState(self.outer)} if self.outer is not None and self.outer.momentum else {}),
            "run": AttributeState(self, "notes", fixed={"world_size": self.world_size,
                                                         "mesh": self.layout.degrees(),
                                                         "layout": self.layout.to_dict(),
                                                         "compat": compat_record(self.cfg, self.manifest)}),
        }

    def checkpoint_parts(self) -> dict[str, Stateful]:
        """What a durable checkpoint holds: the state parts and the replica manager's own (DiLoCo's replicas'
        inner optimizers)."""
        return {**self.state_parts(), **self.replicas.checkpoint_parts()}

    def kernels_ran(self) -> dict[str, dict[str, int]]:
        """{module type: {kernel path: calls}} this Trainer's steps and evaluations ran (raydist.metrics.kernels):
        what actually executed, fallbacks included, where `self.kernels` is what was selected."""
        return kernels_ran(since=self._kernel_calls_at_start)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """{name: unsharded parameter} on every rank (a collective for sharded parameters), by the unsplit
        model's names."""
        self._require_weights()
        out = {}
        for name, param in self.pm.model.named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            out[self.pm.aliases.get(name, name)] = full.detach().float().cpu().clone()
        return out

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
