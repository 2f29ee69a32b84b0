"""Zero-bubble schedules (ZB-H1, ZB-V; Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism"): W actions,
the V placement, exact bubbles against the theory, activation memory against 1F1B, validator rejections, CLI."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from raydist.cli import main
from raydist.config import Config, ConfigError
from raydist.schedule import (BACKWARD, FORWARD, WEIGHT, Action, Schedule, ScheduleError, make_schedule, simulate,
                              theoretical_bubble, validate)
from raydist.schedule.timeline import ideal_step_time, render_png, render_text

UNIT = dict(tf=1, tb=2, tw=1)  # F = B = W = 1: a rank's forward, input gradient, weight gradient


def grid():
    """(P, M) the zero-bubble generators accept, M >= P: P in 1..4, M in {P, P + 1, 2P, 3P}."""
    for p in range(1, 5):
        yield from ((p, m) for m in sorted({p, p + 1, 2 * p, 3 * p}))


def test_bubbles_at_unit_costs():
    """P = 4, M = 8, F = B = W: idle per rank 1F1B (P-1)(F+B+W) = 9, ZB-H1 (P-1)(F+B-W) = 3, ZB-V (P-1)F/2."""
    bubbles = {}
    for kind in ("1f1b", "zbh1", "zbv"):
        timeline = simulate(make_schedule(kind, 4, 8), **UNIT)
        assert set(timeline.bubble_per_rank) == {timeline.bubble_fraction}
        assert all(busy == 24 for busy in timeline.busy_per_rank)  # M (F + B + W)
        bubbles[kind] = timeline.bubble_fraction
        assert bubbles[kind] == theoretical_bubble(kind, 4, 8)
    assert bubbles == {"1f1b": Fraction(3, 11), "zbh1": Fraction(1, 9), "zbv": Fraction(1, 17)}
    assert simulate(make_schedule("zbh1", 4, 8)).bubble_fraction == Fraction(1, 9)  # the defaults are F = B = W


def test_zbh1_is_the_papers_figure():
    """Figure 3 (top) of the paper, device 2 of 4 (1-indexed there): W of micro-batch i after B of i + 1."""
    s = make_schedule("zbh1", 4, 8)
    assert s.format().splitlines()[1] == ("rank 1: F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 "
                                          "B7 W6 W7")
    assert s.split_backward and not make_schedule("1f1b", 4, 8).split_backward


@pytest.mark.parametrize("p,m", list(grid()))
def test_valid_exact_bubble_and_memory(p, m):
    base = validate(make_schedule("1f1b", p, m))
    bubble = {}
    for kind in ("zbh1", "zbv"):
        schedule = make_schedule(kind, p, m)
        report = validate(schedule)  # complete, F < B < W, deadlock-free, channel order
        assert schedule.split_backward and schedule.virtual_stages == (2 if kind == "zbv" else 1)
        timeline = simulate(schedule, **UNIT)
        bubble[kind] = timeline.bubble_fraction
        assert timeline.bubble_per_rank == (theoretical_bubble(kind, p, m),) * p
        # Every rank holds P micro-batches of its layers (F to W): the peak over ranks stays 1F1B's min(P, M).
        # Per rank it is P, not 1F1B's P - r: the paper's "all workers keep the same in-flight count".
        assert report.peak_activations_per_rank == (Fraction(p),) * p
        assert report.peak_activations <= base.peak_activations == min(p, m)
    one_f_one_b = simulate(make_schedule("1f1b", p, m), **UNIT).bubble_fraction
    assert bubble["zbv"] <= bubble["zbh1"] <= one_f_one_b
    assert p == 1 or bubble["zbv"] < bubble["zbh1"] < one_f_one_b


def test_documented_range():
    """The range the module docstring states: every P <= 8, M in [P, 5P] is valid, exact and within P."""
    for p in range(1, 9):
        for m in range(p, 5 * p + 1):
            for kind in ("zbh1", "zbv"):
                schedule = make_schedule(kind, p, m)
                assert validate(schedule).peak_activations == p, (kind, p, m)
                assert simulate(schedule).bubble_fraction == theoretical_bubble(kind, p, m), (kind, p, m)


def test_zbh1_step_time_is_the_papers_table_when_w_is_smallest():
    """T = M (F + B + W) + (P - 1)(F + B - W) (paper's Table 2) exactly when W <= F and W <= B."""
    costs = [(tf, tb, tw) for tf in (1, 2, 3) for tb in (1, 2, 3, 4) for tw in map(Fraction, (0, 1, 2, 3)) if tw <= tb]
    for (p, m), (tf, tb, tw) in itertools.product([(2, 2), (3, 4), (4, 8)], costs):
        step = simulate(make_schedule("zbh1", p, m), tf, tb, tw).step_time
        ideal = ideal_step_time("zbh1", p, m, 1, Fraction(tf), Fraction(tb), tw)
        assert (step == ideal) == (tw <= tf and tw <= tb - tw), (p, m, tf, tb, tw)


def test_zbv_is_built_for_the_costs():
    """zbv's greedy order follows the costs; at realistic ones (T_W < T_F < T_B, T_B + T_W = 2 T_F) it stays
    within 1F1B's memory and beats ZB-H1, and it never idles less than the V's unavoidable (P - 1) F / 2."""
    for (p, m), tw in itertools.product([(2, 4), (3, 6), (4, 8), (4, 16)], map(Fraction, ("1/2", "4/5", "1", "6/5"))):
        zbv_s = make_schedule("zbv", p, m, tf=1, tb=2, tw=tw)
        assert validate(zbv_s).peak_activations <= p
        step = simulate(zbv_s, 1, 2, tw).step_time
        assert ideal_step_time("zbv", p, m, 2, Fraction(1), Fraction(2), tw) <= step
        assert step <= simulate(make_schedule("zbh1", p, m), 1, 2, tw).step_time, (p, m, tw)


def test_v_placement():
    s = make_schedule("zbv", 4, 4)
    assert s.placement == "v" and s.num_stages == 8
    assert [s.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [s.rank_of(x) for x in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [s.chunk_of(x) for x in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    local = s.send_of(Action(FORWARD, 3, 0))  # stage 3 -> 4: both on rank 3
    assert local.local and (local.src_rank, local.dst_rank, local.dst_stage) == (3, 3, 4)
    assert s.recv_of(Action(BACKWARD, 3, 1)).local
    back = s.send_of(Action(FORWARD, 6, 2))  # chunk 1 goes back up the ranks: stage 6 (rank 1) -> 7 (rank 0)
    assert (back.src_rank, back.dst_rank, back.dst_stage) == (1, 0, 7)
    assert s.recv_of(Action(BACKWARD, 7, 0)) is None and s.send_of(Action(BACKWARD, 0, 0)) is None
    assert s.recv_of(Action(WEIGHT, 5, 0)) is None and s.send_of(Action(WEIGHT, 5, 0)) is None
    tags = {s.tag(t) for a in itertools.chain(*s.actions) for t in (s.recv_of(a), s.send_of(a)) if t}
    assert len(tags) == 2 * (s.num_stages - 1) * s.num_microbatches
    # Gradient sync: the last weight-gradient action of each chunk is a W (the last B is earlier).
    last_w, last_b = s.last_weight_gradient(0), s.last_backward(0)
    assert {c: a.kind for c, a in last_w.items()} == {0: WEIGHT, 1: WEIGHT} and last_b[0].kind == BACKWARD
    one = make_schedule("1f1b", 2, 2)
    assert one.placement == "loop" and one.last_weight_gradient(0) == one.last_backward(0)


def _replace(schedule: Schedule, rank: int, actions: list[Action], kind: str | None = None) -> Schedule:
    ranks = list(schedule.actions)
    ranks[rank] = tuple(actions)
    return Schedule(kind or schedule.kind, schedule.num_ranks, schedule.num_microbatches, schedule.virtual_stages,
                    tuple(ranks), schedule.placement)


@pytest.mark.parametrize("kind", ["zbh1", "zbv"])
def test_validator_rejects_broken_w(kind):
    good = make_schedule(kind, 3, 4)
    acts = list(good.actions[1])
    first_w = next(i for i, a in enumerate(acts) if a.kind == WEIGHT)
    w = acts[first_w]
    b = acts.index(Action(BACKWARD, w.stage, w.microbatch))
    early = acts[:b] + [w] + [a for a in acts[b:] if a != w]
    with pytest.raises(ScheduleError, match=f"weight gradient .W. of micro-batch {w.microbatch} on stage {w.stage} "
                                            "comes before its input-gradient backward"):
        validate(_replace(good, 1, early))
    with pytest.raises(ScheduleError, match="rank 1 never runs Action\\(kind='W'"):
        validate(_replace(good, 1, [a for a in acts if a != w]))
    with pytest.raises(ScheduleError, match="rank 0 runs Action\\(kind='W'.*which is not one of its stages"):
        validate(_replace(_replace(good, 1, [a for a in acts if a != w]), 0, list(good.actions[0]) + [w]))
    with pytest.raises(ScheduleError, match="twice"):
        validate(_replace(good, 1, acts + [w]))
    no_w = tuple(tuple(a for a in r if a.kind != WEIGHT) for r in good.actions)
    with pytest.raises(ScheduleError, match=f"kind '{kind}' splits the backward .* no W action"):
        validate(Schedule(kind, 3, 4, good.virtual_stages, no_w, good.placement))


def test_w_in_an_unsplit_schedule_and_w_memory():
    one = make_schedule("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="kind '1f1b' does not split the backward .* rank 0 runs Action\\(kind='W'"):
        validate(_replace(one, 0, list(one.actions[0]) + [Action(WEIGHT, 0, 0)]))
    # Activations are held from F until W when the backward is split: delaying the Ws raises the peak.
    f, b, w = (lambda m: Action(FORWARD, 0, m)), (lambda m: Action(BACKWARD, 0, m)), (lambda m: Action(WEIGHT, 0, m))
    eager = Schedule("zbh1", 1, 2, 1, ((f(0), b(0), w(0), f(1), b(1), w(1)),))
    late = Schedule("zbh1", 1, 2, 1, ((f(0), b(0), f(1), b(1), w(0), w(1)),))
    assert validate(eager).peak_activations == 1 and validate(late).peak_activations == 2


def test_bad_shapes_are_config_errors():
    for args, kwargs, message in [(("zbv", 4, 8, 3), {}, "virtual_stages=3: zbv always runs 2 chunks per rank"),
                                  (("zbv", 4, 8, 1), {}, "virtual_stages=1: zbv always runs 2 chunks per rank"),
                                  (("zbh1", 4, 8, 2), {}, "virtual_stages=2 needs the interleaved schedule"),
                                  (("zbh1", 4, 3), {}, "zbh1 needs num_microbatches >= pipeline stages: M=3, P=4; "
                                                       "use M>=4, or the 1f1b schedule"),
                                  (("zbv", 5, 2), {}, "zbv needs num_microbatches >= pipeline stages: M=2, P=5"),
                                  (("zbv", 2, 2), {"tb": 1, "tw": 2}, "zbv costs tf=1, tb=1, tw=2")]:
        with pytest.raises(ConfigError, match=message):
            make_schedule(*args, **kwargs)
    assert make_schedule("zbv", 2, 2, 2).actions == make_schedule("zbv", 2, 2).actions
    with pytest.raises(ConfigError, match="placement 'v' puts exactly 2 chunks on each rank, not virtual_stages=3"):
        Schedule("zbv", 2, 2, 3, ((), ()), "v")
    with pytest.raises(ConfigError, match="placement='ring' is not one of loop, v"):
        Schedule("1f1b", 2, 2, 1, ((), ()), "ring")
    with pytest.raises(ConfigError, match="tw=3 must be between 0 and tb=2"):
        simulate(make_schedule("zbh1", 2, 2), 1, 2, 3)


def test_text_and_png_show_w(tmp_path):
    text = render_text(simulate(make_schedule("zbh1", 2, 2)))
    assert text.splitlines() == ["rank 0: F0F1..B0W0B1W1", "rank 1: ..F0B0F1B1W0W1"]
    odd = render_text(simulate(make_schedule("zbh1", 2, 2), 1, 3))  # W = 3/2: cells of 1/2
    assert odd.splitlines()[1].startswith("rank 1: ....F0--B0--")
    png = tmp_path / "zbv.png"
    render_png(simulate(make_schedule("zbv", 2, 3)), str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_prints_bubbles_and_memory(capsys):
    assert main(["schedule", "--kind", "zbh1", "--stages", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "[valid: complete, forward before B before W, no deadlock, channel order]" in out
    assert "rank 0: F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7" in out
    assert "backward 2 = B 1 (input grad) + W 1 (weight grad)" in out
    assert "bubble fraction 1/9 = 11.1%  (theory (P-1)(F+B-W)/(M(F+B+W)+(P-1)(F+B-W)) = 1/9 = 11.1%)" in out
    assert "(held from F to W): max 4  (rank 0: 4, rank 1: 4, rank 2: 4, rank 3: 4)" in out
    assert "1F1B at the same P, M: max 4  (rank 0: 4, rank 1: 3, rank 2: 2, rank 3: 1); zbh1 peak <= 1F1B's" in out
    assert main(["schedule", "--kind", "zbv", "--stages", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "zbv: P=4 ranks, M=8 micro-batches, V=2 chunks per rank in a V" in out
    assert "bubble fraction 1/17 = 5.9%  (theory (P-1)F/2/(M(F+B+W)+(P-1)F/2) = 1/17 = 5.9%)" in out
    assert "zbv peak <= 1F1B's peak" in out
    assert main(["schedule", "--kind", "1f1b", "--stages", "4", "--microbatches", "8"]) == 0
    assert "bubble fraction 3/11 = 27.3%" in capsys.readouterr().out


def test_cli_bad_input(capsys):
    assert main(["schedule", "--kind", "zbv", "--stages", "4", "--microbatches", "8", "--virtual", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: virtual_stages=3: zbv always runs 2 chunks per rank") and err.count("\n") == 1
    assert main(["schedule", "--kind", "zbh1", "--stages", "4", "--microbatches", "2"]) == 2
    assert "error: zbh1 needs num_microbatches >= pipeline stages: M=2, P=4" in capsys.readouterr().err
    assert main(["schedule", "--kind", "zbh1", "--stages", "2", "--microbatches", "2", "--tw", "3"]) == 2
    assert "error: --tw 3 is more than --tb 2" in capsys.readouterr().err


def test_runtime_layouts_accept_zero_bubble_and_pipelines_with_context_parallelism():
    """What `raydist train` plans: zbh1/zbv need M >= P and a recompute policy that survives two backward
    passes; zbv has two chunks per rank; pipelines compose with context and sequence parallelism."""
    from raydist.planner.policy import plan_layout

    def plan(world, **parallel):
        activation = parallel.pop("activation_checkpoint", None)
        raw = {"model": {"num_layers": 4, "d_model": 64, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden": 128,
                         "vocab_size": 320},
               "data": {"seq_len": 32}, "train": {"global_batch": 8, "micro_batch": 2},
               "parallel": {"dp_replicate": 1, **parallel}}
        if activation:
            raw["train"]["activation_checkpoint"] = activation
        return plan_layout(Config.from_dict(raw), world)

    assert plan(2, pp=2, pp_schedule="zbv").virtual_stages == 2
    assert plan(2, pp=2, pp_schedule="zbh1").stages_of(1) == [1]
    assert plan(2, pp=2, pp_schedule="zbv").stages_of(1) == [1, 2]
    assert plan(8, pp=2, cp=2, tp=2, sequence_parallel=True, cp_impl="ulysses").cp == 2
    with pytest.raises(ConfigError, match=r"pp_schedule='zbh1' needs at least parallel.pp=4 micro-batches, got 2"):
        plan(4, pp=4, pp_schedule="zbh1", num_microbatches=2)
    with pytest.raises(ConfigError, match="activation_checkpoint='selective' keeps its cached tensors"):
        plan(2, pp=2, pp_schedule="zbv", activation_checkpoint="selective")
    assert plan(2, pp=2, pp_schedule="zbv", activation_checkpoint="full").activation_checkpoint == "full"
