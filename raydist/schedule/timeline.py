"""Simulate a schedule in time, compare its bubble with the theory, draw it.

Cost model (exact: times are Fractions). A rank's whole share of the layers costs tf forward and tb
backward per micro-batch (default tf = 1, tb = 2: a backward computes input and weight gradients, about
twice a forward's FLOPs); a chunk of an interleaved rank holds 1/V of them, so its actions cost tf/V and
tb/V. Transfers take no time. Each rank runs its actions in order; an action starts when the rank is
free and the tensor it receives has been produced:

    start(a) = max(finish(previous action on the rank), finish(action a receives from))

The step time T is the last finish over all ranks; every rank is busy M (tf + tb), so its bubble is
1 - M (tf + tb) / T. The theory (seed 001/003, Narayanan et al. 2021 for interleaving):

    gpipe, 1f1b:   T = (M + P - 1) (tf + tb)        bubble = (P - 1) / (M + P - 1)
    interleaved:   T = (M + (P - 1)/V) (tf + tb)    bubble = (P - 1) / (V M + P - 1)
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from raydist.schedule.actions import FORWARD, Action, Schedule
from raydist.schedule.validate import execution_order


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
    tb: Fraction  # backward cost

    @property
    def bubble_per_rank(self) -> tuple[Fraction, ...]:
        return tuple(1 - busy / self.step_time for busy in self.busy_per_rank)

    @property
    def bubble_fraction(self) -> Fraction:
        """Idle share of all ranks' time in the step: 1 - sum(busy) / (P T)."""
        return 1 - sum(self.busy_per_rank) / (self.schedule.num_ranks * self.step_time)


def simulate(schedule: Schedule, tf: Fraction | int = 1, tb: Fraction | int = 2) -> Timeline:
    """The schedule's timeline under the cost model above (validates the dependencies on the way)."""
    tf, tb = Fraction(tf), Fraction(tb)
    v = schedule.virtual_stages
    cost = {FORWARD: tf / v}
    finish: dict[Action, Fraction] = {}
    rank_free = [Fraction(0)] * schedule.num_ranks
    busy = [Fraction(0)] * schedule.num_ranks
    intervals = []
    for rank, action in execution_order(schedule):
        recv = schedule.recv_of(action)
        ready = Fraction(0)
        if recv is not None:
            ready = finish[Action(action.kind, recv.src_stage, action.microbatch)]
        start = max(rank_free[rank], ready)
        duration = cost.get(action.kind, tb / v)
        finish[action] = rank_free[rank] = start + duration
        busy[rank] += duration
        intervals.append(Interval(rank, action, start, start + duration))
    return Timeline(schedule, tuple(intervals), max(rank_free), tuple(busy), tf, tb)


def theoretical_bubble(kind: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> Fraction:
    """(P - 1) / (M + P - 1) for gpipe and 1f1b; (P - 1) / (V M + P - 1) for interleaved."""
    p, m = num_ranks, num_microbatches
    v = virtual_stages if kind == "interleaved" else 1
    return Fraction(p - 1, v * m + p - 1)


def ideal_step_time(kind: str, num_ranks: int, num_microbatches: int, virtual_stages: int,
                    tf: float, tb: float) -> float:
    """(M + P - 1)(tf + tb), or (M + (P - 1)/V)(tf + tb) interleaved: the step time without overheads."""
    v = virtual_stages if kind == "interleaved" else 1
    return (num_microbatches + (num_ranks - 1) / v) * (tf + tb)


def render_text(timeline: Timeline, width_per_unit: int = 2) -> str:
    """An ASCII Gantt chart: one row per rank, `F`/`B` cells labelled by micro-batch, `.` idle."""
    schedule = timeline.schedule
    unit = Fraction(1, schedule.virtual_stages)  # the smallest cost quantum with tf, tb integers
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
        from raydist.config import ConfigError

        raise ConfigError(f"--png needs matplotlib ({exc}); pip install 'raydist[plot]'") from None
    schedule = timeline.schedule
    p, v = schedule.num_ranks, schedule.virtual_stages
    step = float(timeline.step_time)
    fig, ax = plt.subplots(figsize=(min(24, max(8, step * 0.45)), 0.7 * p + 1.6))
    forward_colors = ["#4C72B0", "#64B5CD", "#8172B2", "#55A868"]
    backward_colors = ["#DD8452", "#C44E52", "#CCB974", "#937860"]
    for iv in timeline.intervals:
        chunk = schedule.chunk_of(iv.action.stage)
        palette = forward_colors if iv.action.kind == FORWARD else backward_colors
        start, width = float(iv.start), float(iv.finish - iv.start)
        ax.barh(iv.rank, width, left=start, height=0.8, color=palette[chunk % len(palette)],
                edgecolor="black", linewidth=0.5)
        ax.text(start + width / 2, iv.rank, str(iv.action.microbatch), ha="center", va="center",
                fontsize=7 if v == 1 else 6, color="white")
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlim(0, step)
    ax.set_xlabel(f"time (a rank's forward of one micro-batch = {_fmt(timeline.tf)}, backward = {_fmt(timeline.tb)})")
    handles = []
    for c in range(v):
        suffix = f" chunk {c}" if v > 1 else ""
        handles += [Patch(color=forward_colors[c % 4], label=f"forward{suffix}"),
                    Patch(color=backward_colors[c % 4], label=f"backward{suffix}")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35 if p < 4 else -0.2),
              ncol=min(len(handles), 8), fontsize=8, frameon=False)
    bubble = float(timeline.bubble_fraction)
    ax.set_title(title or f"{schedule.kind}  P={p} M={schedule.num_microbatches}"
                 + (f" V={v}" if v > 1 else "") + f"  bubble {bubble:.1%}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{float(x):g}"
