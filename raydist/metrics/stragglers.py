"""Per-rank step times and the straggler rule.

Synchronous training makes every rank's step as long as the slowest one's: the collectives wait. What
differs between ranks is their own work, the *busy* time: the data wait plus the forwards (with DDP the
forward runs no collective; under FSDP and TP its parameter gathers and all-reduces are included, so a
straggler there shows less), or with a pipeline the rank's own actions. Every rank keeps its step and busy
times of a logged interval; at the logged step they are gathered (one small object collective on the host
group) and rank 0 writes, per rank, the p50 / p90 / max of both to the metrics record:

    "ranks": {"step_time_s": {"p50": [per rank], "p90": [...], "max": [...]},
              "busy_s": {"p50": [...], "p90": [...], "max": [...]},
              "busy_spread": max / median of the ranks' busy p50, "slowest": rank}

`StragglerDetector`: a rank whose busy p50 is at least `factor` times the median busy p50 of the other
ranks of its comparison group (the ranks of the same pipeline stage: stages do different work) for
`intervals` logged intervals in a row is a straggler; the event is emitted once per episode (again only
after the rank has recovered and fallen behind again).
"""

from __future__ import annotations

import statistics


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "max": 0.0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {"p50": round(at(0.5), 5), "p90": round(at(0.9), 5), "max": round(ordered[-1], 5)}


def per_rank(gathered: list[dict[str, dict[str, float]]]) -> dict:
    """The metrics record's `ranks` field from every rank's {"step_time_s": pcts, "busy_s": pcts}."""
    out: dict = {}
    for key in ("step_time_s", "busy_s"):
        out[key] = {q: [g[key][q] for g in gathered] for q in ("p50", "p90", "max")}
    busy = out["busy_s"]["p50"]
    median = statistics.median(busy) if busy else 0.0
    out["busy_spread"] = round(max(busy) / median, 3) if busy and median > 0 else None
    out["slowest"] = max(range(len(busy)), key=lambda r: busy[r]) if busy else None
    return out


class StragglerDetector:
    def __init__(self, factor: float, intervals: int, groups: list[list[int]]):
        self.factor, self.intervals, self.groups = factor, intervals, groups
        self.streak: dict[int, int] = {}

    def update(self, busy_p50: list[float]) -> list[dict]:
        """This interval's per-rank busy p50 -> the ranks that just became stragglers."""
        if not self.factor:
            return []
        found = []
        for group in self.groups:
            for rank in group:
                others = [busy_p50[r] for r in group if r != rank and r < len(busy_p50)]
                if not others or rank >= len(busy_p50):
                    continue
                median = statistics.median(others)
                ratio = busy_p50[rank] / median if median > 0 else 0.0
                if ratio >= self.factor:
                    self.streak[rank] = self.streak.get(rank, 0) + 1
                    if self.streak[rank] == self.intervals:
                        found.append({"rank": rank, "ratio": round(ratio, 3), "busy_s": busy_p50[rank],
                                      "median_busy_s": round(median, 5), "intervals": self.intervals})
                else:
                    self.streak[rank] = 0
        return found
