"""`raydist schedule --kind {gpipe,1f1b,interleaved} --stages P --microbatches M [--virtual V] [--png F]`.

Prints each rank's action sequence, a text timeline under the unit cost model (tf per forward, tb per
backward of one micro-batch through a rank's layers), the bubble fraction next to its theory, and the
peak activation memory in micro-batches; `--png` draws the timeline.
"""

from __future__ import annotations

import argparse
from fractions import Fraction

from raydist.config import ConfigError
from raydist.schedule.actions import KINDS
from raydist.schedule.generators import make_schedule
from raydist.schedule.timeline import render_png, render_text, simulate, theoretical_bubble
from raydist.schedule.validate import validate


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


def cmd_schedule(args) -> int:
    virtual = args.virtual if args.virtual is not None else (2 if args.kind == "interleaved" else 1)
    if args.kind == "interleaved" and virtual < 2:
        raise ConfigError(f"--virtual {virtual}: interleaved 1F1B needs at least 2 chunks per rank")
    schedule = make_schedule(args.kind, args.stages, args.microbatches, virtual)
    report = validate(schedule)
    timeline = simulate(schedule, args.tf, args.tb)
    p, m, v = schedule.num_ranks, schedule.num_microbatches, schedule.virtual_stages
    print(f"{schedule.kind}: P={p} ranks, M={m} micro-batches" + (f", V={v} chunks per rank" if v > 1 else "")
          + "  [valid: complete, forward before backward, no deadlock, channel order]")
    print(schedule.format(with_transfers=args.transfers))
    print(f"\ntimeline (forward {args.tf}, backward {args.tb} per micro-batch through a rank's layers):")
    print(render_text(timeline))
    theory = theoretical_bubble(schedule.kind, p, m, v)
    formula = "(P-1)/(V*M+P-1)" if schedule.kind == "interleaved" else "(P-1)/(M+P-1)"
    print(f"\nstep time {timeline.step_time} (busy {timeline.busy_per_rank[0]} per rank)")
    print(f"bubble fraction {_show(timeline.bubble_fraction)}  (theory {formula} = {_show(theory)})")
    peaks = ", ".join(f"rank {r}: {x}" for r, x in enumerate(report.peak_activations_per_rank))
    print(f"peak activation memory, micro-batches of a rank's layers: max {report.peak_activations}  ({peaks})")
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
    p.add_argument("--virtual", type=int, default=None, help="chunks per rank V (interleaved; default 2)")
    p.add_argument("--png", help="draw the timeline (Gantt chart) to this PNG file")
    p.add_argument("--tf", type=_fraction, default=Fraction(1), help="forward cost per micro-batch (default 1)")
    p.add_argument("--tb", type=_fraction, default=Fraction(2), help="backward cost per micro-batch (default 2)")
    p.add_argument("--transfers", action="store_true", help="list each action with its receive/send")
    p.set_defaults(func=cmd_schedule)
