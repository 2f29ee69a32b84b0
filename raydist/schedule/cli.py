"""`raydist schedule --kind {gpipe,1f1b,interleaved,zbh1,zbv} --stages P --microbatches M [--virtual V] [--png F]`.

Prints each rank's action sequence, a text timeline under the unit cost model (tf per forward, tb per
backward of one micro-batch through a rank's layers, tw of which is the weight gradient that zbh1/zbv
run as separate W actions), the bubble fraction next to its theory, and the peak activation memory in
micro-batches (for zbh1/zbv next to 1F1B's at the same P, M); `--png` draws the timeline.
"""

from __future__ import annotations

import argparse
from fractions import Fraction

from raydist.errors import ConfigError
from raydist.schedule.registry import KINDS, ONE_F_ONE_B, make_schedule, schedule_kind
from raydist.schedule.timeline import ideal_step_time, render_png, render_text, simulate, theoretical_bubble
from raydist.schedule.validate import ScheduleReport, validate


def _fraction(text: str) -> Fraction:
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 2 or 1.5 or 3/2)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def _show(x: Fraction) -> str:
    return f"{x} = {float(x):.1%}" if x.denominator != 1 else f"{x}"


def _peaks(report: ScheduleReport) -> str:
    per_rank = ", ".join(f"rank {r}: {x}" for r, x in enumerate(report.peak_activations_per_rank))
    return f"max {report.peak_activations}  ({per_rank})"


def cmd_schedule(args) -> int:
    kind = schedule_kind(args.kind)
    virtual = args.virtual if args.virtual is not None else kind.default_virtual_stages
    if virtual < kind.min_virtual_stages:
        raise ConfigError(f"--virtual {virtual}: {kind.label} needs at least {kind.min_virtual_stages} chunks per rank")
    tw = args.tb / 2 if args.tw is None else args.tw
    if tw > args.tb:
        raise ConfigError(f"--tw {tw} is more than --tb {args.tb}: tw is the weight-gradient part of the backward")
    schedule = make_schedule(args.kind, args.stages, args.microbatches, virtual, tf=args.tf, tb=args.tb, tw=tw)
    report = validate(schedule)
    timeline = simulate(schedule, args.tf, args.tb, tw)
    split = schedule.split_backward
    p, m, v = schedule.num_ranks, schedule.num_microbatches, schedule.virtual_stages
    order = "forward before B before W" if split else "forward before backward"
    shape = (f", V={v} chunks per rank" if v > 1 else "") + (" in a V" if schedule.placement == "v" else "")
    print(f"{schedule.kind}: P={p} ranks, M={m} micro-batches{shape}"
          f"  [valid: complete, {order}, no deadlock, channel order]")
    print(schedule.format(with_transfers=args.transfers))
    costs = (f"backward {args.tb} = B {args.tb - tw} (input grad) + W {tw} (weight grad)" if split
             else f"backward {args.tb}")
    print(f"\ntimeline (forward {args.tf}, {costs} per micro-batch through a rank's layers):")
    print(render_text(timeline))
    if split:  # the paper's formulas in F = tf, B = tb - tw, W = tw (at F = B = W: theoretical_bubble)
        busy = m * (args.tf + args.tb)
        theory = 1 - busy / ideal_step_time(schedule.kind, p, m, v, args.tf, args.tb, tw)
    else:
        theory = theoretical_bubble(schedule.kind, p, m, v)
    formula = kind.formula_in_costs
    print(f"\nstep time {timeline.step_time} (busy {timeline.busy_per_rank[0]} per rank)")
    print(f"bubble fraction {_show(timeline.bubble_fraction)}  (theory {formula} = {_show(theory)})")
    held = " (held from F to W)" if split else ""
    print(f"peak activation memory, micro-batches of a rank's layers{held}: {_peaks(report)}")
    if split:
        baseline = validate(make_schedule(ONE_F_ONE_B.name, p, m))
        print(f"  1F1B at the same P, M: {_peaks(baseline)}; {schedule.kind} peak "
              + ("<=" if report.peak_activations <= baseline.peak_activations else ">") + " 1F1B's peak")
    if v > 1:
        print("peak in-flight micro-batches per virtual stage: "
              + ", ".join(f"s{s}: {n}" for s, n in enumerate(report.peak_inflight_per_stage)))
    if args.png:
        render_png(timeline, args.png)
        print(f"wrote {args.png}")
    return 0


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("schedule", help="print (and draw) a pipeline schedule and its bubble")
    p.add_argument("--kind", required=True, choices=KINDS, help="pipeline schedule")
    p.add_argument("--stages", type=int, required=True, help="pipeline ranks P")
    p.add_argument("--microbatches", type=int, required=True, help="micro-batches per step M")
    p.add_argument("--virtual", type=int, default=None,
                   help="chunks per rank V (interleaved: default 2; zbv: always 2)")
    p.add_argument("--png", help="draw the timeline (Gantt chart) to this PNG file")
    p.add_argument("--tf", type=_fraction, default=Fraction(1), help="forward cost per micro-batch (default 1)")
    p.add_argument("--tb", type=_fraction, default=Fraction(2), help="backward cost per micro-batch (default 2)")
    p.add_argument("--tw", type=_fraction, default=None,
                   help="weight-gradient part of the backward, run as W by zbh1/zbv (default tb/2)")
    p.add_argument("--transfers", action="store_true", help="list each action with its receive/send")
    p.set_defaults(func=cmd_schedule)
