"""Run one rank's part of a pipeline schedule: forwards, backwards, and the transfers between them.

One `step()` executes `schedule.actions[pp_rank]` in order, in this process, with no driver involved:

    for each action a_i:
        wait for the tensor a_i receives (posted earlier)       -> idle time
        F: out = chunk(x, positions); last stage: loss_m = loss_fn(out, y_m) / M
        B: the backward of (out, received gradient) -> dL/dx     -> busy time
           (split schedules, zbh1/zbv: dL/dx only, the weight gradient deferred; `split_backward`)
        W: the deferred weight gradient, accumulated into the chunk's parameters
        dist.batch_isend_irecv([send of a_i's output, recv for the next action that needs one])

Sends are waited on only once a later message proves them received (`send_release_points`, which
frees sent tensors within 1F1B's memory bound) or at the step's end, so the only blocking waits are on
receives whose sender is computing: a schedule that `validate()` accepts cannot deadlock here (on gloo,
whose sends progress in the background; NCCL is untested). Receives are posted one receiving action
ahead (overlapping the transfer with this action's compute) into buffers of the known activation shape
(B_micro, T_local, D): T_local is this rank's part of the sequence (T / cp under context parallelism,
a further tp-th under sequence parallelism). Transfers between two stages on one rank (V = 2 under the
ZB-V placement: stages P - 1 and P on rank P - 1) are handed over in memory. Every chunk gets the
positions of its local tokens (RoPE under context parallelism). Gradients accumulate in the chunks'
`.grad` over the M micro-batches; the loss is sum_m loss_m = mean over micro-batches, which equals the
single-process loss of the whole batch when micro-batches have equal token counts. It is summed over
the pipeline group (it is zero off the last stage) so every pipeline rank returns the same value.
`evaluate()` runs the forwards only.

Data-parallel composition (pp is the outer mesh axis, each chunk is wrapped on the dp group): before and
after every action that accumulates weight gradients (B, or W when the backward is split) the executor
calls `before_backward(chunk_index, is_last)` and `after_backward(chunk_index, is_last)`, is_last
marking the chunk's final one of the step (`Schedule.last_weight_gradient`); the data-parallel
strategy's hooks (raydist.parallel.data_parallel) make DDP all-reduce and FSDP reduce-scatter exactly
once per chunk per step, there.

Timings: busy time is the sum of the actions' durations, measured with CUDA events on a GPU (`clock`).
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
from raydist.hang import ACTIONS
from raydist.schedule.actions import BACKWARD, FORWARD, WEIGHT, Action, Schedule, Transfer
from raydist.schedule.clock import ActionClock
from raydist.schedule.split_backward import PendingWeightGradient, backward_input, backward_weight
from raydist.schedule.validate import validate

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits (B, T, V), targets (B, T)) -> scalar
# (chunk index on this rank, whether this is its last weight-gradient action this step) -> None
BackwardHook = Callable[[int, bool], None]
BeforeBackward = BackwardHook


@dataclass
class PipelineStepStats:
    loss: float  # mean loss over the step's micro-batches (same on every pipeline rank)
    busy_s: float  # forward + backward compute on this rank
    idle_s: float  # wall_s - busy_s: waiting for tensors (pipeline fill/drain) and communication
    wall_s: float  # the step: from this rank's start to the pipeline-wide loss reduction at its end

    @property
    def bubble_fraction(self) -> float:
        return self.idle_s / self.wall_s if self.wall_s > 0 else 0.0


class _PostedBatch:
    """The works of one `batch_isend_irecv` call. Backends without coalescing (gloo) return one work per
    op; coalescing ones (NCCL) may return one for the whole batch, which then stands for every op.
    Each work is waited exactly once: a second `wait()` on a gloo receive waits for another message."""

    def __init__(self, ops: list[dist.P2POp], works: list):
        self.per_op = len(works) == len(ops)
        self.ops, self.works = ops, works
        self.pending = set(range(len(works)))

    def _wait(self, indices) -> None:
        for i in sorted(self.pending.intersection(indices)):
            self.works[i].wait()
            self.pending.discard(i)

    def wait_op(self, op: dist.P2POp) -> None:
        self._wait([next(i for i, o in enumerate(self.ops) if o is op)] if self.per_op else range(len(self.works)))

    def wait_all(self) -> None:
        self._wait(range(len(self.works)))


@dataclass
class _Plan:
    """One rank's actions with what the loop precomputes from them."""

    actions: tuple[Action, ...]
    next_receiving: list[int | None]  # [i]: the first action at or after i that receives (post it early)
    release_after: dict[int, list[int]]  # see send_release_points

    @classmethod
    def of(cls, schedule: Schedule, rank: int) -> "_Plan":
        actions = schedule.actions[rank]
        next_receiving: list[int | None] = [None] * (len(actions) + 1)
        for i in range(len(actions) - 1, -1, -1):
            receives = schedule.recv_of(actions[i]) is not None
            next_receiving[i] = i if receives else next_receiving[i + 1]
        return cls(actions, next_receiving, send_release_points(schedule, rank))


class PipelineExecutor:
    """Executes `schedule` for pipeline rank `pp_rank` over `chunks` (this rank's modules by chunk index).

    chunks[c] holds virtual stage `schedule.stages_of(pp_rank)[c]`. The first stage's chunk takes token
    ids (B_micro, T_local); the others take activations of `activation_shape` = (B_micro, T_local, D) in
    `activation_dtype`; the last stage's chunk returns logits for `loss_fn(logits, targets)`. Chunks are
    called `chunk(x)`, or `chunk(x, positions)` when the step is given positions.
    """

    def __init__(self, chunks: Sequence[nn.Module], schedule: Schedule, pp_rank: int,
                 pp_group: dist.ProcessGroup | None, *, activation_shape: tuple[int, ...],
                 loss_fn: LossFn, device: torch.device | str = "cpu",
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
        self.loss_fn = loss_fn
        self.before_backward, self.after_backward = before_backward, after_backward
        self.split = schedule.split_backward
        self.last_weight_gradient = set(schedule.last_weight_gradient(pp_rank).values())
        self.clock = ActionClock(self.device)
        self._train_plan = _Plan.of(schedule, pp_rank)
        # Evaluation runs the schedule's forwards only, in the same order: dropping every B and W from a
        # valid schedule keeps it valid (forwards depend only on forwards).
        forwards = tuple(tuple(a for a in acts if a.kind == FORWARD) for acts in schedule.actions)
        self._eval_plan = _Plan.of(dataclasses.replace(schedule, actions=forwards), pp_rank)
        self._plan = self._train_plan
        self.record_timeline = False  # set by step(record_timeline=True) for that step
        self.timeline: list[dict] = []

    # ---- point-to-point ------------------------------------------------------------------------------
    def _peer(self, rank_in_group: int) -> dict:
        return {"group": self.group, "group_peer": rank_in_group}

    def _post(self, send_index: int | None, tensor: torch.Tensor | None, recv_index: int | None) -> None:
        """One batch: the send produced by action `send_index` and the receive for action `recv_index`
        (unless already posted)."""
        ops, send_op, recv_op = [], None, None
        if send_index is not None:
            transfer = self.schedule.send_of(self._plan.actions[send_index])
            if transfer.local:
                self._mailbox[transfer] = tensor
            else:
                send_op = dist.P2POp(dist.isend, tensor.contiguous(), tag=self.schedule.tag(transfer),
                                     **self._peer(transfer.dst_rank))
                ops.append(send_op)
        if recv_index is not None and recv_index not in self._posted_recv:
            transfer = self.schedule.recv_of(self._plan.actions[recv_index])
            if not transfer.local:
                buffer = torch.empty(self.activation_shape, dtype=self.activation_dtype, device=self.device)
                recv_op = dist.P2POp(dist.irecv, buffer, tag=self.schedule.tag(transfer),
                                     **self._peer(transfer.src_rank))
                ops.append(recv_op)
            self._posted_recv[recv_index] = recv_op
        if not ops:
            return
        batch = _PostedBatch(ops, dist.batch_isend_irecv(ops))
        self._batches.append(batch)
        if send_op is not None:
            self._sent[send_index] = (batch, send_op)
        if recv_op is not None:
            self._recv_batch[recv_index] = batch

    def _receive(self, index: int) -> torch.Tensor:
        transfer = self.schedule.recv_of(self._plan.actions[index])
        if transfer.local:
            return self._mailbox.pop(transfer)
        if index not in self._posted_recv:
            self._post(None, None, index)
        op = self._posted_recv.pop(index)
        self._recv_batch.pop(index).wait_op(op)
        # Sends this message proves complete: free their tensors now rather than at the step's end.
        for send_index in self._plan.release_after.get(index, ()):
            batch, send_op = self._sent.pop(send_index)
            batch.wait_op(send_op)
        self._batches = [b for b in self._batches if b.pending]
        return op.tensor

    # ---- compute -------------------------------------------------------------------------------------
    def _forward(self, action: Action, x: torch.Tensor, targets: Sequence[torch.Tensor] | None,
                 positions: torch.Tensor | None):
        chunk_index = self.schedule.chunk_of(action.stage)
        if x.is_floating_point():
            x = x.detach().requires_grad_(torch.is_grad_enabled())
        chunk = self.chunks[chunk_index]
        out = chunk(x) if positions is None else chunk(x, positions)
        if action.stage == self.schedule.num_stages - 1:
            out = self.loss_fn(out, targets[action.microbatch]) / self.schedule.num_microbatches
            self._loss_sum += out.detach().float()
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
             record_timeline: bool = False, positions: torch.Tensor | None = None) -> PipelineStepStats:
        """Run one schedule: `inputs` (M token tensors (B_micro, T_local)) are needed on the rank holding
        the first stage, `targets` (M tensors (B_micro, T_local)) on the rank holding the last; others may
        pass None. `positions` (T_local,): the local tokens' places in the whole sequence, given to every
        chunk (context parallelism; None: 0..T-1). Gradients are accumulated into the chunks' parameters
        (the caller zeroes them between steps). `record_timeline`: keep every action's start and end in
        `self.timeline` (seconds from the start)."""
        self._check_batches(inputs, targets)
        self.record_timeline = record_timeline
        try:
            return self._execute(self._train_plan, inputs, targets, positions)
        finally:
            self.record_timeline = False

    @torch.no_grad()
    def evaluate(self, inputs: Sequence[torch.Tensor] | None, targets: Sequence[torch.Tensor] | None,
                 positions: torch.Tensor | None = None) -> float:
        """The mean loss over M micro-batches, forwards only (no gradients); same value on every pp rank."""
        self._check_batches(inputs, targets)
        return self._execute(self._eval_plan, inputs, targets, positions).loss

    def _execute(self, plan: _Plan, inputs, targets, positions) -> PipelineStepStats:
        self._plan = plan
        self._mailbox: dict[Transfer, torch.Tensor] = {}
        self._posted_recv: dict[int, dist.P2POp | None] = {}
        self._recv_batch: dict[int, _PostedBatch] = {}
        self._batches: list[_PostedBatch] = []
        self._sent: dict[int, tuple[_PostedBatch, dist.P2POp]] = {}
        self._saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending: dict[tuple[int, int], PendingWeightGradient] = {}  # B done, W not yet
        self._loss_sum = torch.zeros((), device=self.device)
        start = time.perf_counter()
        self.clock.start_step()
        self._post(None, None, plan.next_receiving[0])
        for i, action in enumerate(plan.actions):
            # what this rank is doing, for hang diagnosis (raydist.hang; a tuple, formatted only if published)
            ACTIONS.what, ACTIONS.since = ("pipeline", action.kind, "micro-batch", action.microbatch, "stage",
                                           action.stage, "(receiving its input)"), time.time()
            received = self._receive(i) if self.schedule.recv_of(action) is not None else None
            ACTIONS.what = ("pipeline", action.kind, "micro-batch", action.microbatch, "stage", action.stage)
            began = self.clock.begin()
            produced = None
            if action.kind == FORWARD:
                x = received if received is not None else inputs[action.microbatch]
                produced = self._forward(action, x, targets, positions)
            elif action.kind == BACKWARD:
                produced = self._backward(action, received)
            elif action.kind == WEIGHT:
                self._weight(action)
            self.clock.end(began, {"stage": action.stage, "chunk": self.schedule.chunk_of(action.stage),
                                   "kind": action.kind, "microbatch": action.microbatch})
            sends = self.schedule.send_of(action) is not None
            self._post(i if sends else None, produced, plan.next_receiving[i + 1])
        ACTIONS.what, ACTIONS.since = ("pipeline", "waiting for the step's last sends"), time.time()
        for batch in self._batches:
            batch.wait_all()
        # The loss lives on the last stage (zeros elsewhere); summing it over the pipeline is also the
        # step's end on every rank, so each rank's wall (and idle) counts the whole pipeline's step,
        # including its own tail after its last action: idle / wall then reads the bubble.
        loss = self._loss_sum
        if self.schedule.num_ranks > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self.group)
        loss_value = float(loss)
        busy, rows = self.clock.finish()  # on CUDA: one synchronisation, then the events are read
        wall = time.perf_counter() - start
        self.timeline = rows if self.record_timeline else []
        self._batches, self._saved, self._sent, self._pending = [], {}, {}, {}
        return PipelineStepStats(loss_value, busy, max(wall - busy, 0.0), wall)


def stage_timings(stats: PipelineStepStats, pp_group: dist.ProcessGroup | None,
                  device: torch.device | str = "cpu") -> dict[str, list[float]]:
    """Every pipeline rank's busy and idle seconds of a step, by pp rank (a collective on `pp_group`), for
    metrics.jsonl: `{"pp_busy_s": [...], "pp_idle_s": [...], "pp_bubble": [idle / wall per rank]}`."""
    mine = torch.tensor([stats.busy_s, stats.idle_s, stats.wall_s], dtype=torch.float64, device=device)
    size = dist.get_world_size(pp_group) if dist.is_initialized() else 1
    rows = [mine.clone() for _ in range(size)]
    if size > 1:
        dist.all_gather(rows, mine, group=pp_group)
    rows = [r.cpu() for r in rows]
    return {"pp_busy_s": [round(float(r[0]), 6) for r in rows], "pp_idle_s": [round(float(r[1]), 6) for r in rows],
            "pp_bubble": [round(float(r[1] / r[2]), 4) if r[2] > 0 else 0.0 for r in rows]}


def send_release_points(schedule: Schedule, rank: int) -> dict[int, list[int]]:
    """{receiving action index k: [sending action indices i]}: once rank `rank` has received at its action
    k, the sends of actions i are certainly complete, so their tensors can be freed.

    gloo cannot tell a send's completion without blocking on it, so it is derived from the schedule: a
    send to peer q is consumed by q's action j; a later message from q produced by q's action p > j
    proves q has received it (q runs its actions in order). Sends with no such message (e.g. the last
    gradients of a step) are waited at the step's end. For 1F1B this frees the activation sent for
    micro-batch m when its gradient comes back, so sent tensors obey the same min(P - r, M) bound.
    """
    position = [{a: i for i, a in enumerate(acts)} for acts in schedule.actions]
    mine = schedule.actions[rank]
    release: dict[int, list[int]] = {}
    for i, action in enumerate(mine):
        send = schedule.send_of(action)
        if send is None or send.local:
            continue
        consumed_at = position[send.dst_rank][Action(action.kind, send.dst_stage, send.microbatch)]
        for k in range(i + 1, len(mine)):
            recv = schedule.recv_of(mine[k])
            if recv is None or recv.local or recv.src_rank != send.dst_rank:
                continue
            produced_at = position[recv.src_rank][Action(mine[k].kind, recv.src_stage, recv.microbatch)]
            if produced_at > consumed_at:
                release.setdefault(k, []).append(i)
                break
    return release
