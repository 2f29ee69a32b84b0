"""The schedule registry is the one source of what a kind is: every entry's generator, chunk count, placement,
split backward, micro-batch rule, bubble (function and both printed formulas), ideal step time and activation
peak agree with the schedule it builds (validated and simulated exactly), and the config, the layout check and
`raydist schedule` offer exactly its kinds. A planted entry whose bubble is off by one micro-batch is caught."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from fractions import Fraction

from raydist.config import CHOICES, ModelConfig
from raydist.errors import ConfigError
from raydist.parallel.layout import Layout, validate as validate_layout
from raydist.schedule import simulate, validate
from raydist.schedule.cli import register_cli
from raydist.schedule.registry import (DEFAULT_KIND, KINDS, ONE_F_ONE_B, SCHEDULE_KINDS, SPLIT_BACKWARD_KINDS,
                                       ScheduleKind, make_schedule)

UNIT = {"tf": 1, "tb": 2, "tw": 1}  # F = B = W: the costs the bubble functions are stated at
COSTS = [(1, 3, 1), (2, 3, Fraction(1, 2))]  # (tf, tb, tw) with W <= F and W <= B (zbh1's formula is exact there)


def _shapes(kind: ScheduleKind):
    """(P, M, V) the kind accepts: P in 1..4, M in P..3P (whatever its micro-batch rule allows), V its chunks."""
    for p in range(1, 5):
        for m in range(p, 3 * p + 1):
            for v in ((2, 3) if kind.chunks is None else (kind.chunks,)):
                if kind.microbatch_problem(kind.name, p, m, False) is None:
                    yield p, m, v


def _evaluate(formula: str, **values: Fraction) -> Fraction:
    """A printed formula ("(p-1)/(v m+p-1)", "(P-1)F/2/(M(F+B+W)+(P-1)F/2)") evaluated exactly: juxtaposition
    is a product."""
    text = re.sub(r"(?<=[\w)])\s*(?=[A-Za-z(])", "*", formula)
    return eval(text, {}, {name: Fraction(x) for name, x in values.items()})  # the registry's own strings, not input


def _close(a, b) -> bool:
    """Equal, or within float rounding where an entry computes in floats (the planner's step time, peaks)."""
    return math.isclose(a, b, rel_tol=1e-12)


def disagreements(kind: ScheduleKind) -> list[str]:
    """Where `kind`'s entry says something else than the schedules its generator builds."""
    out = []
    for p, m, v in _shapes(kind):
        schedule = kind.generator(p, m, v, Fraction(1), Fraction(2), Fraction(1))
        report = validate(schedule)
        chunks = kind.chunks_per_rank(v)
        shape = f"{kind.name} P={p} M={m} V={v}"
        if (schedule.kind, schedule.virtual_stages, schedule.placement, schedule.split_backward) != \
                (kind.name, chunks, kind.placement, kind.split_backward):
            out.append(f"{shape}: built {schedule.kind}, V={schedule.virtual_stages}, {schedule.placement}, "
                       f"split={schedule.split_backward}")
        timeline = simulate(schedule, **UNIT)
        bubble = kind.bubble(p, m, chunks)
        if timeline.bubble_fraction != bubble or timeline.bubble_per_rank != (bubble,) * p:
            out.append(f"{shape}: simulated bubble {timeline.bubble_fraction}, entry says {bubble}")
        if _evaluate(kind.formula, p=p, m=m, v=chunks) != bubble:
            out.append(f"{shape}: formula {kind.formula} is not the entry's bubble {bubble}")
        for tf, tb, tw in [(1, 2, 1)] + (COSTS if kind.split_backward else []):
            timed = simulate(kind.generator(p, m, v, Fraction(tf), Fraction(tb), Fraction(tw)), tf, tb, tw)
            ideal = kind.step_time(p, m, chunks, Fraction(tf), Fraction(tb), Fraction(tw))
            if kind.name == "zbv" and (tf, tb, tw) != (1, 2, 1):
                agrees = ideal <= timed.step_time  # zbv's step time is a lower bound away from F = B = W
            else:
                agrees = _close(ideal, timed.step_time)
            shown = _evaluate(kind.formula_in_costs, P=p, M=m, V=chunks, F=tf, B=Fraction(tb - tw), W=tw)
            if not agrees or not _close(shown, 1 - m * (tf + tb) / ideal):
                out.append(f"{shape} tf={tf} tb={tb} tw={tw}: simulated step {timed.step_time}, entry says {ideal}, "
                           f"its formula {kind.formula_in_costs} = {shown}")
        peaks = [kind.activation_peak(p, m, chunks, r) for r in range(p)]  # stated for P > 1 (the planner's)
        if p > 1 and not all(map(_close, peaks, report.peak_activations_per_rank)):
            out.append(f"{shape}: peak activations per rank {list(report.peak_activations_per_rank)}, "
                       f"entry says {peaks}")
    return out


def test_every_kind_agrees_with_the_schedules_it_builds():
    assert KINDS == tuple(SCHEDULE_KINDS) and len(KINDS) == 5
    for kind in SCHEDULE_KINDS.values():
        assert list(_shapes(kind)), kind.name
        assert disagreements(kind) == [], kind.name
    assert SPLIT_BACKWARD_KINDS == tuple(k.name for k in SCHEDULE_KINDS.values() if k.split_backward)


def test_a_bubble_off_by_one_micro_batch_is_caught():
    planted = dataclasses.replace(ONE_F_ONE_B, bubble=lambda p, m, v: Fraction(p - 1, v * (m + 1) + p - 1))
    found = disagreements(planted)
    assert found and all("bubble" in line or "formula" in line for line in found)
    assert any("1f1b P=2 M=2 V=1: simulated bubble 1/3, entry says 1/4" == line for line in found)
    misprinted = dataclasses.replace(SCHEDULE_KINDS["zbh1"], formula="(p-1)/(3m+p)")
    assert disagreements(misprinted) and all("formula (p-1)/(3m+p)" in line for line in disagreements(misprinted))


def test_the_micro_batch_rule_is_the_generators_and_the_layouts():
    model = ModelConfig(num_layers=8)
    for kind in SCHEDULE_KINDS.values():
        v = kind.chunks_per_rank(kind.default_virtual_stages)
        for p in range(1, 5):
            for m in range(1, 3 * p + 1):
                problem = kind.microbatch_problem(kind.name, p, m, False)
                in_config = kind.microbatch_problem(kind.name, p, m, True)
                assert (problem is None) == (in_config is None), (kind.name, p, m)
                assert (m % p == 0 or problem is not None) or not kind.microbatches_multiple_of_ranks
                try:
                    make_schedule(kind.name, p, m, v)
                    assert problem is None, (kind.name, p, m)
                except ConfigError as exc:
                    assert str(exc) == problem, (kind.name, p, m)
                if p > 1:
                    lay = Layout.of(pp=p, num_microbatches=m, pp_schedule=kind.name, virtual_stages=v)
                    assert (in_config in validate_layout(lay, model, 16)) == (in_config is not None)


def test_config_layout_and_cli_offer_the_registrys_kinds():
    assert CHOICES["parallel.pp_schedule"] == KINDS
    assert DEFAULT_KIND in KINDS
    problems = validate_layout(Layout.of(pp=2, num_microbatches=2, pp_schedule="zb"), ModelConfig(), 16)
    assert any(f"is not one of {', '.join(KINDS)}" in line for line in problems)
    subparsers = argparse.ArgumentParser().add_subparsers()
    register_cli(subparsers)
    kind_action = next(a for a in subparsers.choices["schedule"]._actions if a.dest == "kind")
    assert tuple(kind_action.choices) == KINDS
