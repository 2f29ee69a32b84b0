"""The elastic session: what a training loop asks of whatever runs its workers, in seven calls.

    layout = session.start(cfg)        # a Layout for this worker, or Idle (fits no layout this attempt)
    session.phase(name)                # resume, first_step, step, evaluate, save, report: limits per phase
    session.heartbeat(step)            # after every step: progress is being made (watchdogs, idle peers)
    session.step_limits(limits)        # the step phase's limits derived from measured steps (None: fixed)
    session.commit(step, uri, metrics) # a checkpoint committed: the substrate may record it
    session.fail(error)                # this worker is failing: say so before the substrate restarts it
    session.finish(summary)            # the run completed on this worker

`start` plans the layout on rank 0 and broadcasts it, so every worker of a group runs the same layout even
when planning involves a live measurement (`parallel.auto`). `LocalSession` runs under any initialised
process group (the `torch.multiprocessing` tests); `raydist.training.ray_session.RaySession` is the Ray
Train V2 implementation (reports, idle workers, the step watchdog). `training.loop.fit` sees only this
interface and imports no Ray.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch.distributed as dist

from raydist.config import Config
from raydist.errors import ConfigError
from raydist.parallel.layout import Layout
from raydist.planner.policy import plan_layout


@dataclass(frozen=True)
class Idle:
    """This worker fits no layout of the live world (e.g. the 5th worker when tp = 2)."""

    reason: str


def _planned(cfg: Config, given: dict | None = None) -> dict:
    """This world's layout as data: the driver's (`given`, {"world_size", "layout"}) when the driver planned
    it for this many workers, else planned here (the world changed since, or nothing was given)."""
    if given is not None and given["world_size"] == dist.get_world_size():
        return {"layout": given["layout"]}
    try:
        return {"layout": plan_layout(cfg, dist.get_world_size()).to_dict()}
    except ConfigError as exc:
        return {"error": str(exc)}


def _received(box: dict) -> Layout:
    if "error" in box:
        raise ConfigError(box["error"])
    return Layout.from_dict(box["layout"])


def broadcast_layout(cfg: Config, given: dict | None = None) -> Layout:
    """Rank 0 plans the layout for the whole world (or takes the driver's, `given`) and every rank receives
    it (a collective on the default group). A planning error on rank 0 reaches every rank as the same
    ConfigError."""
    box: list = [_planned(cfg, given) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)  # between this run's own processes, never from storage
    return _received(box[0])


def layout_through_store(cfg: Config, store: dist.Store, key: str = "raydist/layout",
                         given: dict | None = None) -> Layout:
    """`broadcast_layout` through the world's key-value store instead of a collective: no operation on the
    world group before the workers know whether to bind it to their devices (raydist.training.ray_session).
    JSON written by rank 0 of this attempt's own store."""
    if dist.get_rank() == 0:
        store.set(key, json.dumps(_planned(cfg, given)))
    return _received(json.loads(store.get(key)))


def bind_when_all_train(started: "Layout | Idle", device) -> bool:
    """Bind the world group to this rank's device (raydist.parallel.runtime.bind_device: NCCL's eager init, after
    which torch makes every new NCCL group by ncclCommSplit, a collective of the whole world) only when
    every rank trains. Idle workers build no mesh and would leave the active ones blocked in the mesh's
    splits; with idle workers the mesh's groups are created lazily by their members instead. Every rank
    reaches the same answer from the layout it received. Returns whether it bound."""
    from raydist.parallel.runtime import bind_device

    if not isinstance(started, Idle) and started.world_size == dist.get_world_size():
        return bind_device(device)
    return False


class Session:
    """The interface, with no-op defaults."""

    given_layout: dict | None = None  # the driver's layout as data, for the world size it was planned for

    def share_layout(self, cfg: Config) -> Layout:
        """The world's layout, the same on every rank (rank 0 plans it, or takes the driver's)."""
        return broadcast_layout(cfg, self.given_layout)

    def start(self, cfg: Config) -> Layout | Idle:
        layout = self.share_layout(cfg)
        if dist.get_rank() >= layout.world_size:
            return Idle(layout.reason)
        return layout

    def heartbeat(self, step: int) -> None:
        pass

    def phase(self, name: str) -> None:
        """The worker enters a phase of its life (resume, first_step, step, evaluate, save, report), each
        with its own time limit for a watchdog."""

    def step_limits(self, limits) -> None:
        """The step phase's limits derived from measured steps (a raydist.elastic.hang.timeouts.StepLimits:
        the step watchdog's `watchdog_s`, the hang monitor's `collective_s`), or None: the fixed ones again.
        The process groups' own timeouts are set by the caller."""

    def commit(self, step: int, uri: str, metrics: dict) -> None:
        pass

    def fail(self, error: BaseException) -> None:
        pass

    def finish(self, summary: dict) -> None:
        pass


@dataclass
class LocalSession(Session):
    """Plain `torch.distributed` processes: nothing restarts them, so commits are only recorded."""

    commits: list[tuple[int, str]] = field(default_factory=list)

    def commit(self, step: int, uri: str, metrics: dict) -> None:
        self.commits.append((step, uri))
