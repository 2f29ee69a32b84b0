"""Schedules as data: validity, exact bubble = theory, activation memory, validator rejections, CLI."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from raydist.cli import main
from raydist.config import ConfigError
from raydist.schedule import (BACKWARD, FORWARD, Action, Schedule, ScheduleError, make_schedule, simulate,
                              theoretical_bubble, validate)
from raydist.schedule.timeline import render_text

COSTS = [(1, 2), (1, 1), (2, 3), (Fraction(1, 3), 1)]  # (tf, tb)


def shapes(kind: str):
    """Every (P, M, V) the generator accepts in a grid: P 1..8, M 1..24, V 2..4 (interleaved)."""
    for p, m in itertools.product(range(1, 9), range(1, 25)):
        if kind != "interleaved":
            yield p, m, 1
        elif m % p == 0:
            yield from ((p, m, v) for v in (2, 3, 4))


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved"])
def test_valid_and_bubble_equals_theory(kind):
    count = 0
    for p, m, v in shapes(kind):
        schedule = make_schedule(kind, p, m, v)
        validate(schedule)
        theory = theoretical_bubble(kind, p, m, v)
        for tf, tb in COSTS if (p + m) % 5 == 0 else COSTS[:1]:
            timeline = simulate(schedule, tf, tb)
            # Exact (Fractions): the step time and every rank's bubble equal the formula.
            assert timeline.bubble_per_rank == (theory,) * p, (kind, p, m, v, tf, tb)
            assert timeline.bubble_fraction == theory
            assert all(busy == m * (Fraction(tf) + Fraction(tb)) for busy in timeline.busy_per_rank)
        count += 1
    assert count > 150


@pytest.mark.parametrize("p,m", list(itertools.product(range(1, 9), range(1, 25))))
def test_inflight_micro_batches(p, m):
    """1F1B keeps min(P - r, M) micro-batches in flight on stage r; GPipe keeps all M."""
    one_f_one_b = validate(make_schedule("1f1b", p, m))
    assert one_f_one_b.peak_inflight_per_stage == tuple(min(p - r, m) for r in range(p))
    assert one_f_one_b.peak_activations_per_rank == tuple(Fraction(min(p - r, m)) for r in range(p))
    assert validate(make_schedule("gpipe", p, m)).peak_inflight_per_stage == (m,) * p


def test_interleaved_bubble_is_one_vth_of_1f1b():
    """Idle time per rank: 1F1B (P-1)(tf+tb), interleaved (P-1)(tf+tb)/V - exactly 1/V."""
    for p, m, v in shapes("interleaved"):
        base = simulate(make_schedule("1f1b", p, m))
        inter = simulate(make_schedule("interleaved", p, m, v))
        idle_base = base.step_time - base.busy_per_rank[0]
        idle_inter = inter.step_time - inter.busy_per_rank[0]
        assert idle_inter * v == idle_base, (p, m, v)
        if p > 1:
            assert inter.bubble_fraction < base.bubble_fraction
            assert inter.bubble_fraction / base.bubble_fraction == Fraction(m + p - 1, v * m + p - 1)


def test_interleaved_memory_is_bounded():
    """Interleaving trades memory for bubble: rank r holds at most (warm-up + 1) chunk units, i.e.
    (min(2(P - r - 1) + (V - 1) P, M V) + 1) / V micro-batches' worth, never more than GPipe's M."""
    for p, m, v in shapes("interleaved"):
        report = validate(make_schedule("interleaved", p, m, v))
        for r, peak in enumerate(report.peak_activations_per_rank):
            warmup = min(2 * (p - r - 1) + (v - 1) * p, m * v)
            assert peak <= Fraction(min(warmup + 1, m * v), v) <= m


def test_chunk_assignment_and_transfers():
    s = make_schedule("interleaved", 4, 4, 2)
    assert s.stages_of(1) == [1, 5] and s.rank_of(5) == 1 and s.chunk_of(5) == 1
    recv = s.recv_of(Action(FORWARD, 4, 2))  # chunk 1 of rank 0 receives from stage 3 = rank 3
    assert (recv.what, recv.src_rank, recv.dst_rank, recv.src_stage) == ("activation", 3, 0, 3)
    send = s.send_of(Action(BACKWARD, 4, 2))
    assert (send.what, send.dst_rank, send.dst_stage) == ("gradient", 3, 3)
    assert s.recv_of(Action(FORWARD, 0, 0)) is None and s.send_of(Action(FORWARD, 7, 0)) is None
    assert s.recv_of(Action(BACKWARD, 7, 0)) is None and s.send_of(Action(BACKWARD, 0, 0)) is None
    tags = {s.tag(t) for a in itertools.chain(*s.actions) for t in (s.recv_of(a), s.send_of(a)) if t}
    assert len(tags) == 2 * (s.num_stages - 1) * s.num_microbatches  # activations + gradients, all distinct


def _with(schedule: Schedule, rank: int, actions: list[Action]) -> Schedule:
    ranks = list(schedule.actions)
    ranks[rank] = tuple(actions)
    return Schedule(schedule.kind, schedule.num_ranks, schedule.num_microbatches, schedule.virtual_stages,
                    tuple(ranks))


def test_validator_rejects_broken_schedules():
    good = make_schedule("1f1b", 2, 3)
    r1 = list(good.actions[1])  # F0 B0 F1 B1 F2 B2
    with pytest.raises(ScheduleError, match="backward of micro-batch 0 on stage 1 comes before its forward"):
        validate(_with(good, 1, [r1[1], r1[0]] + r1[2:]))
    with pytest.raises(ScheduleError, match="never runs"):
        validate(_with(good, 1, r1[:-1]))
    with pytest.raises(ScheduleError, match="twice"):
        validate(_with(good, 1, r1 + [r1[0]]))
    with pytest.raises(ScheduleError, match="not one of its stages"):
        validate(_with(good, 1, r1 + [Action(FORWARD, 0, 0)]))
    # Rank 0 waits for B0's gradient before sending F1, rank 1 waits for F1 before sending B0: a cycle.
    r0 = [Action(FORWARD, 0, 0), Action(BACKWARD, 0, 0)] + [Action(k, 0, m) for m in (1, 2) for k in "FB"]
    r1 = [Action(FORWARD, 1, 0), Action(FORWARD, 1, 1), Action(BACKWARD, 1, 0)]
    r1 += [Action(BACKWARD, 1, 1), Action(FORWARD, 1, 2), Action(BACKWARD, 1, 2)]
    with pytest.raises(ScheduleError, match="deadlock: rank 0 waits at .*rank 1 waits at"):
        validate(_with(_with(good, 0, r0), 1, r1))
    # Valid dependencies but messages arrive out of order on the channel 0 -> 1 (NCCL would mismatch).
    g = make_schedule("gpipe", 2, 2)
    swapped = [Action(FORWARD, 1, 1), Action(FORWARD, 1, 0), Action(BACKWARD, 1, 0), Action(BACKWARD, 1, 1)]
    with pytest.raises(ScheduleError, match="ranks 0->1: message 0 is sent as activation of micro-batch 0"):
        validate(_with(g, 1, swapped))


def test_bad_shapes_are_config_errors():
    for args, message in [(("interleaved", 4, 6, 2), "M=6, P=4; use M=4 or 8"),
                          (("interleaved", 4, 2, 2), "M=2, P=4; use M=4"),
                          (("1f1b", 4, 8, 2), "virtual_stages=2 needs the interleaved schedule"),
                          (("zb", 4, 8, 1), "'zb' is not one of gpipe, 1f1b, interleaved"),
                          (("gpipe", 4, 0, 1), "num_microbatches=0 must be >= 1")]:
        with pytest.raises(ConfigError, match=message):
            make_schedule(*args)


def test_text_timeline():
    # tf=1, tb=2: rank 1 runs F0 [1,2) B0 [2,4) F1 [4,5) B1 [5,7); rank 0's B0 waits for B0's gradient.
    text = render_text(simulate(make_schedule("1f1b", 2, 2)))
    assert text.splitlines() == ["rank 0: F0F1....B0--..B1--", "rank 1: ..F0B0--F1B1--...."]


def test_cli_prints_actions_bubble_and_memory(capsys, tmp_path):
    png = tmp_path / "t.png"
    assert main(["schedule", "--kind", "1f1b", "--stages", "4", "--microbatches", "8", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "rank 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7" in out
    assert "bubble fraction 3/11 = 27.3%  (theory (P-1)/(M+P-1) = 3/11 = 27.3%)" in out
    assert "max 4  (rank 0: 4, rank 1: 3, rank 2: 2, rank 3: 1)" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["schedule", "--kind", "interleaved", "--stages", "4", "--microbatches", "8", "--virtual", "2"]) == 0
    assert "(theory (P-1)/(V*M+P-1) = 3/19 = 15.8%)" in capsys.readouterr().out


def test_cli_bad_input(capsys):
    assert main(["schedule", "--kind", "interleaved", "--stages", "4", "--microbatches", "6"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: interleaved 1F1B needs num_microbatches a multiple") and err.count("\n") == 1
    assert main(["schedule", "--kind", "interleaved", "--stages", "2", "--microbatches", "2", "--virtual", "1"]) == 2
    assert "needs at least 2 chunks per rank" in capsys.readouterr().err


def _peak_unreleased_sends(schedule: Schedule, rank: int) -> int:
    from raydist.schedule.transfers import send_release_points

    release, live, peak = send_release_points(schedule, rank), set(), 0
    for k, action in enumerate(schedule.actions[rank]):
        live -= set(release.get(k, ()))
        send = schedule.send_of(action)
        if send is not None and not send.local:
            live.add(k)
        peak = max(peak, len(live))
    return peak


def test_sent_tensors_are_released_within_the_memory_bound():
    """The executor frees a sent tensor once a later message proves it was received; for 1F1B at most
    min(P - r, M) + 1 sent tensors are alive on rank r, whatever M (GPipe: M, like its activations)."""
    for p, m in itertools.product(range(2, 9), (1, 3, 8, 24)):
        one_f_one_b, gpipe_s = make_schedule("1f1b", p, m), make_schedule("gpipe", p, m)
        for r in range(p):
            assert _peak_unreleased_sends(one_f_one_b, r) <= min(p - r, m) + 1, (p, m, r)
            if r < p - 1:
                assert _peak_unreleased_sends(gpipe_s, r) == m
