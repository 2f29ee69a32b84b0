"""Live recovery: every worker is one replica of the model in a torchft quorum, and a lost replica is
replaced while the others keep stepping.

torchft (Meta, "torchft: fault tolerance for PyTorch", github.com/meta-pytorch/torchft) owns the protocol:
a Lighthouse forms a quorum of the live replicas at every step, each replica's Manager reconfigures the
cross-replica process group when the quorum changes, and a replica that is behind (a replacement)
receives the live state from a peer over that process group (`PGTransport`) before it steps. Ray Train
2.60 (`TorchftConfig`) runs the Lighthouse and replaces only the failed replica group. Each Ray Train
worker is its own replica group of one worker (Ray 2.60 builds replica groups of size 1), so each
worker's default process group has world size 1 and everything raydist does inside a replica (its
layout, checkpoint group, bookkeeping) sees a world of one; the replicas meet only through the Manager.

One step, on every replica in the quorum (`Trainer.train_step` with `trainer.replicas` set):

    rank, count = replicas.begin_step()      # the quorum; a replacement heals from a live peer here
    [s, e) = live_slice(P, G, rank, count)    # this replica's share of the global batch [P, P + G)
    forward/backward of its e - s rows        # local mean loss L_r and gradient g_r
    all-reduce SUM of (e - s) / G * [g_r, L_r]  -> the mean over the whole global batch on every replica
    optimizer step only if replicas.should_commit(); else the step is redone with the next quorum

The data policy is re-split, not skip: the global batch of a step is always [P, P + G), cut over however
many replicas are in that step's quorum, and a step whose all-reduce failed (a replica died inside it) is
not committed and is redone whole by the survivors. No sample is dropped or repeated, and the loss and
gradient are those of the uninterrupted run (up to summation order): only who computes which rows
changes. Skipping a lost replica's rows would make the trained sample set depend on failure timing.
"""

from __future__ import annotations

import dataclasses
import time
from datetime import timedelta
from typing import Any, Callable

import torch

from raydist.config import Config

REPLICA_ID_PREFIX = "raydist_replica_"

# The Lighthouse's timing, with Ray Train's TorchftConfig(lighthouse_kwargs=...). min_replicas 1: the
# survivors step alone. A replica whose heartbeat stops for heartbeat_timeout_ms is out of the next quorum
# (the survivors' pause after a loss); a quorum waits at most join_timeout_ms for a replica that heartbeats
# but has not asked to join yet (a replacement still starting delays no one for longer).
LIGHTHOUSE_KWARGS = {"min_replicas": 1, "join_timeout_ms": 1000, "heartbeat_timeout_ms": 2000}


def live_slice(position: int, global_batch: int, rank: int, count: int) -> tuple[int, int]:
    """[start, stop) positions replica `rank` of `count` takes from the global batch at `position`: contiguous
    slices in rank order covering [position, position + global_batch) exactly once; when count does not
    divide the batch the first global_batch % count replicas take one row more."""
    if not 0 <= rank < count:
        raise ValueError(f"replica rank {rank} is not in a quorum of {count}")
    if count > global_batch:
        raise ValueError(f"{count} replicas cannot share a global batch of {global_batch} samples")
    base, extra = divmod(global_batch, count)
    start = position + rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def micro_batch_for(rows: int, limit: int) -> int:
    """The largest micro-batch <= limit that divides `rows` (equal micro-batches: their mean loss is the mean
    over the rows)."""
    return max(d for d in range(1, min(rows, max(limit, 1)) + 1) if rows % d == 0)


def replica_config(cfg: Config) -> Config:
    """The config one replica trains with in its own world of one worker: the same run, dp_replicate 1."""
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp_replicate=1))


def replica_index(replica_id: str) -> int:
    """`raydist_replica_3:<uuid>` (torchft appends a uuid per Manager) -> 3."""
    return int(replica_id.split(":")[0].rsplit("_", 1)[-1])


class Replicas:
    """What the Trainer's step asks of the replica quorum. `TorchftReplicas` is the real one; tests may
    script another (tests/unit/test_live_split.py)."""

    def begin_step(self) -> tuple[int, int]:
        """Joins this step's quorum (healing first if behind); returns (this replica's rank, replicas)."""
        raise NotImplementedError

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sums `tensor` over the step's replicas in place (its value is undefined if the step fails)."""
        raise NotImplementedError

    def should_commit(self) -> bool:
        """True when every replica of the step finished its all-reduce: the optimizer may step."""
        raise NotImplementedError

    def is_leader(self) -> bool:
        """This replica writes the run's bookkeeping and durable checkpoints (rank 0 of the latest quorum)."""
        return True

    def join(self) -> bool:
        """The first quorum, before any durable resume: True when a peer's live state was loaded."""
        return False

    def set_step(self, step: int) -> None:
        """After a durable resume at `step`."""

    def add_state(self, name: str, part: Any) -> None:
        """One more stateful part of the live state a replacement receives."""

    on_events: Callable[[list[tuple[str, dict[str, Any]]]], None] = staticmethod(lambda events: None)

    def shutdown(self) -> None:
        pass


class Membership:
    """Which replicas were in the latest quorum, and since when each missing one is out: `replica_lost` and
    `replica_joined` events. Every replica keeps it (only the leader writes the events); it travels with
    the live state, so a replacement knows since when it was out."""

    def __init__(self):
        self.members: list[int] = []
        self.lost_since: dict[str, float] = {}  # replica (as a str: JSON keys) -> wall time it was missed

    def state_dict(self) -> dict[str, Any]:
        return {"members": list(self.members), "lost_since": dict(self.lost_since)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.members = [int(m) for m in state["members"]]
        self.lost_since = {str(k): float(v) for k, v in state["lost_since"].items()}

    def update(self, members: list[int], now: float) -> list[tuple[str, dict[str, Any]]]:
        """The events for a quorum of `members`. A replica seen for the first time (the start) is no event."""
        events: list[tuple[str, dict[str, Any]]] = []
        if self.members:
            for replica in sorted(set(self.members) - set(members)):
                self.lost_since[str(replica)] = now
                events.append(("replica_lost", {"replica": replica, "replicas": len(members)}))
        for replica in sorted(set(members) - set(self.members)):
            since = self.lost_since.pop(str(replica), None)
            if since is not None:
                events.append(("replica_joined", {"replica": replica, "replicas": len(members),
                                                  "time_to_rejoin_s": round(now - since, 3)}))
        self.members = sorted(members)
        return events


class _RecordingClient:
    """torchft's ManagerClient, keeping the last quorum's result (the Manager exposes only its size)."""

    def __init__(self, client):
        self._client = client
        self.last_quorum = None

    def _quorum(self, *args, **kwargs):
        self.last_quorum = self._client._quorum(*args, **kwargs)
        return self.last_quorum

    def __getattr__(self, name: str):
        return getattr(self._client, name)


class TorchftReplicas(Replicas):
    """This worker's replica: a torchft Manager with a synchronous quorum (a replacement heals before the
    step's forward, so the step's split already counts it), PGTransport for the live state, gloo on CPU
    and NCCL on GPU for the cross-replica all-reduce. `parts()` gives the live state as raydist's stateful
    parts (the checkpoint's model/optimizer, schedule, data position, RNG, notes; goodput and membership);
    the lighthouse address comes from Ray Train ($TORCHFT_LIGHTHOUSE)."""

    def __init__(self, replica: int, device: torch.device, timeout_s: float, parts: Callable[[], dict[str, Any]],
                 group_size: int = 1):
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing.pg_transport import PGTransport

        self.replica, self.parts = replica, parts
        self.group_size, self.start_wait_s = group_size, timeout_s  # see join()
        timeout = timedelta(seconds=timeout_s)
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        transport = PGTransport(pg, timeout=timeout, device=device)
        self.membership = Membership()
        self.extra_parts: dict[str, Any] = {"membership": self.membership}
        self.on_events = lambda events: None  # fit's: goodput and the event log
        self.healed_at: int | None = None  # the step a peer's live state brought this replica to
        self.manager = Manager(pg=pg, load_state_dict=self._load_state, state_dict=self._state,
                               min_replica_size=1, use_async_quorum=False, init_sync=False,
                               timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                               world_size=1, rank=0, replica_id=f"{REPLICA_ID_PREFIX}{replica}",
                               checkpoint_transport=transport)
        self._client = _RecordingClient(self.manager._client)
        self.manager._client = self._client
        self._rank: int | None = None
        self._began = False

    # ---- the live state ------------------------------------------------------------------------------
    def add_state(self, name: str, part: Any) -> None:
        self.extra_parts[name] = part

    def _all_parts(self) -> dict[str, Any]:
        return {**self.parts(), **self.extra_parts}

    def _state(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self._all_parts().items()}

    def _load_state(self, state: dict[str, Any]) -> None:
        for name, part in self._all_parts().items():
            if name in state:
                part.load_state_dict(state[name])
        self.healed_at = int(state["data"]["step"])

    def set_step(self, step: int) -> None:
        """After a durable resume: the Manager counts committed steps from there (its step is the quorum's
        measure of who is behind)."""
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})

    # ---- the step ------------------------------------------------------------------------------------
    def join(self) -> bool:
        """The first quorum, before any durable resume: True when a peer's live state was loaded (a
        replacement joining a running group), False at a start of the whole group.

        At a start of the whole group every replica waits (at most start_wait_s) until all `group_size`
        replicas are in the quorum before anyone steps. The Lighthouse forms a quorum of whoever asks
        (min_replicas 1, so that survivors never wait for a replacement), and a replica slower to build
        than its peers (seconds on a loaded machine) would otherwise find them already stepping alone: if
        the one that stepped alone then died, no live replica held the state, and the slow one had to
        resume from storage, a restart with steps redone. Waiting here, before the first step, is free
        for a replacement (a peer ahead of it heals it in its first quorum) and costs a fresh group only
        the skew of its start."""
        deadline = time.monotonic() + self.start_wait_s
        while True:
            _, count = self.begin_step()
            if self.healed_at is not None or count >= self.group_size or time.monotonic() >= deadline:
                return self.healed_at is not None
            self._began = False  # ask the Lighthouse again: the step has not started
            time.sleep(0.1)

    def begin_step(self) -> tuple[int, int]:
        if not self._began:
            self.manager.start_quorum()
            self._began = True
            rank = self.manager.participating_rank()
            self._rank = 0 if rank is None else rank
            quorum = self._client.last_quorum
            members = [replica_index(r) for r in quorum.replica_ids] if quorum is not None else [self.replica]
            events = self.membership.update(members, time.time())
            if events:  # after the rank: the leader of this quorum writes them
                self.on_events(events)
        return self._rank, max(self.manager.num_participants(), 1)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        from torch.distributed import ReduceOp

        self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()

    def should_commit(self) -> bool:
        self._began = False  # the next begin_step starts the next quorum
        return self.manager.should_commit()

    def is_leader(self) -> bool:
        return self._rank == 0

    @property
    def step(self) -> int:
        return self.manager.current_step()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
