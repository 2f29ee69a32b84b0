"""Stragglers: per-rank step and busy time percentiles in metrics.jsonl, and a `straggler` event naming the
rank that is persistently slower than the others (its forwards are slowed on purpose)."""

from __future__ import annotations

import json

from raydist.metrics.stragglers import StragglerDetector, per_rank, percentiles
from raydist.testing import run_fit, tiny_config


def test_percentiles_and_the_rule():
    assert percentiles([0.3, 0.1, 0.2, 0.4, 0.5]) == {"p50": 0.3, "p90": 0.5, "max": 0.5}
    ranks = per_rank([{"step_time_s": percentiles([1.0]), "busy_s": percentiles([0.1])},
                      {"step_time_s": percentiles([1.0]), "busy_s": percentiles([0.3])},
                      {"step_time_s": percentiles([1.0]), "busy_s": percentiles([0.1])}])
    assert ranks["busy_s"]["p50"] == [0.1, 0.3, 0.1] and ranks["slowest"] == 1 and ranks["busy_spread"] == 3.0
    detector = StragglerDetector(factor=1.5, intervals=2, groups=[[0, 1, 2, 3]])
    slow = [0.1, 0.1, 0.2, 0.1]
    assert detector.update(slow) == []  # once is not persistent
    [found] = detector.update(slow)
    assert found["rank"] == 2 and found["ratio"] == 2.0 and found["median_busy_s"] == 0.1
    assert detector.update(slow) == []  # one event per episode
    assert detector.update([0.1] * 4) == [] and detector.update(slow) == []
    assert detector.update(slow)[0]["rank"] == 2  # fell behind again
    # pipeline stages do different work: ranks are compared within their stage only
    staged = StragglerDetector(factor=1.5, intervals=1, groups=[[0, 1], [2, 3]])
    assert staged.update([0.1, 0.1, 0.5, 0.5]) == []
    assert StragglerDetector(factor=0, intervals=1, groups=[[0, 1]]).update([0.1, 9.0]) == []


def test_a_slow_rank_gets_a_straggler_event(tiny_data, tmp_path):
    raw = tiny_config(tiny_data, train={"steps": 8, "log_every": 2}, monitor={"straggler_intervals": 2},
                      parallel={"dp_replicate": 2})
    run_dir = tmp_path / "run"
    run_fit(raw, 2, str(run_dir), imports=("slow_rank",))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if r["step"] > 0]
    for r in trained:
        ranks = r["ranks"]
        assert set(ranks["step_time_s"]) == {"p50", "p90", "max"} and len(ranks["busy_s"]["p50"]) == 2
        assert ranks["busy_s"]["p50"][1] > 1.5 * ranks["busy_s"]["p50"][0] and ranks["slowest"] == 1
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    start = next(e for e in events if e["kind"] == "start")
    stragglers = [e for e in events if e["kind"] == "straggler"]
    assert len(stragglers) == 1, stragglers
    [s] = stragglers
    assert (s["rank"], s["pid"], s["host"]) == (1, start["workers"][1]["pid"], start["workers"][1]["host"])
    assert s["step"] == 4 and s["ratio"] >= 1.5 and s["intervals"] == 2 and s["factor"] == 1.5
