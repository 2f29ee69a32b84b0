"""Run one rank's part of a pipeline schedule: forwards, backwards, and the transfers between them.

One `step()` executes `schedule.actions[pp_rank]` in order, in this process, with no driver involved:

    for each action a_i:
        wait for the tensor a_i receives (posted earlier)       -> idle time
        F: out = chunk(x, positions); last stage: loss_m = stage_loss(chunk, x, positions, y_m) / M
           (by default loss_fn(chunk(x, positions), y_m); the trainer's asks the head for the fused loss)
        B: the backward of (out, received gradient) -> dL/dx     -> busy time
           (split schedules, zbh1/zbv: dL/dx only, the weight gradient deferred; `split_backward`)
        W: the deferred weight gradient, accumulated into the chunk's parameters
        send a_i's output; post the receives that are now due (the transfer plan)

Point-to-point transfers live in `raydist.schedule.transfers`, posted when `raydist.schedule.transfer_plan`
says: each action's send right after its compute, each receive once the global clock of the schedule's
timeline has passed its producer, so every rank issues its operations in one global order and NCCL's single
stream per communicator cannot deadlock (`validate()` replays the plan under NCCL's rules; the strict mode,
raydist.strict, enforces them at run time on CPU). Sends are waited on only once a later message proves
them received. Activations move in buffers of the known shape (B_micro, T_local, D): T_local is this rank's
part of the sequence (T / cp under context parallelism, a further tp-th under sequence parallelism).
Every chunk gets the positions of its local tokens (RoPE under context parallelism). Gradients
accumulate in the chunks' `.grad` over the M micro-batches; the loss is sum_m loss_m = mean over
micro-batches, which equals the single-process loss of the whole batch when micro-batches have equal
token counts. It lives on the rank holding the last stage, which broadcasts it over the pipeline group
so every pipeline rank returns the same value, as a device tensor: nothing in a step waits for the
device (raydist.training.trainer reads losses at logged steps). `evaluate()` runs the forwards only.

Data-parallel composition (pp is the outer mesh axis, each chunk is wrapped on the dp group): before and
after every action that accumulates weight gradients (B, or W when the backward is split) the executor
calls `before_backward(chunk_index, is_last)` and `after_backward(chunk_index, is_last)`, is_last
marking the chunk's final one of the step (`Schedule.last_weight_gradient`); the data-parallel
strategy's hooks (raydist.parallel.data_parallel) make DDP all-reduce and FSDP reduce-scatter exactly
once per chunk per step, there.

Timings: busy time is the sum of the actions' durations, measured with CUDA events on a GPU (`clock`),
read when asked (`PipelineStepStats.times`), and gathered over the pipeline by `stage_timings` at a
logged step.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from raydist.errors import ConfigError
from raydist.metrics.actions import ACTIONS
from raydist.parallel.runtime import to_device
from raydist.schedule.actions import BACKWARD, FORWARD, WEIGHT, Action, Schedule
from raydist.schedule.clock import ActionClock, StepTimes
from raydist.schedule.split_backward import PendingWeightGradient, backward_input, backward_weight
from raydist.schedule.transfers import StepTransfers, TransferPlan
from raydist.schedule.validate import validate

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits (B, T, V), targets (B, T)) -> scalar
# (the last stage's chunk, its input, positions or None, targets (B, T)) -> the micro-batch's mean loss
StageLoss = Callable[[nn.Module, torch.Tensor, "torch.Tensor | None", torch.Tensor], torch.Tensor]
# (chunk index on this rank, whether this is its last weight-gradient action this step) -> None
BackwardHook = Callable[[int, bool], None]
BeforeBackward = BackwardHook


def _logits_then(loss_fn: LossFn) -> StageLoss:
    """The last stage's loss as `loss_fn` of the chunk's logits."""
    def stage_loss(chunk, x, positions, targets):
        return loss_fn(chunk(x) if positions is None else chunk(x, positions), targets)
    return stage_loss


@dataclass
class PipelineStepStats:
    """One step on this rank; nothing here has made the host wait for the device (read it when needed)."""

    loss: torch.Tensor  # 0-d fp32 on the device: mean loss over the step's micro-batches (same on every pp rank)
    times: StepTimes  # this rank's action times, read on first use (on CUDA: its events)

    @property
    def busy_s(self) -> float:
        """Forward + backward compute on this rank."""
        return self.times.busy_s

    @property
    def wall_s(self) -> float:
        """The step: from this rank's start to the pipeline-wide loss broadcast at its end."""
        return self.times.wall_s

    @property
    def idle_s(self) -> float:
        """wall_s - busy_s: waiting for tensors (pipeline fill/drain) and communication."""
        return max(self.wall_s - self.busy_s, 0.0)

    @property
    def timeline(self) -> list[dict]:
        """Every action's stage, chunk, kind, micro-batch, start_s and end_s (seconds from the step's start)."""
        return self.times.rows

    @property
    def bubble_fraction(self) -> float:
        return self.idle_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class _Plan:
    """One rank's actions with what the loop would otherwise derive from them at every step."""

    actions: tuple[Action, ...]
    transfers: TransferPlan
    chunk: tuple[int, ...]  # [i]: the chunk index action i runs
    doing: tuple[tuple, ...]  # [i]: the hang-diagnosis record while action i computes
    receiving: tuple[tuple, ...]  # [i]: ... while it waits for its input
    info: tuple[dict, ...]  # [i]: its row in the step's timeline

    @classmethod
    def of(cls, schedule: Schedule, rank: int) -> "_Plan":
        actions = schedule.actions[rank]
        doing = tuple(("pipeline", a.kind, "micro-batch", a.microbatch, "stage", a.stage) for a in actions)
        return cls(actions, TransferPlan.of(schedule, rank), tuple(schedule.chunk_of(a.stage) for a in actions),
                   doing, tuple(d + ("(receiving its input)",) for d in doing),
                   tuple({"stage": a.stage, "chunk": schedule.chunk_of(a.stage), "kind": a.kind,
                          "microbatch": a.microbatch} for a in actions))


class PipelineExecutor:
    """Executes `schedule` for pipeline rank `pp_rank` over `chunks` (this rank's modules by chunk index).

    chunks[c] holds virtual stage `schedule.stages_of(pp_rank)[c]`. The first stage's chunk takes token
    ids (B_micro, T_local); the others take activations of `activation_shape` = (B_micro, T_local, D) in
    `activation_dtype`; the last stage's chunk returns logits for `loss_fn(logits, targets)`, or
    `stage_loss(chunk, x, positions, targets)` gives its loss however it likes (one of the two). Chunks are
    called `chunk(x)`, or `chunk(x, positions)` when the step is given positions.
    """

    def __init__(self, chunks: Sequence[nn.Module], schedule: Schedule, pp_rank: int,
                 pp_group: dist.ProcessGroup | None, *, activation_shape: tuple[int, ...],
                 loss_fn: LossFn | None = None, stage_loss: StageLoss | None = None,
                 device: torch.device | str = "cpu",
                 activation_dtype: torch.dtype = torch.float32,
                 before_backward: BackwardHook | None = None, after_backward: BackwardHook | None = None):
        validate(schedule)
        if len(chunks) != schedule.virtual_stages:
            raise ConfigError(f"pipeline rank {pp_rank} got {len(chunks)} chunks for a schedule with "
                              f"virtual_stages={schedule.virtual_stages}; split the model with the same V")
        group_size = dist.get_world_size(pp_group) if dist.is_initialized() else 1
        if group_size != schedule.num_ranks:
            raise ConfigError(f"the pipeline group has {group_size} ranks but the schedule has "
                              f"{schedule.num_ranks} stages; make parallel.pp equal the pp mesh size")
        self.chunks = list(chunks)
        self.schedule = schedule
        self.pp_rank = pp_rank
        self.group = pp_group
        self.activation_shape = tuple(activation_shape)
        self.activation_dtype = activation_dtype
        self.device = torch.device(device)
        if (loss_fn is None) == (stage_loss is None):
            raise ValueError("give the executor one of loss_fn (of the last stage's logits) or stage_loss")
        self.stage_loss = stage_loss or _logits_then(loss_fn)
        self.before_backward, self.after_backward = before_backward, after_backward
        self.split = schedule.split_backward
        self.last_weight_gradient = set(schedule.last_weight_gradient(pp_rank).values())
        self.clock = ActionClock(self.device)
        self._train_plan = _Plan.of(schedule, pp_rank)
        # Evaluation runs the schedule's forwards only, in the same order: dropping every B and W from a
        # valid schedule keeps it valid (forwards depend only on forwards).
        forwards = tuple(tuple(a for a in acts if a.kind == FORWARD) for acts in schedule.actions)
        self._eval_plan = _Plan.of(dataclasses.replace(schedule, actions=forwards), pp_rank)

    # ---- compute -------------------------------------------------------------------------------------
    def _forward(self, action: Action, chunk_index: int, x: torch.Tensor,
                 targets: Sequence[torch.Tensor] | None, positions: torch.Tensor | None):
        if x.is_floating_point():
            x = x.detach().requires_grad_(torch.is_grad_enabled())
        chunk = self.chunks[chunk_index]
        if action.stage == self.schedule.num_stages - 1:
            out = self.stage_loss(chunk, x, positions, targets[action.microbatch]) / self.schedule.num_microbatches
            self._loss_sum += out.detach().float()
        else:
            out = chunk(x) if positions is None else chunk(x, positions)
        if torch.is_grad_enabled():
            self._saved[(action.stage, action.microbatch)] = (x, out)
        return None if action.stage == self.schedule.num_stages - 1 else out.detach()

    def _accumulating(self, action: Action, compute: Callable[[], None]) -> None:
        """Run `compute`, which accumulates weight gradients, between the data-parallel hooks."""
        chunk, is_last = self.schedule.chunk_of(action.stage), action in self.last_weight_gradient
        if self.before_backward is not None:
            self.before_backward(chunk, is_last)
        compute()
        if self.after_backward is not None:
            self.after_backward(chunk, is_last)

    def _backward(self, action: Action, grad: torch.Tensor | None):
        key = (action.stage, action.microbatch)
        x, out = self._saved.pop(key)
        if self.split:  # the input gradient now, the weight gradient at this micro-batch's W
            dx, self._pending[key] = backward_input(out, grad, x)
            return dx
        self._accumulating(action, lambda: torch.autograd.backward(out, grad_tensors=grad))
        return x.grad if x.is_floating_point() else None

    def _weight(self, action: Action) -> None:
        pending = self._pending.pop((action.stage, action.microbatch))
        self._accumulating(action, lambda: backward_weight(pending))

    def _check_batches(self, inputs, targets) -> None:
        m = self.schedule.num_microbatches
        holds = self.schedule.stages_of(self.pp_rank)
        if 0 in holds and (inputs is None or len(inputs) != m):
            raise ConfigError(f"pipeline rank {self.pp_rank} holds the first stage and needs {m} input "
                              f"micro-batches, got {None if inputs is None else len(inputs)}")
        if self.schedule.num_stages - 1 in holds and (targets is None or len(targets) != m):
            raise ConfigError(f"pipeline rank {self.pp_rank} holds the last stage and needs {m} target "
                              f"micro-batches, got {None if targets is None else len(targets)}")

    def step(self, inputs: Sequence[torch.Tensor] | None, targets: Sequence[torch.Tensor] | None,
             positions: torch.Tensor | None = None) -> PipelineStepStats:
        """Run one schedule: `inputs` (M token tensors (B_micro, T_local)) are needed on the rank holding
        the first stage, `targets` (M tensors (B_micro, T_local)) on the rank holding the last; others may
        pass None. `positions` (T_local,): the local tokens' places in the whole sequence, given to every
        chunk (context parallelism; None: 0..T-1). Gradients are accumulated into the chunks' parameters
        (the caller zeroes them between steps). Every action's start and end: `stats.timeline`."""
        self._check_batches(inputs, targets)
        return self._execute(self._train_plan, inputs, targets, positions)

    @torch.no_grad()
    def evaluate(self, inputs: Sequence[torch.Tensor] | None, targets: Sequence[torch.Tensor] | None,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
        """The mean loss over M micro-batches, forwards only (no gradients); same value on every pp rank (a
        0-d device tensor)."""
        self._check_batches(inputs, targets)
        return self._execute(self._eval_plan, inputs, targets, positions).loss

    def _execute(self, plan: _Plan, inputs, targets, positions) -> PipelineStepStats:
        transfers = StepTransfers(plan.transfers, self.group, self.activation_shape, self.activation_dtype,
                                  self.device)
        of_action = plan.transfers.of_action
        self._saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending: dict[tuple[int, int], PendingWeightGradient] = {}  # B done, W not yet
        self._loss_sum = torch.zeros((), device=self.device)
        self.clock.start_step()
        transfers.post(0, None)  # the receives due before any compute
        for i, action in enumerate(plan.actions):
            # what this rank is doing, for hang diagnosis (raydist.elastic.hang.heartbeat; a tuple, formatted only
            # if published)
            ACTIONS.what, ACTIONS.since = plan.receiving[i], time.time()
            received = transfers.receive(i) if of_action[i].recv is not None else None
            ACTIONS.what = plan.doing[i]
            began = self.clock.begin()
            produced = None
            if action.kind == FORWARD:
                x = received if received is not None else inputs[action.microbatch]
                produced = self._forward(action, plan.chunk[i], x, targets, positions)
            elif action.kind == BACKWARD:
                produced = self._backward(action, received)
            elif action.kind == WEIGHT:
                self._weight(action)
            self.clock.end(began, plan.info[i])
            transfers.post(i + 1, produced)  # its output, and the receives now due
        ACTIONS.what, ACTIONS.since = ("pipeline", "waiting for the step's last sends"), time.time()
        transfers.finish()
        # The loss lives on the last stage (zeros elsewhere); handing it to every pipeline rank is also the
        # step's end on every rank, so each rank's wall (and idle) counts the whole pipeline's step,
        # including its own tail after its last action: idle / wall then reads the bubble. A broadcast
        # from the last stage's rank: the value an all-reduce of (loss, 0, ..., 0) gives, in fewer hops.
        loss = self._loss_sum
        if self.schedule.num_ranks > 1:
            dist.broadcast(loss, group=self.group, group_src=self.schedule.rank_of(self.schedule.num_stages - 1))
        times = self.clock.finish()  # the step's end; its times are read when asked (no host sync here)
        self._saved, self._pending = {}, {}
        return PipelineStepStats(loss, times)


def stage_timings(steps: Sequence[PipelineStepStats], pp_group: dist.ProcessGroup | None,
                  device: torch.device | str = "cpu") -> list[dict[str, list[float]]]:
    """Every pipeline rank's busy and idle seconds of each of `steps` (the same steps on every rank), by pp
    rank, for metrics.jsonl: per step `{"pp_busy_s": [...], "pp_idle_s": [...], "pp_bubble": [idle / wall
    per rank]}`. One all-gather on `pp_group` and one host sync for all of them: call it at a logged step."""
    if not steps:
        return []
    mine = torch.tensor([[s.busy_s, s.idle_s, s.wall_s] for s in steps], dtype=torch.float64)  # (S, 3) host
    size = dist.get_world_size(pp_group) if dist.is_initialized() else 1
    if size > 1:
        mine = to_device(mine, torch.device(device))  # the pipeline group may be NCCL: gathered on the device
        rows = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(rows, mine, group=pp_group)
        mine = torch.stack(rows, dim=1)  # (S, P, 3)
    else:
        mine = mine[:, None]
    out = []
    for per_rank in mine.tolist():  # the one host read
        out.append({"pp_busy_s": [round(busy, 6) for busy, _, _ in per_rank],
                    "pp_idle_s": [round(idle, 6) for _, idle, _ in per_rank],
                    "pp_bubble": [round(idle / wall, 4) if wall > 0 else 0.0 for _, idle, wall in per_rank]})
    return out
