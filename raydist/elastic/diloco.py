"""Replicas that meet every H steps: DiLoCo and local SGD between live recovery's replica groups.

DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023): each
replica takes H steps alone with its own inner AdamW, on its share of each global batch; then the replicas
average how far they moved from the parameters they started the window from (the outer gradient,
Delta = theta_start - theta_replica, weighted by each replica's rows), and one outer step of Nesterov SGD
moves the shared parameters from theta_start; every replica continues from the result. Local SGD (Stich,
"Local SGD Converges Fast and Communicates Little", 2019) averages the replicas' parameters instead: the same
window with an outer SGD of learning rate 1 and no momentum, theta_start - (theta_start - mean theta_r).
Between synchronisations nothing crosses the replicas, so the bytes between them fall by H against
`elastic.sync = every_step` (each step's gradients); torchft ships both algorithms (`torchft.local_sgd`),
which raydist's loop does not use because its windows must compose with live healing, redone windows and
checkpoints as below.

A window, on every replica of its quorum:

    rank, count = quorum at the window's start       # a replacement heals here: the shared parameters, its
                                                     # peer's AdamW state, the outer momentum, the position
    keep theta_start (the parameters) and a host copy of the state (for a redo)
    H times: the step's [P, P + G) cut over the count replicas (raydist.elastic.live.live_slice), forward,
             backward, clip and AdamW on this replica's rows only
    all-reduce SUM of rows_r / G x (theta_start - theta_r)             <- the only exchange of the window
    committed: theta <- theta_start - outer_lr x Nesterov(Delta)      (momentum in the outer optimizer)
    not committed (a replica died inside the window): the state goes back to the window's start and the
             survivors redo the whole window with the next quorum, so every sample is trained once.

Checkpoints are taken only where the replicas are synchronised (checkpoint.every_steps is a multiple of H;
the run's last step ends a window), so the checkpoint's model is theta_start of the next window. DiLoCo adds
two things to it: the outer momentum (`OuterState`, resharded like the inner optimizer's through torch's
distributed state dict) and every replica's own AdamW state (`ReplicaOptimizers`: the replicas differ only
there; gathered in the same all-reduce as the outer gradient of the window before a save), so a resumed run
continues as the uninterrupted one would. The replica manager's step (torchft's measure of who is behind)
counts windows.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from raydist.checkpoint.state import OPTIONS, RNGState, SchedulerState
from raydist.elastic.live import Replicas
from raydist.parallel.clip import local_shard


def trained_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


class OuterOptimizer:
    """The outer step over the model's trained parameters: Nesterov SGD on the local shards (DiLoCo) or the
    plain average (local SGD: learning rate 1, no momentum). Its momentum lives in a `torch.optim.SGD`'s state
    (one buffer per parameter, laid out like it) so that torch's distributed state dict saves and reshards it
    as it does AdamW's moments; the arithmetic is torch's SGD with nesterov=True and dampening 0:
    buf <- mu buf + Delta, theta <- theta_start - lr (Delta + mu buf), done here on local shards."""

    def __init__(self, model: torch.nn.Module, lr: float, momentum: float):
        self.model, self.lr, self.momentum = model, lr, momentum
        self.params = trained_parameters(model)
        self.optimizer = torch.optim.SGD(self.params, lr=lr, momentum=momentum, nesterov=momentum > 0)

    @torch.no_grad()
    def step(self, starts: list[torch.Tensor], deltas: list[torch.Tensor]) -> None:
        """theta <- the outer step from `starts` (each parameter's local shard at the window's start) along
        `deltas` (the averaged outer gradients, local shards)."""
        for param, start, delta in zip(self.params, starts, deltas):
            if self.momentum:
                state = self.optimizer.state[param]
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(param)
                buf = local_shard(state["momentum_buffer"])
                buf.mul_(self.momentum).add_(delta)
                delta = delta.add(buf, alpha=self.momentum)
            local_shard(param).copy_(start).sub_(delta.to(param.dtype), alpha=self.lr)


def outer_optimizer(model: torch.nn.Module, elastic) -> OuterOptimizer | None:
    """The outer step `elastic` (the config's section) asks for: None when the replicas meet every step."""
    if elastic.sync == "every_step":
        return None
    if elastic.sync == "diloco":
        return OuterOptimizer(model, elastic.outer_lr, elastic.outer_momentum)
    return OuterOptimizer(model, 1.0, 0.0)  # local SGD: theta_start - (theta_start - mean theta_r)


class OuterState:
    """The outer optimizer's momentum as a checkpoint part (raydist.checkpoint.state's Stateful shape): torch's
    optimizer state dict of the model's parameters, by name, sharded and resharded like the inner one."""

    def __init__(self, outer: OuterOptimizer):
        self.outer = outer
        self._absent = False  # loading a checkpoint without it (saved under every-step sync): momentum stays 0

    def before_load(self, saved: dict[str, Any]) -> None:
        self._absent = not saved

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if self._absent:
            return {}
        state = get_optimizer_state_dict(self.outer.model, self.outer.optimizer, options=OPTIONS)
        return {"outer_optim": state}  # (SGD's settings are JSON as they are: no tuples to list)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if self._absent:
            self._absent = False
            return
        set_optimizer_state_dict(self.outer.model, self.outer.optimizer, dict(state["outer_optim"]), options=OPTIONS)


def _host(tensor: torch.Tensor) -> torch.Tensor:
    return local_shard(tensor).detach().to("cpu", copy=True)


class WindowStart:
    """What a rewind restores besides the parameters (the window's starts): on the host, the inner optimizer's
    local shards (no optimizer state before its first step), the LR schedule and the learning rates it set,
    the step, data position and notes, the RNG. Taken by hand, not through the checkpoint's state dict:
    torch's distributed state dict initialises an optimizer that has not stepped (one zero step, which
    counts in AdamW's bias correction). Its cost is a device-to-host copy of AdamW's two moments per window."""

    def __init__(self, trainer):
        self.optim = {id(p): {k: _host(v) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                              for k, v in trainer.optimizer.state[p].items()}
                      for p in trainer.outer.params if p in trainer.optimizer.state}
        self.schedule = copy.deepcopy(SchedulerState(trainer.scheduler).state_dict())
        self.lrs = [group["lr"] for group in trainer.optimizer.param_groups]  # (the schedule's state lacks them)
        self.position = (trainer.step, trainer.position, copy.deepcopy(trainer.notes))
        self.rng = RNGState().state_dict()

    @torch.no_grad()
    def restore(self, trainer, starts: list[torch.Tensor]) -> None:
        for param, start in zip(trainer.outer.params, starts):
            local_shard(param).copy_(start)
        for param in trainer.outer.params:
            saved = self.optim.get(id(param))
            if saved is None:
                trainer.optimizer.state.pop(param, None)
                continue
            state = trainer.optimizer.state[param]
            for key, value in saved.items():
                if isinstance(value, torch.Tensor):
                    local_shard(state[key]).copy_(value)
                else:
                    state[key] = copy.deepcopy(value)
        trainer.optimizer.zero_grad(set_to_none=True)
        SchedulerState(trainer.scheduler).load_state_dict(copy.deepcopy(self.schedule))
        for group, lr in zip(trainer.optimizer.param_groups, self.lrs):
            group["lr"] = lr
        trainer.step, trainer.position, notes = self.position
        trainer.notes = copy.deepcopy(notes)
        RNGState().load_state_dict(self.rng)
        trainer.close()  # the data stream reopens at the window's start


def inner_states(trainer) -> list[tuple[str, str, torch.Tensor]]:
    """(parameter name, AdamW key, its state tensor) of every trained parameter, in one order on every replica."""
    names = {id(p): trainer.pm.aliases.get(n, n) for n, p in trainer.pm.model.named_parameters()}
    return [(names[id(p)], key, value) for p in trainer.outer.params
            for key, value in sorted(trainer.optimizer.state.get(p, {}).items()) if isinstance(value, torch.Tensor)]


class ReplicaOptimizers:
    """Every replica's inner AdamW state, as a checkpoint part the leader saves: replicas differ only there
    after a synchronisation, so a resumed run that gave every replica the leader's moments would not be the
    uninterrupted one. The states are gathered at the synchronisation that precedes a save (`WindowedReplicas`);
    slot k is quorum rank k's, saved as DTensors laid out like the leader's own moments (resharded on load).
    Loading, quorum rank k takes slot k over the leader's moments it loaded with the model (slot 0 is the
    leader's own; a rank beyond the saved count keeps them)."""

    def __init__(self, replicas: "WindowedReplicas"):
        self.replicas = replicas
        self._load_slots = 0  # the saved count, told before a load (CheckpointManager.load's before_load)

    def state_dict(self) -> dict[str, Any]:
        slots = self.replicas.gathered or []
        if self._load_slots:  # a load: the template of this rank's slot
            rank = self.replicas.inner.begin_step()[0]  # (after join: the first quorum's rank)
            if 0 < rank < self._load_slots:
                return {"replica_optims": {f"r{rank}": {f"{name}.{key}": torch.zeros_like(value)
                                                        for name, key, value in inner_states(self.replicas.trainer)}},
                        "slots": self._load_slots}
            return {"slots": self._load_slots}
        out: dict[str, Any] = {}
        for k, flat in enumerate(slots[1:], start=1):
            offset, slot = 0, {}
            for name, key, value in inner_states(self.replicas.trainer):
                local = local_shard(value)
                piece = flat[offset:offset + local.numel()].view_as(local).to(local.dtype)
                offset += local.numel()
                if hasattr(value, "device_mesh"):
                    from torch.distributed.tensor import DTensor

                    piece = DTensor.from_local(piece, value.device_mesh, value.placements, shape=value.shape,
                                               stride=value.stride())
                slot[f"{name}.{key}"] = piece
            out[f"r{k}"] = slot
        return {"replica_optims": out, "slots": len(slots)} if out else {"slots": len(slots)}

    def before_load(self, saved: dict[str, Any]) -> None:
        self._load_slots = int(saved.get("slots", 0))

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_slots = 0
        for slot in state.get("replica_optims", {}).values():
            for name, key, value in inner_states(self.replicas.trainer):
                local_shard(value).copy_(local_shard(slot[f"{name}.{key}"]))


def _inner_attribute(name: str) -> property:
    """An attribute of the wrapper that reads and writes the inner replica manager's."""
    return property(lambda self: getattr(self.inner, name), lambda self, value: setattr(self.inner, name, value))


class WindowedReplicas(Replicas):
    """A replica manager (`inner`, raydist.elastic.live.TorchftReplicas) whose replicas synchronise every
    `elastic.sync_every` steps (module doc). The Trainer steps with it as with any replica manager; its
    `end_step` after each optimizer step synchronises at a window's end and answers whether the Trainer's
    step stands (False: the window failed and was rewound to its start; step again until it ends)."""

    def __init__(self, inner: Replicas, trainer):
        """Windows of `trainer.cfg.elastic.sync_every` steps, and one ending at the run's last step."""
        self.inner, self.trainer, self.outer = inner, trainer, trainer.outer
        self.every, self.last = trainer.cfg.elastic.sync_every, trainer.cfg.train.steps
        self.save_every = trainer.cfg.checkpoint.every_steps
        self.gathered: list[torch.Tensor] | None = None  # every replica's inner state at the last save's sync
        self._quorum: tuple[int, int] | None = None  # (rank, count) of the open window
        self._starts: list[torch.Tensor] = []  # the trained parameters' local shards at the window's start
        self._saved: WindowStart | None = None  # the state at the window's start, on the host
        self._rewound = False  # a failed window is being redone
        self.windows_redone = 0

    # ---- what the Trainer's step asks ----------------------------------------------------------------
    def begin_step(self) -> tuple[int, int]:
        if self._quorum is None:  # a window opens: its quorum (a replacement heals in it), then its start
            self._quorum = self.inner.begin_step()
            self._saved = WindowStart(self.trainer)
            self._starts = [local_shard(p).detach().clone() for p in self.outer.params]
        return self._quorum

    def reduce(self, model, local_loss: torch.Tensor, data_mean, weight: float) -> torch.Tensor:
        return local_loss  # this replica's own step: its mean loss, read later with the other steps'

    def should_commit(self) -> bool:
        return True  # an inner step stands unless its window fails (end_step)

    def end_step(self, step: int, weight: float) -> bool:
        """After the optimizer step that brought the Trainer to `step`, with this replica's `weight` (its rows
        / the global batch): the synchronisation when `step` ends a window."""
        if step % self.every and step != self.last:
            return not self._rewound
        params = self.outer.params
        flat = torch.cat([(start - local_shard(p).detach()).float().reshape(-1)
                          for p, start in zip(params, self._starts)]) * weight
        saves = self.writes_checkpoints and (step == self.last or (self.save_every and step % self.save_every == 0))
        if saves:  # a checkpoint follows: every replica's inner state rides on the same all-reduce, in its slot
            mine = torch.cat([local_shard(v).detach().float().reshape(-1)
                              for *_, v in inner_states(self.trainer)])
            rank, count = self._quorum
            slots = torch.zeros(count, mine.numel(), device=mine.device)
            slots[rank] = mine
            flat = torch.cat([flat, slots.reshape(-1)])
        self.all_reduce_sum(flat)
        if saves:
            n = sum(start.numel() for start in self._starts)
            self.gathered = list(flat[n:].view(count, -1))
            flat = flat[:n]
        committed = self.inner.should_commit()  # (the next window's begin_step asks for a new quorum)
        self._quorum = None
        if not committed:  # a replica was lost inside the window: every replica rewinds to its start
            self._saved.restore(self.trainer, self._starts)
            self._rewound = True
            self.windows_redone += 1
            return False
        deltas, offset = [], 0
        for start in self._starts:
            deltas.append(flat[offset:offset + start.numel()].view_as(start))
            offset += start.numel()
        self.outer.step(self._starts, deltas)
        self._rewound = False
        return True

    def checkpoint_parts(self) -> dict[str, Any]:
        return {"replica_optims": ReplicaOptimizers(self)}

    # ---- the rest is the inner manager's -------------------------------------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self.inner.all_reduce_sum(tensor)
        self.sent_bytes += tensor.numel() * tensor.element_size()

    def is_leader(self) -> bool:
        return self.inner.is_leader()

    def join(self) -> bool:
        return self.inner.join()

    def set_step(self, step: int) -> None:
        self.inner.set_step(step // self.every)  # the manager counts windows

    def nothing_left(self, step: int, steps: int) -> bool:
        return self.inner.nothing_left(step, steps)

    def add_state(self, name: str, part: Any) -> None:
        self.inner.add_state(name, part)

    on_events = _inner_attribute("on_events")  # (fit sets these callbacks on the manager that calls them)
    on_quorum = _inner_attribute("on_quorum")

    @property
    def healed_at(self) -> int | None:
        return getattr(self.inner, "healed_at", None)

    def timeout_targets(self) -> list[Any]:
        """None: the all-reduce between replicas comes once a window, after up to `every` inner steps of a
        replica that may have just joined (its warm-up), and the derived limits come from inner steps; it
        keeps the fixed collective_timeout_s (raydist.elastic.hang.timeouts)."""
        return []

    def summary(self, retried_steps: int) -> dict[str, Any]:
        return {**self.inner.summary(retried_steps), "sync_windows_redone": self.windows_redone}

    def shutdown(self) -> None:
        self.inner.shutdown()


def replica_manager(inner: Replicas, trainer) -> Replicas:
    """The replica manager a Trainer (raydist.training.trainer) steps with, from its live replica's `inner`:
    `inner` itself when the replicas meet every step, else windows of elastic.sync_every steps."""
    if trainer.outer is None:
        return inner
    return WindowedReplicas(inner, trainer)
