"""Simulate a schedule in time, compare its bubble with the theory, draw it.

Cost model (exact: times are Fractions). A rank's whole share of the layers costs tf forward and tb
backward per micro-batch (default tf = 1, tb = 2: a backward computes input and weight gradients, about
twice a forward's FLOPs); tw of the backward is the weight gradient (default tb / 2, the paper's
T_B + T_W = 2 T_F with T_B = T_W). Schedules that do not split the backward run B at tb; split ones run B
(input gradient) at tb - tw and W at tw, so the same (tf, tb) compares both fairly (defaults: F = B = W
= 1). A chunk of a rank with V chunks holds 1/V of its layers, so its actions cost 1/V of these.
Transfers take no time. Each rank runs its actions in order; an action starts when the rank is free and
the tensor it receives has been produced:

    start(a) = max(finish(previous action on the rank), finish(action a receives from))

The step time T is the last finish over all ranks; every rank is busy M (tf + tb), so its bubble is
1 - M (tf + tb) / T. The theory (Huang et al., "GPipe" 2019, Narayanan et al. 2021 for interleaving,
Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism" 2024 for zbh1/zbv with F = tf, B = tb - tw, W = tw):

    gpipe, 1f1b:   T = (M + P - 1) (tf + tb)                   bubble = (P - 1) / (M + P - 1)
    interleaved:   T = (M + (P - 1)/V) (tf + tb)               bubble = (P - 1) / (V M + P - 1)
    zbh1:          T = M (F + B + W) + (P - 1)(F + B - W)      F = B = W: bubble = (P - 1) / (3 M + P - 1)
    zbv:           T = M (F + B + W) + (P - 1) F / 2           F = B = W: bubble = (P - 1) / (6 M + P - 1)

zbh1's T is the paper's Table 2 (exact here when W <= F and W <= B); zbv's is the least any V placement
allows (the last rank waits (P - 1) F / 2 for its first input), attained at F = B = W (zbv's greedy order
is built for the costs given to `make_schedule`, default F = B = W; see `zero_bubble.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from raydist.schedule.actions import BACKWARD, FORWARD, WEIGHT, Action, Schedule, dependency_key
from raydist.schedule.progress import execution_order
from raydist.schedule.registry import schedule_kind


@dataclass(frozen=True)
class Interval:
    rank: int
    action: Action
    start: Fraction
    finish: Fraction


@dataclass(frozen=True)
class Timeline:
    schedule: Schedule
    intervals: tuple[Interval, ...]
    step_time: Fraction  # T
    busy_per_rank: tuple[Fraction, ...]
    tf: Fraction  # forward cost of a rank's layers per micro-batch
    tb: Fraction  # backward cost (input + weight gradients)
    tw: Fraction = Fraction(0)  # the weight-gradient part of tb: W's cost when the backward is split

    @property
    def bubble_per_rank(self) -> tuple[Fraction, ...]:
        return tuple(1 - busy / self.step_time for busy in self.busy_per_rank)

    @property
    def bubble_fraction(self) -> Fraction:
        """Idle share of all ranks' time in the step: 1 - sum(busy) / (P T)."""
        return 1 - sum(self.busy_per_rank) / (self.schedule.num_ranks * self.step_time)


def simulate(schedule: Schedule, tf: Fraction | int = 1, tb: Fraction | int = 2,
             tw: Fraction | int | None = None) -> Timeline:
    """The schedule's timeline under the cost model above (validates the dependencies on the way).
    tw (default tb / 2) only matters when the schedule splits the backward."""
    tf, tb = Fraction(tf), Fraction(tb)
    tw = tb / 2 if tw is None else Fraction(tw)
    if not 0 <= tw <= tb:
        from raydist.errors import ConfigError

        raise ConfigError(f"tw={tw} must be between 0 and tb={tb}: it is the weight-gradient part of the backward")
    v = schedule.virtual_stages
    split = schedule.split_backward
    cost = {FORWARD: tf / v, BACKWARD: (tb - tw if split else tb) / v, WEIGHT: tw / v}
    # In integer ticks of 1/unit, the costs' common denominator: the same exact times as Fraction arithmetic,
    # at a fraction of its cost (validate and the transfer plans simulate every schedule they check).
    unit = math.lcm(*(c.denominator for c in cost.values()))
    ticks = {kind: int(c * unit) for kind, c in cost.items()}
    last = schedule.num_stages - 1
    finish: dict[tuple[str, int, int], int] = {}  # (kind, stage, micro-batch) -> its finish
    rank_free = [0] * schedule.num_ranks
    busy = [0] * schedule.num_ranks
    spans = []
    for rank, action in execution_order(schedule):
        kind = action.kind
        dep = dependency_key(kind, action.stage, action.microbatch, last)  # what it receives
        start = max(rank_free[rank], 0 if dep is None else finish[dep])
        finish[(kind, action.stage, action.microbatch)] = rank_free[rank] = start + ticks[kind]
        busy[rank] += ticks[kind]
        spans.append((rank, action, start, start + ticks[kind]))
    times: dict[int, Fraction] = {}

    def exact(t: int) -> Fraction:
        if t not in times:
            times[t] = Fraction(t, unit)
        return times[t]

    intervals = tuple(Interval(rank, action, exact(start), exact(end)) for rank, action, start, end in spans)
    return Timeline(schedule, intervals, exact(max(rank_free)), tuple(map(exact, busy)), tf, tb,
                    tw if split else Fraction(0))


def theoretical_bubble(kind: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> Fraction:
    """(P - 1) / (M + P - 1) for gpipe and 1f1b; (P - 1) / (V M + P - 1) for interleaved; at unit costs
    F = B = W (tf = 1, tb = 2, tw = 1): (P - 1) / (3 M + P - 1) for zbh1, (P - 1) / (6 M + P - 1) for zbv
    (each kind's `bubble` in `registry`)."""
    entry = schedule_kind(kind)
    return entry.bubble(num_ranks, num_microbatches, entry.chunks_per_rank(virtual_stages))


def ideal_step_time(kind: str, num_ranks: int, num_microbatches: int, virtual_stages: int,
                    tf: float, tb: float, tw: float | None = None) -> float:
    """The step time without overheads: (M + P - 1)(tf + tb), or (M + (P - 1)/V)(tf + tb) interleaved;
    M (tf + tb) + (P - 1)(tf + tb - 2 tw) for zbh1, M (tf + tb) + (P - 1) tf / 2 for zbv (tw default tb / 2;
    each kind's `step_time` in `registry`)."""
    entry = schedule_kind(kind)
    tw = tb / 2 if tw is None else tw
    return entry.step_time(num_ranks, num_microbatches, entry.chunks_per_rank(virtual_stages), tf, tb, tw)


def render_text(timeline: Timeline, width_per_unit: int = 2) -> str:
    """An ASCII Gantt chart: one row per rank, `F`/`B`/`W` cells labelled by micro-batch, `.` idle."""
    schedule = timeline.schedule
    unit = Fraction(1, schedule.virtual_stages)  # the smallest cost quantum with tf, tb integers ...
    for iv in timeline.intervals:  # ... refined when a cost is finer (e.g. tw = tb / 2 with tb odd)
        unit = _gcd(unit, iv.finish - iv.start)
    cells = int(timeline.step_time / unit)
    rows = [["." * width_per_unit] * cells for _ in range(schedule.num_ranks)]
    for iv in timeline.intervals:
        first, last = int(iv.start / unit), int(iv.finish / unit)
        text = f"{iv.action.kind}{iv.action.microbatch}"
        for cell in range(first, last):
            rows[iv.rank][cell] = (text if cell == first else "-" * len(text)).ljust(width_per_unit)[:width_per_unit]
    return "\n".join(f"rank {r}: " + "".join(row) for r, row in enumerate(rows))


def render_png(timeline: Timeline, path: str, title: str | None = None) -> None:
    """Draw the timeline as a Gantt chart (matplotlib, optional dependency `raydist[plot]`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        from raydist.errors import ConfigError

        raise ConfigError(f"--png needs matplotlib ({exc}); pip install 'raydist[plot]'") from None
    schedule = timeline.schedule
    p, v = schedule.num_ranks, schedule.virtual_stages
    step = float(timeline.step_time)
    fig, ax = plt.subplots(figsize=(min(24, max(8, step * 0.45)), 0.7 * p + 1.6))
    forward_colors = ["#4C72B0", "#64B5CD", "#8172B2", "#55A868"]
    backward_colors = ["#DD8452", "#C44E52", "#CCB974", "#937860"]
    weight_colors = ["#8C8C8C", "#B07AA1", "#6B6B6B", "#9C755F"]
    palettes = {FORWARD: forward_colors, BACKWARD: backward_colors, WEIGHT: weight_colors}
    for iv in timeline.intervals:
        chunk = schedule.chunk_of(iv.action.stage)
        palette = palettes[iv.action.kind]
        start, width = float(iv.start), float(iv.finish - iv.start)
        ax.barh(iv.rank, width, left=start, height=0.8, color=palette[chunk % len(palette)],
                edgecolor="black", linewidth=0.5)
        ax.text(start + width / 2, iv.rank, str(iv.action.microbatch), ha="center", va="center",
                fontsize=7 if v == 1 else 6, color="white")
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlim(0, step)
    split = schedule.split_backward
    costs = (f"B (input grad) = {_fmt(timeline.tb - timeline.tw)}, W (weight grad) = {_fmt(timeline.tw)}" if split
             else f"backward = {_fmt(timeline.tb)}")
    ax.set_xlabel(f"time (a rank's forward of one micro-batch = {_fmt(timeline.tf)}, {costs})")
    handles = []
    for c in range(v):
        suffix = f" chunk {c}" if v > 1 else ""
        handles += [Patch(color=forward_colors[c % 4], label=f"forward{suffix}"),
                    Patch(color=backward_colors[c % 4], label=f"{'input grad' if split else 'backward'}{suffix}")]
        if split:
            handles.append(Patch(color=weight_colors[c % 4], label=f"weight grad{suffix}"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35 if p < 4 else -0.2),
              ncol=min(len(handles), 8), fontsize=8, frameon=False)
    bubble = float(timeline.bubble_fraction)
    ax.set_title(title or f"{schedule.kind}  P={p} M={schedule.num_microbatches}"
                 + (f" V={v}" if v > 1 else "") + f"  bubble {bubble:.1%}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _gcd(a: Fraction, b: Fraction) -> Fraction:
    """The largest d with a / d and b / d whole (Fractions; gcd(a, 0) = a)."""
    if b == 0:
        return a
    den = a.denominator * b.denominator // math.gcd(a.denominator, b.denominator)
    return Fraction(math.gcd(int(a * den), int(b * den)), den)


def _fmt(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{float(x):g}"
