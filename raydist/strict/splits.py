"""Groups made from a device-bound default group: by every rank of the world, in the same order.

On CUDA raydist binds the default NCCL group to each rank's GPU (raydist.parallel.runtime.bind_device; spawn's cuda
ranks pass device_id), so torch makes every later NCCL group by ncclCommSplit of the default communicator
(torch/distributed/distributed_c10d.py, `_new_process_group_helper`): a collective over the whole world in
which the ranks outside the new group take part with NCCL_SPLIT_NOCOLOR. A rank that skips a creation (an
idle worker that never builds the mesh, a non-member passing use_local_synchronization=True) leaves every
other rank blocked in the split. torch also makes the non-members of a new *gloo* group call the no-color
split (unless use_local_synchronization lets them skip the call), while its members, which create gloo
directly, do not: the k-th splits of the ranks then no longer pair up.

Under the strict mode every `new_group` is checked as those splits would run: each rank's k-th split
(a member's split of a device group, or a no-color one) is posted in the store and waits until every world
rank has posted its k-th; the member lists must agree. A rank that never arrives (within the group's
timeout, or at once when it is seen blocked in a strict operation instead), or arrives creating another
group, fails the creation with one error naming the ranks and both creations.
"""

from __future__ import annotations

import inspect
import json
import time
import traceback

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from raydist.strict import runtime
from raydist.strict.group import StrictProcessGroup
from raydist.strict.mode import BACKEND, StrictCollectiveError

_ORIGINAL = None
POLL_S = 0.05
POLL_FIRST_S = 0.001  # ranks make a mesh's groups back to back: most arrive within milliseconds


def install() -> None:
    """Check every `new_group` of a strict world (idempotent)."""
    global _ORIGINAL
    if _ORIGINAL is None:
        _ORIGINAL = c10d._new_group_with_tag
        c10d._new_group_with_tag = _new_group_with_tag


def _new_group_with_tag(*args, **kwargs):
    state = runtime.current()
    if (c10d.is_initialized() and isinstance(c10d._get_default_group(), StrictProcessGroup) and state is not None
            and state.bound):
        bound = inspect.signature(_ORIGINAL).bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        take_part(a["ranks"], a["backend"], bool(a.get("use_local_synchronization")), a["timeout"])
    return _ORIGINAL(*args, **kwargs)


def _caller() -> str:
    """The first frame outside torch and this package: where the group was asked for."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        name = frame.filename.replace("\\", "/")
        if "/torch/" not in name and "/raydist/strict/" not in name:
            return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{frame.lineno} ({frame.name})"
    return "?"


def take_part(ranks, backend, local_sync: bool, timeout) -> None:
    """This rank's part in the world's splits for a `new_group(ranks, backend=..., ...)`."""
    world, me = dist.get_world_size(), dist.get_rank()
    members = sorted(ranks) if ranks is not None else list(range(world))
    name = str(backend or c10d._world.pg_map[c10d._get_default_group()][0]).lower()
    member = me in members
    if name == BACKEND:  # a device group: a split of the bound communicator
        if local_sync and not member:
            return  # torch returns before the split: the members wait for this rank
        entry = {"split": members} if member else {"nocolor": f"device group {members}"}
    else:  # gloo: its members create it directly, its non-members split with no color
        if member or local_sync:
            return
        entry = {"nocolor": f"{name} group {members} (a non-member without use_local_synchronization)"}
    entry["where"] = _caller()
    world_timeout = c10d._get_default_group().timeout.total_seconds()
    seconds = min(timeout.total_seconds(), world_timeout) if timeout is not None else world_timeout
    rendezvous(entry, world, me, seconds)


def _describe(rank: int, entry: dict) -> str:
    if "bind" in entry:
        return f"rank {rank} binds the world group to its device"
    if "split" in entry:
        what = f"rank {rank} creates device group {entry['split']}"
    else:
        what = f"rank {rank} takes part as a non-member of {entry['nocolor']}"
    return f"{what} at {entry['where']}"


def bind(state: runtime.StrictRuntime, world: int, timeout_s: float) -> None:
    """The world group bound to the rank's device, as `init_process_group(device_id=...)` or
    raydist.parallel.runtime.bind_device do on CUDA: a collective of the whole world (NCCL's eager
    ncclCommInitRank), after which every new group is a split of it."""
    if not state.bound:
        rendezvous({"bind": True, "where": "bind"}, world, state.rank, timeout_s, kind="bind")
        state.bound = True


def rendezvous(entry: dict, world: int, me: int, timeout_s: float, kind: str = "split") -> None:
    """Post this rank's entry for its next split (or the world's bind) and wait for every world rank's.
    A rank that never joins fails it: at once when it has left the world or when the deadlock finder
    (raydist.strict.runtime) sees it blocked on something that waits for this rank, else at the timeout."""
    state = runtime.current()
    if kind == "split":
        state.splits += 1
    k = state.splits if kind == "split" else 0
    key = f"split/{k}" if kind == "split" else "bind"
    store = state.store
    store.set(f"{key}/{me}", json.dumps(entry))
    keys = {r: f"{key}/{r}" for r in range(world)}
    deadline = time.monotonic() + timeout_s
    rule = ("NCCL creates groups of a device-bound default group by ncclCommSplit, which every world rank "
            "must call, the same groups in the same order")
    state.rendezvous, state.rendezvous_error = (kind, k, world, time.time()), None
    state.changed()
    try:
        pause = POLL_FIRST_S
        while True:
            everyone = store.check(list(keys.values()))  # one round trip while all goes well
            missing = [] if everyone else [r for r in range(world) if not store.check([keys[r]])]
            present = [r for r in range(world) if r not in missing]
            arrived = {r: json.loads(v) for r, v in zip(present, store.multi_get([keys[r] for r in present]))}
            firsts: dict[tuple, int] = {}  # each member list posted, with the first rank that posted it
            for r, e in arrived.items():
                if "split" in e:
                    firsts.setdefault(tuple(e["split"]), r)
            clash = None
            if len(firsts) > 1:
                clash = tuple(firsts.values())[:2]
            elif firsts:
                members, first = next(iter(firsts.items()))
                clash = next(((first, r) for r, e in arrived.items() if "split" not in e and r in members), None)
            if clash is not None:
                a, b = clash
                raise StrictCollectiveError(f"strict collectives: {key} of the world: {_describe(a, arrived[a])} "
                                            f"while {_describe(b, arrived[b])}; {rule}")
            if not missing:
                _leave_together(store, key, world, me, min(timeout_s, 30.0))
                return
            # A rank sets gone/ only after posting: one seen gone whose entry is there now posted after `missing`
            # was read (a loaded machine can pause this rank that long), took part, and may well have left.
            gone = [r for r in missing if store.check([f"gone/{r}"]) and not store.check([keys[r]])]
            if gone or state.rendezvous_error is not None or time.monotonic() > deadline:
                why = ("left the world (destroyed its process group)" if gone else
                       f"did not arrive in {timeout_s:.0f}s" if state.rendezvous_error is None else
                       f"is blocked where it waits for this rank: {state.rendezvous_error}")
                raise StrictCollectiveError(
                    f"strict collectives: {key} of the world: {_describe(me, entry)}, but rank(s) {gone or missing} "
                    f"never took part ({why}); {rule}: make every rank create it (idle workers too), or create a "
                    "group only its members call with use_local_synchronization=True and a gloo (HOST) backend")
            time.sleep(pause)
            pause = min(2 * pause, POLL_S)
    finally:
        state.rendezvous = None
        state.changed()


def _leave_together(store, key: str, world: int, me: int, timeout_s: float) -> None:
    """Every rank says it has read the entries; rank 0, whose process holds the world's store (env:// and
    tcp:// rendezvous serve it from rank 0), goes on only once all have, so a rank that returns right after
    a creation never takes the store away from a peer still reading it."""
    store.set(f"{key}/read/{me}", "1")
    if me != 0:
        return
    deadline, pause, read = time.monotonic() + timeout_s, POLL_FIRST_S, [f"{key}/read/{r}" for r in range(world)]
    while time.monotonic() < deadline:
        if store.check(read):
            return
        time.sleep(pause)
        pause = min(2 * pause, POLL_S)
