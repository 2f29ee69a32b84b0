"""metrics.jsonl and events.jsonl writers: JSON lines in the run directory, appended through
`raydist.store.run_store.RunStore` (which says how appends stay whole with several writers, locally and on
object stores, and how readers skip a torn last line).

A writer serialises each record when it is logged (NaN and infinities as null) and appends the line on
the caller's thread or, with a `BackgroundWriter`, off it; with a `gate` only the process the gate names
writes (live recovery: the quorum's rank 0).
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

from raydist.store.run_store import RunStore


def clean(value: Any) -> Any:
    """`value` with NaN and infinite floats (in it and in nested dicts) as None: JSON has no NaN."""
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    return value


class MetricsWriter:
    """Appends JSON lines to RUN_DIR/<name> (one `RunStore` appender: see raydist.store.run_store)."""

    def __init__(self, run_dir: str, name: str = "metrics.jsonl", background=None):
        self.store = RunStore(run_dir)
        self.appender = self.store.appender(name)
        self.background = background  # a BackgroundWriter (metrics/background.py): writes leave the caller
        # live recovery: every replica keeps the bookkeeping, only the one the gate names (the quorum's
        # rank 0, which may change during the run) writes it
        self.gate: Callable[[], bool] | None = None

    def write(self, record: dict[str, Any]) -> None:
        if self.gate is not None and not self.gate():
            return
        line = json.dumps(clean(record), sort_keys=False)  # serialised now: the record may change later
        if self.background is not None:
            self.background.submit(lambda: self.appender.append_line(line))
        else:
            self.appender.append_line(line)


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    return RunStore(run_dir).read_records("metrics.jsonl") or []
