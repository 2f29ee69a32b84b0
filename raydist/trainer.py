"""One rank's training state and step: mesh -> model -> parallelize -> optimizer -> data -> step.

`Trainer` runs under any initialised process group: a Ray Train worker or a `torch.multiprocessing`
test (`raydist.runtime.spawn`). One optimizer step:

    positions [P, P + G) of the sample order  ->  this dp rank's slice (G / dp samples)
    -> micro-batches of train.micro_batch  ->  forward/backward each (gradient sync on the last only)
    -> clip by the global norm  ->  AdamW  ->  LR schedule  ->  P += G

Losses are means over every target token of the global batch, so any layout computes the same number.
The loop around it (logging, evaluation, checkpoints, restarts) is `train_loop.fit`.
"""

from __future__ import annotations

import contextlib
import math
import resource
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from raydist.checkpoint.state import apply_tensor_state, rng_state, set_rng_state, tensor_state
from raydist.config import Config, ConfigError
from raydist.data.position import SampleOrder, rank_slice
from raydist.data.prepare import read_manifest
from raydist.data.stream import SampleStream, Split, make_reader
from raydist.kernels import apply_kernels
from raydist.elastic.policy import LayoutDecision, apply_decision, plan_layout
from raydist.mesh import Mesh
from raydist.models.gpt import build_model
from raydist.parallel import ParallelModel, parallelize
from raydist.parallel.validate import check_layout
from raydist.schedule.runner import PipelineRunner


def compute_dtype_for(cfg: Config, device: torch.device) -> torch.dtype:
    if cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def lr_lambda(cfg: Config) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine decay to min_lr_ratio at the last step."""
    t = cfg.train

    def factor(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        span = max(1, t.steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.train.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2), eps=1e-8,
                             foreach=True)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip by the norm of the whole (unsharded) gradient: sharded DTensor gradients reduce their local
    squares across shards, so every rank gets the same total as one process would."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm


def full_gradients(model: torch.nn.Module, aliases: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """{name: unsharded gradient} on every rank (a collective for sharded parameters); `aliases` renames
    parameters the unsplit model knows by another name (a pipeline's tied output copy)."""
    out = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad
        full = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().float().cpu().clone()
        out[(aliases or {}).get(name, name)] = full
    return out


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


TIMELINE_STEP = 2  # the (0-based) step whose pipeline actions are timed for the report, after warm-up


@dataclass
class MicroBatch:
    inputs: torch.Tensor  # (B, T) token ids (T local under context parallelism)
    targets: torch.Tensor  # (B, T)
    positions: torch.Tensor | None  # (T,) positions in the full sequence, when the sequence is sharded


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    data_wait_s: float
    sample_ids: np.ndarray | None = None
    pipeline: dict | None = None  # per-stage busy/idle seconds and the bubble (pp > 1)
    pipeline_timeline: list[dict] | None = None  # every action's start/end on every stage, one step


@dataclass
class TrainerOptions:
    record_samples: bool = False  # keep every sample id this rank's batch leader consumed (tests)
    capture_grads: bool = False  # keep each step's full (unsharded) gradients by parameter name (tests)
    start_time: float = field(default_factory=time.time)  # the run's wall-clock origin for elapsed_s


class Trainer:
    def __init__(self, cfg: Config, device: torch.device, decision: LayoutDecision | None = None,
                 options: TrainerOptions | None = None):
        """`decision` (from `elastic.policy.plan_layout`) says which ranks train in which mesh; ranks
        beyond `decision.spec.world_size` are idle and must not construct a Trainer."""
        self.decision = decision or plan_layout(cfg, dist.get_world_size())
        self.cfg = cfg = apply_decision(cfg, self.decision)
        self.device = device
        self.options = options or TrainerOptions()
        self.spec = self.decision.spec
        self.world_size = self.spec.world_size  # active ranks
        self.accum_steps = check_layout(cfg, self.spec)
        # Groups over the active ranks only (idle workers take part in no collective).
        active = list(range(self.world_size))
        self.group = dist.new_group(ranks=active, use_local_synchronization=True)
        # Checkpoint writes run in a background thread on a gloo group of their own.
        self.checkpoint_group = dist.new_group(ranks=active, backend="gloo", use_local_synchronization=True)
        self.mesh: Mesh = self.spec.build(device.type)
        self.compute_dtype = compute_dtype_for(cfg, device)
        model = build_model(cfg.model, cfg.data.seq_len, cfg.train.seed)
        self.kernels = apply_kernels(model, cfg.kernels, device)  # which attention / matmul paths run
        self.pm: ParallelModel = parallelize(model, self.mesh, cfg, device, self.compute_dtype)
        self.params = [p for p in self.pm.model.parameters() if p.requires_grad]
        # What the parallel plans set (tensor.py: a vocabulary-parallel loss; context.py: sequence sharding)
        self.loss_fn = self.pm.loss_fn
        self.shard_sequence = self.pm.shard_sequence
        self.pipeline = PipelineRunner(self.pm, self.mesh, cfg, device) if self.pm.chunks else None
        self.optimizer = build_optimizer(self.pm.model, cfg)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.step = 0  # optimizer steps done
        self.position = 0  # training samples consumed (global sample index of the next one)
        self.sample_log: list[np.ndarray] = []
        self.notes: dict = {}  # small JSON facts that survive restarts with the checkpoint (first_val_loss)
        self._open_data()

    # ---- data --------------------------------------------------------------------------------------
    def _open_data(self) -> None:
        manifest = read_manifest(self.cfg.data.path)
        if manifest["seq_len"] != self.cfg.data.seq_len:
            raise ConfigError(f"data.seq_len={self.cfg.data.seq_len} but {self.cfg.data.path} was prepared "
                              f"with seq_len={manifest['seq_len']}; set data.seq_len={manifest['seq_len']}")
        self.train_split = Split.open(self.cfg.data.path, "train", manifest)
        self.val_split = Split.open(self.cfg.data.path, "val", manifest) if self.cfg.train.eval_every else None
        self.train_order = SampleOrder(self.train_split.shard_rows, self.cfg.train.seed)
        self._stream: SampleStream | None = None
        self._val_batches: dict[int, np.ndarray] = {}

    def _reader(self):
        return make_reader(self.cfg.data.reader, self.cfg.data.prefetch_shards)

    def _share(self, rows: np.ndarray | None, count: int) -> torch.Tensor:
        """The batch leader's rows (count, window) on every batch peer, as an int64 tensor."""
        window = self.train_split.window
        if self.mesh.is_batch_leader:
            tokens = torch.from_numpy(rows).to(self.device)
        else:
            tokens = torch.empty(count, window, dtype=torch.int64, device=self.device)
        if self.spec.pp * self.spec.cp * self.spec.tp > 1:
            dist.broadcast(tokens, src=self.mesh.batch_leader_rank, group=self.mesh.batch_peers.get_group())
        return tokens

    def next_batch(self) -> tuple[torch.Tensor, np.ndarray | None]:
        """This dp rank's rows of the next global batch, and (on the batch leader) their sample ids."""
        start, stop = rank_slice(self.position, self.cfg.train.global_batch, self.mesh.dp_rank, self.spec.dp)
        ids = rows = None
        if self.mesh.is_batch_leader:
            if self._stream is None:
                self._stream = SampleStream(self.train_split, self.train_order, self._reader(), start)
            ids, rows = self._stream.take(start, stop)
        return self._share(rows, stop - start), ids

    def val_batch(self, index: int) -> torch.Tensor:
        """Validation batch `index`: the val split in file order, sliced by dp rank like training."""
        g = self.cfg.train.global_batch
        start, stop = rank_slice(index * g, g, self.mesh.dp_rank, self.spec.dp)
        rows = None
        if self.mesh.is_batch_leader:
            if index not in self._val_batches:
                order = SampleOrder(self.val_split.shard_rows, seed=0, shuffle=False)
                stream = SampleStream(self.val_split, order, make_reader("arrow", 1), start)
                try:
                    self._val_batches[index] = stream.take(start, stop)[1]
                finally:
                    stream.close()
            rows = self._val_batches[index]
        return self._share(rows, stop - start)

    # ---- compute -----------------------------------------------------------------------------------
    def _autocast(self):
        if self.pm.autocast_needed:
            return torch.autocast(self.device.type, dtype=self.compute_dtype)
        return contextlib.nullcontext()

    def _data_mean(self, value: torch.Tensor) -> float:
        """Mean over the ranks that hold different tokens (dp x cp; each holds the same number)."""
        ranks = self.spec.dp * self.spec.cp
        if ranks > 1:
            value = value.clone()
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.mesh.dp_cp.get_group())
            value /= ranks
        return float(value)

    def _micro_batches(self, tokens: torch.Tensor) -> list[MicroBatch]:
        """(inputs, targets, positions) per micro-batch of this rank's rows; `positions` is None unless a
        parallel plan shards the sequence (context parallelism: `self.shard_sequence`)."""
        out = []
        for chunk in tokens.split(self.cfg.train.micro_batch):
            inputs, targets, positions = chunk[:, :-1], chunk[:, 1:], None
            if self.shard_sequence is not None:
                inputs, targets, positions = self.shard_sequence(inputs, targets)
            out.append(MicroBatch(inputs, targets, positions))
        return out

    def forward_loss(self, micro: MicroBatch) -> torch.Tensor:
        """The mean loss over this rank's tokens of one micro-batch (the one place a parallel plan may
        change how logits become a loss: `self.loss_fn`, e.g. a vocabulary-parallel cross-entropy)."""
        with self._autocast():
            logits = self.pm.module(micro.inputs, micro.positions)
            return self.loss_fn(logits, micro.targets)

    def loss_on(self, tokens: torch.Tensor) -> float:
        """Mean loss over the global batch whose local rows are `tokens`, without touching gradients."""
        if self.pipeline is not None:
            with self._autocast():
                return self._data_mean(torch.tensor(self.pipeline.evaluate(tokens), device=self.device))
        total = torch.zeros((), device=self.device)
        micro = self._micro_batches(tokens)
        with torch.no_grad():
            for mb in micro:
                total += self.forward_loss(mb).float() / len(micro)
        return self._data_mean(total)

    def train_step(self, batch: tuple[torch.Tensor, np.ndarray | None] | None = None) -> StepStats:
        start = time.perf_counter()
        tokens, ids = batch if batch is not None else self.next_batch()
        data_wait = time.perf_counter() - start
        pipeline_stats = None
        if self.pipeline is not None:
            self.pipeline.executor.record_timeline = self.step == TIMELINE_STEP
            with self._autocast():
                pipeline_stats = self.pipeline.step(tokens)
            total = torch.tensor(pipeline_stats.loss, device=self.device)
            grad_norm = self.pipeline.clip(self.cfg.train.grad_clip)
        else:
            micro = self._micro_batches(tokens)
            total = torch.zeros((), device=self.device)
            for i, mb in enumerate(micro):
                with self.pm.gradient_sync(i == len(micro) - 1):
                    loss = self.forward_loss(mb) / len(micro)
                    loss.backward()
                total += loss.detach().float()
            grad_norm = clip_grad_norm(self.params, self.cfg.train.grad_clip)
        if self.options.capture_grads:
            self.last_grads = full_gradients(self.pm.model, self.pm.aliases)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        self.position += self.cfg.train.global_batch
        if self.options.record_samples and ids is not None:
            self.sample_log.append(ids)
        loss_value = self._data_mean(total)
        stats = StepStats(loss_value, float(grad_norm), lr, time.perf_counter() - start, data_wait, ids)
        if pipeline_stats is not None:
            stats.pipeline = self.pipeline.timings(pipeline_stats)
            if self.pipeline.executor.record_timeline:
                stats.pipeline_timeline = self.pipeline.gather_timeline()
                self.pipeline.executor.record_timeline = False
        return stats

    def evaluate(self) -> float:
        batches = self.cfg.train.eval_batches
        return sum(self.loss_on(self.val_batch(b)) for b in range(batches)) / batches

    # ---- checkpoint state ---------------------------------------------------------------------------
    def checkpoint_state(self) -> tuple[dict, dict]:
        """(DCP tensors keyed by unsharded names, JSON-able extra state)."""
        tensors, hyper = tensor_state(self.pm.model, self.optimizer, self.pm.aliases)
        extra = {
            "step": self.step,
            "position": self.position,
            "global_batch": self.cfg.train.global_batch,
            "scheduler": {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"},
            "optimizer_hyper": hyper,
            "rng": rng_state(),
            "world_size": self.world_size,
            "mesh": self.spec.degrees(),
            "notes": self.notes,
        }
        return tensors, extra

    def load_checkpoint_state(self, tensors: dict, extra: dict) -> None:
        """Applies state loaded into `tensors` (the structure from `checkpoint_state`) and `extra`."""
        apply_tensor_state(self.pm.model, self.optimizer, tensors, extra["optimizer_hyper"], self.pm.aliases)
        scheduler = self.scheduler.state_dict()
        scheduler.update(extra["scheduler"])
        self.scheduler.load_state_dict(scheduler)
        self.step = extra["step"]
        self.position = extra["position"]
        set_rng_state(extra["rng"])
        self.notes = dict(extra.get("notes", {}))
        self.close()  # the stream restarts at the restored position

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
