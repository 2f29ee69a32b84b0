"""Timeouts from measurements (raydist.elastic.hang.timeouts): the derivation, its warm-up, window and phases;
a slow rank under the derived limits gets a `straggler` event and the run completes; a stopped rank is found
hung within 3x the measured step plus the floor, on gloo (the collective raises) and under NCCL's rules (the
strict mode: the group's timeout ends the process), where the fixed ceiling would have taken a minute."""

from __future__ import annotations

import json
import time

import pytest

from raydist.elastic.hang.timeouts import WINDOW_STEPS, StepLimits, StepTimeouts, derive_timeout_s
from raydist.testing import run_fit, tiny_config
from workers import patience

CEILING_S = 60.0  # elastic.collective_timeout_s of the runs: what a broken derivation would wait


def test_the_derivation_is_k_times_the_longest_step_between_the_floor_and_the_ceiling():
    assert derive_timeout_s([0.2, 0.5, 0.3], factor=3, floor_s=1.0, ceiling_s=60.0) == pytest.approx(1.5)
    assert derive_timeout_s([0.2, 0.5, 0.3], factor=4, floor_s=1.0, ceiling_s=60.0) == pytest.approx(2.0)  # k counts
    assert derive_timeout_s([0.1], factor=3, floor_s=1.0, ceiling_s=60.0) == 1.0  # the floor
    assert derive_timeout_s([30.0], factor=3, floor_s=1.0, ceiling_s=60.0) == 60.0  # the ceiling
    assert derive_timeout_s([0.1], factor=3, floor_s=90.0, ceiling_s=60.0) == 60.0  # the ceiling wins over the floor
    assert derive_timeout_s([], factor=3, floor_s=1.0, ceiling_s=60.0) == 60.0  # nothing measured: the fixed one
    assert derive_timeout_s([None, 0.5], factor=3, floor_s=1.0, ceiling_s=60.0) == pytest.approx(1.5)
    assert derive_timeout_s([0.5], factor=0, floor_s=1.0, ceiling_s=60.0) == 60.0  # off


class Recorder:
    """A session that records what it is told."""

    def __init__(self):
        self.limits: list[StepLimits | None] = []

    def step_limits(self, limits):
        self.limits.append(limits)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def steps(timeouts: StepTimeouts, clock: Clock, first: int, last: int, seconds: float) -> None:
    for step in range(first, last + 1):
        clock.now += seconds
        timeouts.step_done(step)


def test_warm_up_window_moves_and_the_fixed_limits_outside_the_step_phase():
    session, clock = Recorder(), Clock()
    t = StepTimeouts(session, list, factor=3.0, floor_s=1.0, ceiling_s=60.0, warmup_steps=4, start_step=10,
                     clock=clock)
    steps(t, clock, 11, 14, 5.0)  # the warm-up: slow first steps are not measured
    assert t.take() is None and t.update(14, [None, None]) is None and session.limits == []
    steps(t, clock, 15, 16, 0.5)
    assert t.take() == pytest.approx(0.5)
    moved = t.update(16, [0.5, 0.8])  # every rank's longest: the slowest rank's step counts
    assert (moved.collective_s, moved.watchdog_s, moved.measured_s) == (pytest.approx(2.4), pytest.approx(4.8), 0.8)
    assert moved.enforced_by == "groups" and session.limits == [moved] and t.record()["collective_s"] == 2.4
    assert t.update(18, [0.75, 0.78]) is None  # within CHANGE: nothing moves, nothing is reported
    assert t.update(20, [1.0, 1.0]).collective_s == pytest.approx(3.0)  # a slower run: the limits grow at once
    # a long step is remembered for WINDOW_STEPS steps, then the limits come down again
    assert t.update(20 + WINDOW_STEPS - 1, [0.5]) is None
    assert t.update(20 + WINDOW_STEPS, [0.5]).collective_s == pytest.approx(1.5)
    applied = len(session.limits)
    # an evaluation or a save, and the step after it, run under the fixed limits (None); then derived again
    t.phase("step")
    assert len(session.limits) == applied
    t.phase("evaluate")
    assert session.limits[-1] is None
    clock.now += 30.0
    t.phase("step")
    t.step_done(221)  # the first step after the evaluation: not measured, then the derived limits again
    assert t.take() is None and session.limits[-1].collective_s == pytest.approx(1.5)
    # a derivation while relaxed applies at the next step
    t.phase("save")
    assert t.update(222 + WINDOW_STEPS, [0.9]).collective_s == pytest.approx(2.7) and session.limits[-1] is None
    clock.now += 1.0
    t.step_done(223 + WINDOW_STEPS)
    assert session.limits[-1].collective_s == pytest.approx(2.7)


def test_factor_zero_keeps_the_fixed_limits():
    session, clock = Recorder(), Clock()
    t = StepTimeouts(session, list, factor=0.0, floor_s=1.0, ceiling_s=60.0, warmup_steps=1, start_step=0, clock=clock)
    steps(t, clock, 1, 10, 0.5)
    assert t.update(10, [t.take()]) is None and t.record() is None and session.limits == []


def test_a_group_whose_timeout_torch_cannot_change_leaves_the_limit_to_the_watchdog():
    session, clock = Recorder(), Clock()
    t = StepTimeouts(session, lambda: [object()], factor=3.0, floor_s=1.0, ceiling_s=60.0, warmup_steps=1,
                     start_step=0, clock=clock)
    moved = t.update(4, [1.0])
    assert moved.enforced_by == "watchdog" and moved.watchdog_s == moved.collective_s == pytest.approx(3.0)


def test_a_timeouts_event_is_one_console_line():
    from raydist.driver.console import describe_event

    line = describe_event({"kind": "timeouts", "step": 40, "collective_s": 31.5, "watchdog_s": 63.0, "measured_s": 10.5,
                           "steps": 20, "enforced_by": "groups", "factor": 3.0, "floor_s": 30.0, "ceiling_s": 300.0})
    assert line == ("timeouts at step 40: collectives 31.5s, step watchdog 63s (3 x the longest step, 10.5s; floor 30s, "
                    "ceiling 300s)")


def test_the_ray_session_hands_the_limits_to_its_watchdog_and_monitor_and_takes_them_back():
    from types import SimpleNamespace

    from raydist.config import Config
    from raydist.elastic.control import Watchdog
    from raydist.training.ray_session import RaySession

    session = object.__new__(RaySession)  # (its constructor needs a process group: only the limits matter here)
    session.cfg = Config.from_dict({"elastic": {"collective_timeout_s": CEILING_S}})
    session.fixed_step_s = 2 * CEILING_S
    session.limits = {"step": session.fixed_step_s, "evaluate": 2 * CEILING_S}
    session.watchdog = Watchdog(session.fixed_step_s, phase="step")  # (not started)
    session.monitor = SimpleNamespace(collective_timeout_s=CEILING_S)
    limits = StepLimits(collective_s=1.5, watchdog_s=3.0, measured_s=0.5, steps=10, enforced_by="groups")
    session.step_limits(limits)
    assert (session.limits["step"], session.watchdog.timeout_s, session.monitor.collective_timeout_s) == (3.0, 3.0, 1.5)
    assert session.limits["evaluate"] == 2 * CEILING_S
    session.step_limits(None)
    assert (session.limits["step"], session.watchdog.timeout_s, session.monitor.collective_timeout_s) == (
        2 * CEILING_S, 2 * CEILING_S, CEILING_S)
    session.watchdog.phase("evaluate", 2 * CEILING_S)  # in another phase the watchdog keeps that phase's limit
    session.step_limits(limits)
    assert session.watchdog.timeout_s == 2 * CEILING_S and session.limits["step"] == 3.0


def events(run_dir, kind):
    return [e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines()) if e["kind"] == kind]


def timed_config(tiny_data, steps: int, factor: float, floor_s: float, train: dict | None = None, **sections):
    return tiny_config(tiny_data, train={"steps": steps, "log_every": 2, **(train or {})}, parallel={"dp_replicate": 2},
                       elastic={"timeout_factor": factor, "timeout_floor_s": floor_s, "timeout_warmup_steps": 3,
                                "collective_timeout_s": CEILING_S}, **sections)


def test_a_slow_rank_under_derived_timeouts_is_a_straggler_and_the_run_completes(tiny_data, tmp_path):
    """Rank 1's forwards take several times longer (tests/unit/slow_rank.py): every rank's step waits for it,
    so the derived limits cover its steps; it gets a straggler event and is never taken for a hung one. The
    evaluations and checkpoints on the way run under the fixed limits and the derived ones come back after."""
    raw = timed_config(tiny_data, 12, 3.0, patience(1.0), train={"eval_every": 5}, monitor={"straggler_intervals": 2},
                       checkpoint={"every_steps": 5, "async_save": False})
    run_dir = tmp_path / "run"
    [result, _] = run_fit(raw, 2, str(run_dir), imports=("slow_rank",))
    assert result.summary["steps"] == 12
    [straggler] = events(run_dir, "straggler")
    assert straggler["rank"] == 1
    moves = events(run_dir, "timeouts")
    assert moves and moves[0]["step"] <= 6, moves  # derived at the first logged step after the warm-up
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if r["step"] == moves[0]["step"])
    assert moves[0]["measured_s"] >= first["ranks"]["step_time_s"]["p50"][1], (moves[0], first["ranks"])  # its steps
    for move in moves:
        assert move["collective_s"] == pytest.approx(min(CEILING_S, max(move["floor_s"], 3.0 * move["measured_s"])),
                                                     rel=1e-2)
        # (the event holds each limit rounded to the millisecond: 2 x 3.412 against 6.823 in a clean-clone run)
        assert move["collective_s"] < CEILING_S and move["watchdog_s"] == pytest.approx(2 * move["collective_s"],
                                                                                        abs=1.5e-3)
    assert all("timeouts" in r for r in records if r["step"] >= moves[0]["step"])


@pytest.mark.parametrize("backend", ["gloo", "strict"])
def test_a_stopped_rank_is_found_hung_within_three_measured_steps_plus_the_floor(backend, tiny_data, tmp_path,
                                                                                 monkeypatch, request):
    """Rank 1 stops itself (SIGSTOP) before step 13 (tests/unit/stopped_rank.py; every step takes 0.5 s more);
    rank 0's next collective
    waits for it and fails at the derived limit: on gloo it raises, under NCCL's rules (strict) the group's
    timeout ends the process. With the limit left at the ceiling (a broken derivation) it would wait 60 s or
    more (the spawned world group's own timeout is 300 s)."""
    if backend == "gloo":
        request.getfixturevalue("plain_gloo")
    floor_s, stop_after = 1.0, 12
    stop_file = tmp_path / "stopped"
    monkeypatch.setenv("RAYDIST_TEST_STOP_AFTER", str(stop_after))
    monkeypatch.setenv("RAYDIST_TEST_STOP_FILE", str(stop_file))
    monkeypatch.setenv("RAYDIST_TEST_STEP_S", "0.5")  # 2 x the step is then above the floor: k decides the limit
    raw = timed_config(tiny_data, 40, 2.0, floor_s)
    run_dir = tmp_path / "run"
    started = time.time()
    with pytest.raises(RuntimeError) as failed:
        run_fit(raw, 2, str(run_dir), imports=("stopped_rank",))
    assert time.time() - started < CEILING_S, "the stopped rank was found only at the fixed ceiling"
    stopped_at = float(stop_file.read_text())
    ended_at, how = (tmp_path / "stopped.rank0").read_text().split(" ", 1)
    assert how.startswith("raised" if backend == "gloo" else "aborted"), (how, str(failed.value)[-2000:])
    assert "timed out" in how.lower(), how
    [*_, limits] = [e for e in events(run_dir, "timeouts") if e["step"] <= stop_after]
    measured = limits["measured_s"]
    assert limits["collective_s"] == pytest.approx(min(CEILING_S, max(floor_s, 2.0 * measured)), rel=1e-2), limits
    hung_after = float(ended_at) - stopped_at
    print(f"\n{backend}: measured step {measured:.3f}s, collective limit {limits['collective_s']:.3f}s, "
          f"hung after {hung_after:.2f}s (bound {3 * measured + floor_s:.2f}s)")
    assert hung_after <= 3 * measured + floor_s, (hung_after, limits)
