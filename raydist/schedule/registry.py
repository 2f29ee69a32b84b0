"""The pipeline schedule kinds: one `ScheduleKind` per kind, everything the rest of raydist asks of it.

A kind is its generator (`generators.py`, `zero_bubble.py`), how many model chunks a rank holds and where
they sit (`actions.stages_of_rank`), whether it splits the backward into B and W, what it needs of the
micro-batch count M on P ranks, its bubble and ideal step time (`timeline.py` derives both), the
activations a stage holds at its peak (the planner's memory model) and the chunk counts the CLI defaults to
and the planner tries. The config's choices, the layout's checks, the planner, `raydist schedule` and the
pipeline runner read this table; adding a kind is adding an entry (and its generator).

    kind          chunks/rank  placement  split  M on P ranks     bubble at F = B = W
    gpipe         1            loop       no     any              (p-1)/(m+p-1)
    1f1b          1            loop       no     any              (p-1)/(m+p-1)
    interleaved   V (>= 2)     loop       no     a multiple of P  (p-1)/(v m+p-1)
    zbh1          1            loop       yes    >= P             (p-1)/(3m+p-1)
    zbv           2            v          yes    >= P             (p-1)/(6m+p-1)
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

from raydist.errors import ConfigError
from raydist.schedule import zero_bubble
from raydist.schedule.actions import Schedule, check_dims
from raydist.schedule.generators import gpipe, interleaved, interleaved_microbatch_problem, one_f_one_b

Generator = Callable[[int, int, int, Fraction, Fraction, "Fraction | None"], Schedule]  # (P, M, V, tf, tb, tw)
MicrobatchProblem = Callable[[str, int, int, bool], "str | None"]  # (kind, P, M, config_keys) -> problem


@dataclass(frozen=True)
class ScheduleKind:
    name: str
    """The kind's name: `parallel.pp_schedule`, `raydist schedule --kind`, `Schedule.kind`."""
    generator: Generator
    """Builds the schedule for (P, M, V, tf, tb, tw) on a shape `check_shape` accepted."""
    chunks: int | None
    """Model chunks each rank holds; None: the configured V (`virtual_stages`)."""
    placement: str
    """How the virtual stages sit on the ranks (`actions.stages_of_rank`): "loop" or "v"."""
    split_backward: bool
    """B is the input gradient only and W the weight gradient (W actions in the schedule)."""
    microbatch_problem: MicrobatchProblem
    """What the kind needs of M on P ranks: None, or the problem in the generators' words (config_keys
    False: M=, P=) or the config's (True: parallel.num_microbatches, parallel.pp)."""
    microbatches_multiple_of_ranks: bool
    """M must be a multiple of P (so a data-parallel rank's rows come in P micro-batches at a time)."""
    bubble: Callable[[int, int, int], Fraction]
    """Idle share of a step at F = B = W for (P, M, chunks per rank)."""
    formula: str
    """`bubble` as the planner prints it (in p, m, v)."""
    formula_in_costs: str
    """The bubble as `raydist schedule` prints it: in P, M, V and, for split kinds, the costs F, B, W."""
    step_time: Callable[[int, int, int, float, float, float], float]
    """Step time without overheads for (P, M, chunks per rank, tf, tb, tw)."""
    activation_peak: Callable[[int, int, int, int], float]
    """Micro-batches of a stage's layers whose activations it holds at its peak, for (P > 1, M, chunks per
    rank, stage): what `validate` measures (a split kind holds a micro-batch until its W)."""
    default_virtual_stages: int
    """`raydist schedule --virtual` when unset."""
    min_virtual_stages: int = 1
    """The least configured V the kind runs (interleaved: 2)."""
    planner_virtual_stages: tuple[int, ...] = ()
    """The chunk counts the layout search tries with pp > 1 (empty: the kind is not a candidate)."""
    title: str = ""
    """The kind in prose ("interleaved 1F1B"); the name when empty."""

    def chunks_per_rank(self, virtual_stages: int) -> int:
        """Chunks each rank holds given the configured V: the fixed count, or V itself."""
        return virtual_stages if self.chunks is None else self.chunks

    @property
    def label(self) -> str:
        return self.title or self.name


def _any_microbatches(kind: str, num_ranks: int, num_microbatches: int, config_keys: bool = False) -> None:
    return None


def _loop_bubble(p: int, m: int, v: int) -> Fraction:
    return Fraction(p - 1, v * m + p - 1)


def _loop_step_time(p: int, m: int, v: int, tf: float, tb: float, tw: float) -> float:
    return (m + (p - 1) / v) * (tf + tb)


def _gpipe_peak(p: int, m: int, v: int, stage: int) -> float:
    return m


def _one_f_one_b_peak(p: int, m: int, v: int, stage: int) -> float:
    return min(m, p - stage)


def _interleaved_peak(p: int, m: int, v: int, stage: int) -> float:
    if v == 1:
        return _one_f_one_b_peak(p, m, v, stage)
    # Megatron: warm-up chunks = (p - stage - 1) * 2 + (v - 1) * p, plus the one in flight; a chunk holds 1/v
    # of the stage's blocks.
    return min(m * v, (p - stage - 1) * 2 + (v - 1) * p + 1) / v


def _zero_bubble_peak(p: int, m: int, v: int, stage: int) -> float:
    # ZB-H1 delays rank r's Ws by r micro-batches, so every rank holds 1F1B's first-stage peak; ZB-V's greedy
    # keeps 2P chunk activations (half a rank's blocks each) = P whole micro-batches.
    return min(m, p)


GPIPE = ScheduleKind(
    name="gpipe", generator=lambda p, m, v, tf, tb, tw: gpipe(p, m), chunks=1, placement="loop",
    split_backward=False, microbatch_problem=_any_microbatches, microbatches_multiple_of_ranks=False,
    bubble=_loop_bubble, formula="(p-1)/(v m+p-1)", formula_in_costs="(P-1)/(M+P-1)", step_time=_loop_step_time,
    activation_peak=_gpipe_peak, default_virtual_stages=1)
ONE_F_ONE_B = ScheduleKind(
    name="1f1b", generator=lambda p, m, v, tf, tb, tw: one_f_one_b(p, m), chunks=1, placement="loop",
    split_backward=False, microbatch_problem=_any_microbatches, microbatches_multiple_of_ranks=False,
    bubble=_loop_bubble, formula="(p-1)/(v m+p-1)", formula_in_costs="(P-1)/(M+P-1)", step_time=_loop_step_time,
    activation_peak=_one_f_one_b_peak, default_virtual_stages=1, planner_virtual_stages=(1,))
INTERLEAVED = ScheduleKind(
    name="interleaved", generator=lambda p, m, v, tf, tb, tw: interleaved(p, m, v), chunks=None,
    placement="loop", split_backward=False, microbatch_problem=interleaved_microbatch_problem,
    microbatches_multiple_of_ranks=True, bubble=_loop_bubble, formula="(p-1)/(v m+p-1)",
    formula_in_costs="(P-1)/(V*M+P-1)", step_time=_loop_step_time, activation_peak=_interleaved_peak,
    default_virtual_stages=2, min_virtual_stages=2, planner_virtual_stages=(2, 4), title="interleaved 1F1B")
ZBH1 = ScheduleKind(
    name="zbh1", generator=lambda p, m, v, tf, tb, tw: zero_bubble.zbh1(p, m), chunks=1, placement="loop",
    split_backward=True, microbatch_problem=zero_bubble.microbatch_problem, microbatches_multiple_of_ranks=False,
    bubble=lambda p, m, v: Fraction(p - 1, 3 * m + p - 1), formula="(p-1)/(3m+p-1)",
    formula_in_costs="(P-1)(F+B-W)/(M(F+B+W)+(P-1)(F+B-W))",
    step_time=lambda p, m, v, tf, tb, tw: m * (tf + tb) + (p - 1) * (tf + tb - 2 * tw),
    activation_peak=_zero_bubble_peak, default_virtual_stages=1, planner_virtual_stages=(1,))
ZBV = ScheduleKind(
    name="zbv", generator=lambda p, m, v, tf, tb, tw: zero_bubble.zbv(p, m, tf, tb, tw), chunks=2, placement="v",
    split_backward=True, microbatch_problem=zero_bubble.microbatch_problem, microbatches_multiple_of_ranks=False,
    bubble=lambda p, m, v: Fraction(p - 1, 6 * m + p - 1), formula="(p-1)/(6m+p-1)",
    formula_in_costs="(P-1)F/2/(M(F+B+W)+(P-1)F/2)",
    step_time=lambda p, m, v, tf, tb, tw: m * (tf + tb) + (p - 1) * (tf / 2),
    activation_peak=_zero_bubble_peak, default_virtual_stages=2, planner_virtual_stages=(2,))

SCHEDULE_KINDS: dict[str, ScheduleKind] = {k.name: k for k in (GPIPE, ONE_F_ONE_B, INTERLEAVED, ZBH1, ZBV)}
KINDS = tuple(SCHEDULE_KINDS)
SPLIT_BACKWARD_KINDS = tuple(k.name for k in SCHEDULE_KINDS.values() if k.split_backward)
DEFAULT_KIND = ONE_F_ONE_B.name  # no pipeline runs it too (pp = 1: one stage, nothing to schedule)


def schedule_kind(name: str) -> ScheduleKind:
    """The kind called `name`, or a ConfigError listing the kinds."""
    if name not in SCHEDULE_KINDS:
        raise ConfigError(f"schedule kind {name!r} is not one of {', '.join(KINDS)}")
    return SCHEDULE_KINDS[name]


def chunks_per_rank(kind: str, virtual_stages: int) -> int:
    """Model chunks each pipeline rank holds under schedule `kind`: the configured V for interleaved 1F1B,
    two for ZB-V (a V over the ranks), one otherwise (and for a name that is no kind: `validate` reports it)."""
    entry = SCHEDULE_KINDS.get(kind)
    return 1 if entry is None else entry.chunks_per_rank(virtual_stages)


def placement_of(kind: str) -> str:
    """How schedule `kind` lays its virtual stages on the ranks: "v" for ZB-V, "loop" otherwise."""
    entry = SCHEDULE_KINDS.get(kind)
    return "loop" if entry is None else entry.placement


def check_shape(kind: str, num_ranks: int, num_microbatches: int, virtual_stages: int) -> None:
    """ConfigError naming the value and the fix for a (kind, P, M, V) no generator can build."""
    entry = schedule_kind(kind)
    check_dims(num_ranks, num_microbatches, virtual_stages)
    fixed = entry.chunks
    if fixed not in (None, 1) and virtual_stages != fixed:
        where = " in a V" if entry.placement == "v" else ""
        raise ConfigError(f"virtual_stages={virtual_stages}: {kind} always runs {fixed} chunks per rank{where}; "
                          f"leave virtual_stages (--virtual) unset or pass {fixed}")
    problem = entry.microbatch_problem(kind, num_ranks, num_microbatches, False)
    if problem:
        raise ConfigError(problem)
    if fixed == 1 and virtual_stages != 1:
        raise ConfigError(f"virtual_stages={virtual_stages} needs the {INTERLEAVED.name} schedule (kind {kind!r} "
                          f"runs one chunk per rank); use --kind {INTERLEAVED.name} or virtual_stages=1")


def make_schedule(kind: str, num_ranks: int, num_microbatches: int, virtual_stages: int | None = None, *,
                  tf: Fraction | int = 1, tb: Fraction | int = 2, tw: Fraction | int | None = None) -> Schedule:
    """The schedule of `kind` (one of KINDS) for P ranks, M micro-batches, V chunks per rank.

    virtual_stages defaults to 2 for zbv (the only value it takes) and 1 otherwise. The costs (forward,
    backward, its weight-gradient part; `timeline`'s units) shape only zbv, whose greedy order is built
    for them; every other kind's order is the same whatever the costs."""
    if virtual_stages is None:
        virtual_stages = chunks_per_rank(kind, 1)
    check_shape(kind, num_ranks, num_microbatches, virtual_stages)
    return SCHEDULE_KINDS[kind].generator(num_ranks, num_microbatches, virtual_stages, tf, tb, tw)
