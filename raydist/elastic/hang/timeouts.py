"""Timeouts from measurements: how long a collective on the training groups may wait, and how long the step
watchdog lets a step make no progress, derived from how long this attempt's steps take.

A fixed `elastic.collective_timeout_s` must cover the slowest step a run will ever take, so a rank that stops
is found only after minutes, and a slow rank and a dead one look alike until then. Here each rank measures
its steps (from one heartbeat to the next, leaving out the first `elastic.timeout_warmup_steps` of the attempt
and every step with an evaluation or a save in it); at each logged step every rank's longest step since the
last one is gathered (with the straggler percentiles, raydist.metrics.stragglers), so every rank derives the
same limits from the same numbers:

    measured_s   = the longest step of any rank over the last WINDOW_STEPS steps
    collective_s = min(collective_timeout_s, max(timeout_floor_s, timeout_factor x measured_s))
    watchdog_s   = 2 x collective_s   (collective_s where no group enforces it, see below)

This is the shape of TCP's retransmission timer (Jacobson and Karels, "Congestion Avoidance and Control",
SIGCOMM 1988; RFC 6298, Paxson, Allman, Chu and Sargent, 2011): a multiple of what was measured, bounded below
(so that ordinary jitter is not a loss) and above. As in accrual failure detectors (Hayashibara, Défago, Yared
and Katayama, "The phi Accrual Failure Detector", SRDS 2004) suspicion follows the observed distribution of
intervals, not a constant; a high quantile over a window stands in for the mean-plus-deviation estimate
because a step's time is not normal (a logged step, a slow read), and the window's maximum is the safe side.

Why a slow rank is not killed: synchronous training makes every rank's step as long as the slowest one's (the
collectives wait), so a rank that is slow from the start, or slows gradually, is in every rank's measurement
and the limits grow with it; the straggler rule names it. A stopped rank makes no step at all: the others'
collective waits past k times the longest step and fails, the hang diagnosis names it and the run restarts. A
rank that becomes more than k times slower at once, between two logged steps, is taken for a stopped one: k
is that margin. Limits move only when the derived value changes by more than CHANGE, and each move is one
`timeouts` event.

Only the step phase is tightened. Evaluations, saves and reports keep the fixed limits, and so does the
first step after one of them (its first collective may wait for a rank still saving or evaluating); from
the next heartbeat on the derived limits apply again. The checkpoint writer's group keeps its fixed timeout.

Live recovery (raydist.elastic.live): the all-reduce between replicas, on torchft's group, gets `collective_s`
too (`TorchftReplicas.set_collective_timeout`), so a replica stopped mid-step costs the others that limit
before torchft drops it from the next quorum (its heartbeat stops), not the fixed ceiling. Each step begins with
torchft's quorum, which waits for a joining replica and sends or receives the live state as long as torchft's
own timeouts allow: it runs under the fixed limits (`StepTimeouts.quorum`), and so does the rest of a step whose
quorum changed (a new quorum id, or live state sent or received: the first all-reduce of a new quorum may
wait for a replica still loading) or whose quorum took longer than `collective_s` (it waited for a replica
still saving or evaluating, while the step watchdog's clock ran); such a step is not measured. torchft's own
NCCL backend keeps its timeout: torchft aborts a stuck all-reduce itself, before NCCL's watchdog would end the
process. Under DiLoCo (raydist.elastic.diloco) the
all-reduce between replicas comes once a window, up to `sync_every` steps after the quorum that may have
brought a replica still warming up, and the window's inner steps are what gets measured: it keeps the fixed
limit (`WindowedReplicas.timeout_targets` is empty); the training groups are tightened as in every run.

Who enforces `collective_s`, per backend (`set_collective_timeout`):
- gloo: the group itself. torch changes a live group's timeout through the backend's `_set_default_timeout`
  (what `torch.distributed.distributed_c10d._set_pg_timeout` calls; ProcessGroupGloo::setTimeout sets its
  options and every context's timeout), so the waiting collective raises after `collective_s`.
- NCCL: ProcessGroupNCCL::setTimeout sets the options each new work reads its timeout from. Where raydist's
  hang monitor watches the in-flight collectives (Ray workers: raydist.elastic.hang.trigger), the monitor ends
  a collective pending longer than `collective_s` and the group's own timeout becomes the later backstop
  `trigger.group_timeout_s(collective_s)`; without a monitor the group aborts at `collective_s`.
- the strict-collectives mode's groups (raydist.strict, a Python process group that torch cannot change):
  their own `set_timeout`, which their waits read; the monitor watches them as it watches NCCL.
- any other backend: nothing raydist can change, so the step watchdog (which raydist runs) enforces
  `collective_s` itself: `watchdog_s` is then `collective_s`, not twice it.
"""

from __future__ import annotations

import datetime
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from raydist import strict
from raydist.elastic.hang.trigger import group_timeout_s
from raydist.strict.group import StrictProcessGroup

WINDOW_STEPS = 200  # the steps the longest one is taken over (a slowdown is forgotten after this many)
CHANGE = 0.1  # the limits move (and an event says so) when the derived value changes by more than this fraction


def derive_timeout_s(measured_s: Iterable[float], factor: float, floor_s: float, ceiling_s: float) -> float:
    """`factor` times the longest of `measured_s`, at least `floor_s` and at most `ceiling_s` (the ceiling wins
    where the floor is above it); the ceiling itself with no measurement, or with factor 0 (no derivation)."""
    longest = max((m for m in measured_s if m is not None), default=0.0)
    if not factor or longest <= 0:
        return ceiling_s
    return min(ceiling_s, max(floor_s, factor * longest))


@dataclass(frozen=True)
class StepLimits:
    """One derivation: the limits of the step phase and what they came from."""

    collective_s: float  # a collective on a training group waits at most this long
    watchdog_s: float  # a step may make no progress for this long (the step watchdog)
    measured_s: float  # the longest step of any rank in the window
    steps: int  # the measured steps in the window (per rank)
    enforced_by: str  # "groups" (each group's own timeout or the hang monitor) or "watchdog"

    def to_dict(self) -> dict[str, Any]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


def settable(group: Any) -> bool:
    """Whether `set_collective_timeout` can change `group`'s timeout (gloo, NCCL, the strict mode's groups, an
    object with its own `set_collective_timeout`: live recovery's all-reduce between replicas)."""
    if _is_strict(group) or hasattr(group, "set_collective_timeout"):
        return True
    backends = _torch_backends(group)
    return bool(backends) and all(b is not None for _, b in backends)


def set_collective_timeout(group: Any, timeout_s: float, interval_s: float) -> bool:
    """`group` times out collectives issued from now on after `timeout_s`, or after the backstop
    `trigger.group_timeout_s(timeout_s)` on a backend whose stuck collectives raydist's monitor ends (see the
    module doc). Returns False (and changes nothing) where torch offers no way to change it."""
    if _is_strict(group):
        group.set_timeout(_delta(group_timeout_s(timeout_s, strict.BACKEND, interval_s)))
        return True
    if hasattr(group, "set_collective_timeout"):
        group.set_collective_timeout(timeout_s)
        return True
    backends = _torch_backends(group)
    if not backends or any(b is None for _, b in backends):
        return False
    for name, backend in backends:
        backend._set_default_timeout(_delta(group_timeout_s(timeout_s, name, interval_s)))
    return True


def set_backend_timeouts(group: Any, timeout: datetime.timedelta, only: tuple[str, ...] = ("gloo", "nccl")) -> None:
    """Every backend of the torch ProcessGroup `group` named in `only` (gloo, nccl) times out operations issued
    from now on after `timeout` (others are left as they are)."""
    for name, backend in _torch_backends(group):
        if backend is not None and name in only:
            backend._set_default_timeout(timeout)


def training_groups(*leave_out: Any) -> list[Any]:
    """Every process group this process is a member of (torch's registry: the world group, the trainer's, the
    mesh's and its flattenings, the pipeline's), but `leave_out` (the checkpoint writer's)."""
    from torch.distributed import distributed_c10d as c10d

    skip = {id(g) for g in leave_out if g is not None}
    return [g for g in list(c10d._world.pg_map) if id(g) not in skip]


def _is_strict(group: Any) -> bool:
    return isinstance(group, StrictProcessGroup)


def _name(group: Any) -> str:
    try:
        return dist.get_backend(group)
    except Exception:
        return ""


def _torch_backends(group: Any) -> list[tuple[str, Any]]:
    """(backend name, the backend object where its timeout can be changed, else None) per device type of
    `group`, as `_set_pg_timeout` finds them."""
    out = []
    for device in getattr(group, "_device_types", []):
        try:
            backend = group._get_backend(torch.device(device))
        except Exception:
            out.append(("", None))
            continue
        if isinstance(backend, dist.ProcessGroupGloo):
            out.append(("gloo", backend))
        elif dist.is_nccl_available() and isinstance(backend, dist.ProcessGroupNCCL):
            out.append(("nccl", backend))
        else:
            out.append((type(backend).__name__, None))
    return out


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class StepTimeouts:
    """One per worker: measures its steps, derives the limits at each logged step and applies them to the
    process groups and the session (see the module doc).

    session: the elastic session (its `step_limits` sets the step watchdog and the hang monitor's limit).
    groups: returns the groups to apply the collective timeout to (`training_groups`).
    factor, floor_s, ceiling_s, warmup_steps: the `elastic.timeout_*` keys and `elastic.collective_timeout_s`.
    start_step: the step this attempt starts from; interval_s: the hang monitor's heartbeat interval."""

    def __init__(self, session: Any, groups: Callable[[], list[Any]], *, factor: float, floor_s: float,
                 ceiling_s: float, warmup_steps: int, start_step: int, interval_s: float = 2.0,
                 clock: Callable[[], float] = time.perf_counter):
        self.session, self.groups = session, groups
        self.factor, self.floor_s, self.ceiling_s = factor, floor_s, ceiling_s
        self.warmup_steps, self.start_step, self.interval_s = warmup_steps, start_step, interval_s
        self.clock = clock
        self.window: deque[tuple[int, float]] = deque()  # (logged step, longest step of any rank since the last)
        self.derived: StepLimits | None = None  # the last derivation that moved the limits
        self.applied: StepLimits | None = None  # what the groups and the session have now (None: the fixed ones)
        self._longest = 0.0  # this rank's longest measured step since the last logged step
        self._last: float | None = None  # when the last step ended (None: the next one is not measured)
        self._relaxed = False
        self._quorum_began = 0.0  # when the last quorum began (live recovery: `quorum`)

    @property
    def enabled(self) -> bool:
        return bool(self.factor)

    def phase(self, name: str) -> None:
        """The worker enters a phase; any but the step phase runs under the fixed limits, and so does the
        step after it (its first collective may wait for a rank still in that phase)."""
        if name == "step":
            return
        self._last = None
        self._relaxed = True
        self._apply(None)

    def quorum(self, begins: bool, changed: bool = False) -> None:
        """Live recovery's quorum at a step's start (raydist.elastic.live, `Replicas.on_quorum`): it runs under
        the fixed limits (it waits for a joining replica and sends or receives the live state, as long as
        torchft's own timeouts allow); after it the step's derived limits apply again, unless the quorum
        changed (a replica lost or joined, a peer's state loaded): then the rest of that step keeps the fixed
        limits (the first all-reduce of a new quorum may wait for a replica still loading) and is not
        measured."""
        if not self.enabled:
            return
        if begins:
            self._quorum_began = self.clock()
            self._apply(None)
            return
        # A quorum that took longer than the derived limit (it waited for a replica still saving or
        # evaluating) counts as changed: the step watchdog's clock started before it, at the step's heartbeat
        long = self.derived is not None and self.clock() - self._quorum_began > self.derived.collective_s
        if changed or long:
            self._last = None
            self._relaxed = True
        elif not self._relaxed:
            self._apply(self.derived)

    def step_done(self, step: int) -> None:
        """After every step (at the heartbeat): measure it, and tighten the limits again after a relaxed step."""
        now = self.clock()
        if self._last is not None and step > self.start_step + self.warmup_steps:
            self._longest = max(self._longest, now - self._last)
        self._last = now
        if self._relaxed:
            self._relaxed = False
            self._apply(self.derived)

    def take(self) -> float | None:
        """This rank's longest measured step since the last call (None: none measured), for the gather."""
        longest, self._longest = self._longest, 0.0
        return longest or None

    def update(self, step: int, longest_per_rank: list[float | None]) -> StepLimits | None:
        """Every rank's `take()` at logged step `step` (the same list on every rank) -> the new limits when they
        moved (then already applied), else None."""
        if not self.enabled:
            return None
        longest = max((m for m in longest_per_rank if m is not None), default=None)
        if longest is not None:
            self.window.append((step, longest))
        while self.window and self.window[0][0] <= step - WINDOW_STEPS:
            self.window.popleft()
        if not self.window:
            return None
        measured = [m for _, m in self.window]
        collective_s = derive_timeout_s(measured, self.factor, self.floor_s, self.ceiling_s)
        current = self.derived.collective_s if self.derived is not None else None
        if current is not None and abs(collective_s - current) <= CHANGE * current:
            return None
        by_groups = all(settable(g) for g in self.groups())
        steps = min(step - self.start_step - self.warmup_steps, WINDOW_STEPS)
        self.derived = StepLimits(collective_s, 2 * collective_s if by_groups else collective_s, max(measured),
                                  steps, "groups" if by_groups else "watchdog")
        if not self._relaxed:
            self._apply(self.derived)
        return self.derived

    def _apply(self, limits: StepLimits | None) -> None:
        if limits == self.applied:
            return
        timeout_s = limits.collective_s if limits is not None else self.ceiling_s
        for group in self.groups():
            try:
                set_collective_timeout(group, timeout_s, self.interval_s)
            except Exception as exc:  # a group torch refuses: the watchdog still bounds the step
                print(f"warning: rank {dist.get_rank()}: could not set a collective timeout on "
                      f"{_name(group) or type(group).__name__} ({type(exc).__name__}: {exc})", flush=True)
        self.session.step_limits(limits)
        self.applied = limits

    def record(self) -> dict[str, Any] | None:
        """The metrics record's `timeouts` field: the limits in force for the step phase (None before any)."""
        return self.derived.to_dict() if self.derived is not None else None
