"""Live recovery: every replica of the model is one torchft replica group, and a lost replica is replaced
while the others keep stepping.

torchft (Meta, "torchft: fault tolerance for PyTorch", github.com/meta-pytorch/torchft) owns the protocol:
a Lighthouse forms a quorum of the live replica groups at every step, each worker's Manager reconfigures its
cross-replica process group when the quorum changes, and a replica group that is behind (a replacement)
receives the live state from a peer group over that process group (`PGTransport`) before it steps: rank j
of the replacement from rank j of the peer, whose shards are the same ones. Ray Train 2.60 (`TorchftConfig`,
with raydist.elastic.replica_groups for groups of several workers) runs the Lighthouse and replaces only the
failed replica group. A replica is dp_shard x cp x tp x pp workers with its own mesh (FSDP, CP, TP and PP
inside it; one worker when every degree is 1): the replica's own process group is its world, so
everything raydist does inside a replica (its layout, mesh, checkpoint group, bookkeeping) sees that world;
the replicas meet only through the Manager, as in TorchTitan's HSDP with torchft (shard inside a replica
group, replicate across groups through torchft).

One step, on every replica in the quorum (`Trainer.train_step` with `trainer.replicas` set):

    rank, count = replicas.begin_step()             # the quorum; a replacement heals from a live peer here
    [s, e) = live_slice(P, G, rank, count, d u)      # this replica's share of the global batch [P, P + G),
                                                     # u = runner.rows_multiple (pipeline micro-batches)
    dp rank i of its d takes [s + i (e-s)/d, ...)    # equal parts: FSDP averages its ranks' gradients
                                                     # (its tp/cp/pp peers share them, as in any step)
    forward/backward -> the replica's mean loss L_r and gradient shards g_r (reduce-scattered over d)
    all-reduce SUM of (e - s) / G * [g_r, L_r]       -> the mean over the whole global batch, per shard
    optimizer step only if replicas.should_commit(); else the step is redone with the next quorum

The data policy is re-split, not skip: the global batch of a step is always [P, P + G), cut over however
many replicas are in that step's quorum, and a step whose all-reduce failed (a replica died inside it) is
not committed and is redone whole by the survivors. No sample is dropped or repeated, and the loss and
gradient are those of the uninterrupted run (up to summation order): only who computes which rows
changes. Skipping a lost replica's rows would make the trained sample set depend on failure timing.
"""

from __future__ import annotations

import dataclasses
import os
import time
from datetime import timedelta
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from raydist.config import Config
from raydist.data.position import rank_slice
from raydist.schedule.batch import largest_divisor

REPLICA_ID_PREFIX = "raydist_replica_"

# The Lighthouse's timing, with Ray Train's TorchftConfig(lighthouse_kwargs=...). min_replicas 1: the
# survivors step alone. A replica whose heartbeat stops for heartbeat_timeout_ms is out of the next quorum
# (the survivors' pause after a loss); a quorum waits at most join_timeout_ms for a replica that heartbeats
# but has not asked to join yet (a replacement still starting delays no one for longer).
LIGHTHOUSE_KWARGS = {"min_replicas": 1, "join_timeout_ms": 1000, "heartbeat_timeout_ms": 2000}


def live_slice(position: int, global_batch: int, rank: int, count: int, unit: int = 1) -> tuple[int, int]:
    """[start, stop) positions replica `rank` of `count` takes from the global batch at `position`: contiguous
    slices in rank order covering [position, position + global_batch) exactly once, each a whole number of
    `unit` rows (a replica's dp ranks each take an equal part); when count does not divide the batch's
    global_batch / unit units, the first (global_batch / unit) % count replicas take one unit more."""
    if not 0 <= rank < count:
        raise ValueError(f"replica rank {rank} is not in a quorum of {count}")
    if unit < 1 or global_batch % unit:
        raise ValueError(f"a global batch of {global_batch} samples is no whole number of {unit}-row units")
    units = global_batch // unit
    if count > units:
        raise ValueError(f"{count} replicas cannot share a global batch of {global_batch} samples in units of {unit}")
    base, extra = divmod(units, count)
    start = rank * base + min(rank, extra)
    return position + start * unit, position + (start + base + (1 if rank < extra else 0)) * unit


# A replica of several workers learns its place from raydist.elastic.replica_groups's backend, through these
IDENTITY_ENV = {"replica": "RAYDIST_REPLICA", "rank": "RAYDIST_REPLICA_RANK", "replicas": "RAYDIST_REPLICAS",
                "size": "RAYDIST_REPLICA_SIZE", "local_rank": "RAYDIST_REPLICA_LOCAL_RANK"}


@dataclasses.dataclass(frozen=True)
class ReplicaIdentity:
    """This worker's place: replica `replica` of `replicas`, rank `rank` of its `size` workers (its rank in
    the replica's process group), `local_rank` among its group's workers on this node."""

    replica: int
    rank: int
    replicas: int
    size: int
    local_rank: int


def replica_identity(workers_per_replica: int) -> ReplicaIdentity:
    """This Ray Train worker's place. Replicas of one worker are Ray Train's own replica groups
    (`TorchftConfig`): the world rank Ray gives a worker, a replacement's included, is its replica. Replicas of
    several workers were told their place by raydist.elastic.replica_groups's backend before the train
    function started (Ray 2.60 numbers a replacement group's workers as if groups had one worker)."""
    if workers_per_replica == 1:
        import ray.train

        ctx = ray.train.get_context()
        return ReplicaIdentity(ctx.get_world_rank(), 0, ctx.get_world_size(), 1, ctx.get_local_rank())
    missing = [name for name in IDENTITY_ENV.values() if name not in os.environ]
    if missing:
        raise RuntimeError(f"no replica identity ({', '.join(missing)} unset): this worker was not started by "
                           "raydist.elastic.replica_groups.ReplicaGroupsConfig")
    return ReplicaIdentity(**{field: int(os.environ[name]) for field, name in IDENTITY_ENV.items()})


def workers_per_replica(cfg: Config) -> int:
    """The workers of one replica: its own mesh of dp_shard x cp x tp x pp ranks."""
    p = cfg.parallel
    return p.dp_shard * p.cp * p.tp * p.pp


def replica_index(replica_id: str) -> int:
    """`raydist_replica_3:<uuid>` (torchft appends a uuid per Manager) -> 3."""
    return int(replica_id.split(":")[0].rsplit("_", 1)[-1])


def local_tensors(state: Any) -> Any:
    """`state` with every DTensor replaced by its local shard. Rank j of a peer replica holds the same shards
    as rank j here (same layout, same rank in the same mesh), and a plain tensor travels without its
    DeviceMesh, whose process groups exist only in the sender."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: v.to_local() if isinstance(v, DTensor) else v, state)


def shaped_like(received: Any, mine: Any) -> Any:
    """A peer's `local_tensors` state made DTensors again wherever this rank's own state (`mine`, the same
    structure) has one: the received shard on this rank's mesh and placements."""
    if isinstance(mine, DTensor) and isinstance(received, torch.Tensor) and not isinstance(received, DTensor):
        return DTensor.from_local(received.to(mine.device), mine.device_mesh, mine.placements, run_check=False,
                                  shape=mine.shape, stride=mine.stride())
    if isinstance(mine, dict) and isinstance(received, dict):
        return {k: shaped_like(v, mine[k]) if k in mine else v for k, v in received.items()}
    if isinstance(mine, (list, tuple)) and isinstance(received, (list, tuple)) and len(mine) == len(received):
        return type(received)(shaped_like(r, m) for r, m in zip(received, mine))
    return received


@dataclasses.dataclass(frozen=True)
class StepShare:
    """What one step of this worker computes: `span`, the positions of this dp rank's rows (None: the data
    stream's own rows of the whole global batch); `micro_batch` for them (None: the layout's); `weight`, its
    replica's rows / the global batch; `replicas`, the quorum's size (None: no quorum, one replica);
    `replica_span` and `quorum` (rank, size) for the sample records of tests."""

    span: tuple[int, int] | None = None
    micro_batch: int | None = None
    weight: float = 1.0
    replicas: int | None = None
    replica_span: tuple[int, int] | None = None
    quorum: tuple[int, int] | None = None


class Replicas:
    """The replica manager a Trainer steps with (torchft's Manager shape: a quorum at the step's start, a
    commit decision at its end). This base class is a quorum of live replicas that re-split each global batch
    (see the module doc) over `begin_step`, `all_reduce_sum` and `should_commit`: `TorchftReplicas` is the
    real one, tests may script another (tests/unit/test_live_split.py). `SingleReplica` is an ordinary run's.
    """

    def begin_step(self) -> tuple[int, int]:
        """Joins this step's quorum (healing first if behind); returns (this replica's rank, replicas)."""
        raise NotImplementedError

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sums `tensor` over the step's replicas in place (its value is undefined if the step fails)."""
        raise NotImplementedError

    def should_commit(self) -> bool:
        """True when every replica of the step finished its all-reduce: the optimizer may step."""
        raise NotImplementedError

    def share(self, position: int, global_batch: int, dp_rank: int, dp: int, unit: int,
              micro_batch: int) -> StepShare:
        """The step's quorum and this dp rank's part of it: its replica's slice of [position, position +
        global_batch) in whole units of dp x `unit` rows (a pipeline's micro-batches), cut equally over its
        dp ranks, with the largest micro-batch up to the layout's that divides them."""
        rank, count = self.begin_step()
        replica_span = live_slice(position, global_batch, rank, count, unit=dp * unit)
        span = rank_slice(replica_span[0], replica_span[1] - replica_span[0], dp_rank, dp)
        return StepShare(span, largest_divisor(span[1] - span[0], micro_batch),
                         (replica_span[1] - replica_span[0]) / global_batch, count, replica_span, (rank, count))

    def reduce(self, model: torch.nn.Module, local_loss: torch.Tensor,
               data_mean: Callable[[torch.Tensor], torch.Tensor], weight: float) -> torch.Tensor | float:
        """Gradients and loss <- sum over the quorum of weight_r x (replica r's), weight_r = rows_r / G: the
        mean over the global batch when replicas hold unequal shares. One flat all-reduce of this rank's
        gradient shards (FSDP: the local shards of its DTensors; rank j of every replica holds the same ones)
        and its replica's mean loss; returns that loss over the global batch, read."""
        params = [p for p in model.parameters() if p.requires_grad]
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
        replica_loss = data_mean(local_loss.detach().float().reshape(()))
        flat = torch.cat([g.detach().float().reshape(-1) for g in grads] +
                         [replica_loss.detach().float().reshape(1)]) * weight
        self.all_reduce_sum(flat)
        self.sent_bytes += flat.numel() * flat.element_size()
        offset = 0
        for grad in grads:
            n = grad.numel()
            grad.copy_(flat[offset:offset + n].view_as(grad))
            offset += n
        return float(flat[-1])

    def end_step(self, step: int, weight: float) -> bool:
        """After the optimizer step that brought the Trainer to `step` (this replica's rows / the global batch:
        `weight`): whether that step stands. Replicas that meet every step decided it in should_commit;
        raydist.elastic.diloco's synchronise here."""
        return True

    def checkpoint_parts(self) -> dict[str, Any]:
        """Stateful parts a durable checkpoint holds beyond the Trainer's (and a replacement does not need)."""
        return {}

    def is_leader(self) -> bool:
        """This replica writes the run's bookkeeping and durable checkpoints (rank 0 of the latest quorum)."""
        return True

    def join(self) -> bool:
        """The first quorum, before any durable resume: True when a peer's live state was loaded."""
        return False

    def set_step(self, step: int) -> None:
        """After a durable resume at `step`."""

    def nothing_left(self, step: int, steps: int) -> bool:
        """A replacement that resumed at the run's end (the others finished while it started) has nothing to
        do and writes nothing: the leader has written the run's end."""
        return step >= steps

    def add_state(self, name: str, part: Any) -> None:
        """One more stateful part of the live state a replacement receives."""

    def timeout_targets(self) -> list[Any]:
        """What the derived collective timeout applies to beyond the training groups: objects with
        `set_collective_timeout(seconds)` (the all-reduce between replicas)."""
        return []

    on_events: Callable[[list[tuple[str, dict[str, Any]]]], None] = staticmethod(lambda events: None)
    # called with (True, False) as a quorum begins and (False, changed) after it, changed when the quorum's
    # members differ from the last one's or a peer's live state was loaded (raydist.elastic.hang.timeouts)
    on_quorum: Callable[[bool, bool], None] = staticmethod(lambda begins, changed: None)
    sent_bytes = 0  # what this rank has put into all-reduces between replicas (metrics: replica_bytes)
    writes_checkpoints = True  # the run saves durable checkpoints (fit says; replicas may prepare for them)

    def summary(self, retried_steps: int) -> dict[str, Any]:
        return {"replica_steps_retried": retried_steps}

    def shutdown(self) -> None:
        pass


class SingleReplica(Replicas):
    """An ordinary run's replica manager: one replica, no quorum. Its share is the data stream's own rows of
    the whole batch at the layout's micro-batch, its reduction leaves the gradients and this rank's loss as
    they are (read later with the other steps', `Trainer.settle`), and every step commits."""

    def begin_step(self) -> tuple[int, int]:
        return 0, 1

    def share(self, position: int, global_batch: int, dp_rank: int, dp: int, unit: int,
              micro_batch: int) -> StepShare:
        return StepShare()

    def reduce(self, model, local_loss: torch.Tensor, data_mean, weight: float) -> torch.Tensor:
        return local_loss

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        pass

    def should_commit(self) -> bool:
        return True

    def nothing_left(self, step: int, steps: int) -> bool:
        return False

    def summary(self, retried_steps: int) -> dict[str, Any]:
        return {}


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
    """This worker's place in its replica: a torchft Manager with a synchronous quorum (a replacement heals
    before the step's forward, so the step's split already counts it), PGTransport for the live state, gloo
    on CPU and NCCL on GPU for the cross-replica all-reduce. A replica of `workers` workers is one torchft
    replica group: its Managers' `world_size` and `rank` are the replica's process group's, whose TCP store
    (MASTER_ADDR/MASTER_PORT, from Ray Train) is where the group's Managers meet; the quorum, the commit
    decision and healing are per replica group, and rank j's cross-replica group joins the rank-j workers of
    every replica. `parts()` gives the live state as raydist's stateful parts (the checkpoint's
    model/optimizer, schedule, data position, RNG, notes; goodput and membership); the lighthouse address
    comes from Ray Train ($TORCHFT_LIGHTHOUSE)."""

    def __init__(self, replica: int, device: torch.device, timeout_s: float, parts: Callable[[], dict[str, Any]],
                 replicas: int = 1, rank: int = 0, workers: int = 1):
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing.pg_transport import PGTransport

        self.replica, self.parts = replica, parts
        self.replicas, self.start_wait_s = replicas, timeout_s  # see join()
        timeout = timedelta(seconds=timeout_s)
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        transport = PGTransport(pg, timeout=timeout, device=device)
        self.membership = Membership()
        self.extra_parts: dict[str, Any] = {"membership": self.membership}
        self.on_events = lambda events: None  # fit's: goodput and the event log
        self.on_quorum = lambda begins, changed: None  # fit's: the derived timeouts
        self.healed_at: int | None = None  # the step a peer's live state brought this replica to
        self.pg, self._heals, self._quorum_id = pg, 0, None
        self.manager = Manager(pg=pg, load_state_dict=self._load_state, state_dict=self._state,
                               min_replica_size=1, use_async_quorum=False, init_sync=False,
                               timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                               world_size=workers, rank=rank, replica_id=f"{REPLICA_ID_PREFIX}{replica}",
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
        return {name: local_tensors(part.state_dict()) for name, part in self._all_parts().items()}

    def _load_state(self, state: dict[str, Any]) -> None:
        for name, part in self._all_parts().items():
            if name in state:
                part.load_state_dict(shaped_like(state[name], part.state_dict()))
        self.healed_at = int(state["data"]["step"])
        self._heals += 1

    def set_step(self, step: int) -> None:
        """After a durable resume: the Manager counts committed steps from there (its step is the quorum's
        measure of who is behind)."""
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})

    # ---- the step ------------------------------------------------------------------------------------
    def join(self) -> bool:
        """The first quorum, before any durable resume: True when a peer's live state was loaded (a
        replacement joining a running group), False at a start of the whole group.

        At a start of the whole group every replica waits (at most start_wait_s) until all `replicas`
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
            if self.healed_at is not None or count >= self.replicas or time.monotonic() >= deadline:
                return self.healed_at is not None
            self._began = False  # ask the Lighthouse again: the step has not started
            time.sleep(0.1)

    def begin_step(self) -> tuple[int, int]:
        if not self._began:
            heals = self._heals
            self.on_quorum(True, False)
            self.manager.start_quorum()
            self._began = True
            rank = self.manager.participating_rank()
            self._rank = 0 if rank is None else rank
            quorum = self._client.last_quorum
            members = [replica_index(r) for r in quorum.replica_ids] if quorum is not None else [self.replica]
            events = self.membership.update(members, time.time())
            if events:  # after the rank: the leader of this quorum writes them
                self.on_events(events)
            # changed: torchft built a new group (a new quorum id: members came or went, a first-seen or a
            # same-index replacement too, which make no membership event), this replica sent or received the
            # live state
            quorum_id = getattr(quorum, "quorum_id", None)
            changed = (quorum_id != self._quorum_id or bool(getattr(quorum, "recover_dst_replica_ranks", None))
                       or self._heals != heals)
            self._quorum_id = quorum_id
            self.on_quorum(False, changed)
        return self._rank, max(self.manager.num_participants(), 1)

    def timeout_targets(self) -> list[Any]:
        return [self]

    def set_collective_timeout(self, seconds: float) -> None:
        """The all-reduce between replicas times out after `seconds` from now on. torchft's wrapper reads its
        timeout when it creates the inner group (each new quorum) and, for NCCL, around every operation (it
        aborts the communicator at that deadline and reports the error: the step is redone). The live inner
        group of gloo takes it through the backend's `_set_default_timeout`, as torch's `_set_pg_timeout`
        does. NCCL's own backend is left at the timeout torchft gave it: torchft clears each operation's
        timeout so that its abort, not NCCL's watchdog (which ends the process), handles a stuck all-reduce.
        No hang monitor watches this group, so the timeout is the limit itself, not a later backstop."""
        from raydist.elastic.hang.timeouts import set_backend_timeouts

        timeout = timedelta(seconds=seconds)
        self.pg.set_timeout(timeout)
        inner = getattr(self.pg, "_pg", None)
        if inner is not None:
            set_backend_timeouts(inner, timeout, only=("gloo",))

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
