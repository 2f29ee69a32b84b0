"""Goodput across restarts: what failures and checkpoints cost, kept in the run directory.

RUN_DIR/progress.json (rank 0 rewrites it after every step on local storage, from its background
bookkeeping thread, and at logged steps on object stores, where each write is a request) remembers the
run's first start, the newest step reached and the time it was reached. A new attempt (a Ray Train restart after a worker or
node loss, a resize, or a rerun of the same run name) that resumes at step r < max_step redoes
max_step - r steps (completed steps; the one in flight when the failure hit is not counted); the time from the failed attempt's last progress until the new attempt is back at
max_step is time lost to the restart (detection, restart, checkpoint load and the redone steps).
Checkpoint stalls are the seconds training waited for staging or for a previous save.

RUN_DIR/events.jsonl gets one line per event: launch (a worker group is up), start, restart, resize,
checkpoint, checkpoint_skipped, worker_error (a worker saw a failure, e.g. a dead peer), replica_lost and
replica_joined (live recovery: a replica left or rejoined the quorum; replica_time_out_s sums the replica-
seconds the run trained without a lost replica, up to the end for one that never came back, counted in
replicas_out_at_end; restarts and steps_redone stay 0), end. Events come
from several writers (rank 0 in `fit`, any rank outside it, each attempt); see raydist.store.run_store for
how their lines stay whole, and `read_events` for the merged, time-ordered view. Every string in an event
is passed through `redact` (a checkpoint path or an error message may hold a storage URI with credentials).

A progress.json that is empty or torn is treated as absent (with a warning): the accounting starts over
from this attempt instead of stopping the run.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from raydist.metrics.logger import MetricsWriter, clean
from raydist.store.redact import redact_tree
from raydist.store.run_store import RunStore

PROGRESS = "progress.json"


class EventLog(MetricsWriter):
    """events.jsonl: {"kind", "time", "elapsed_s", "step", ...}."""

    def __init__(self, run_dir: str, run_start: float, background=None):
        super().__init__(run_dir, name="events.jsonl", background=background)
        self.run_start = run_start

    def event(self, kind: str, step: int | None, **fields: Any) -> dict:
        now = time.time()
        record = redact_tree({"kind": kind, "step": step, "time": round(now, 3),
                              "elapsed_s": round(now - self.run_start, 3), **fields})
        if self.gate is not None and not self.gate():
            return record
        self.write(record)
        return record


def read_events(run_dir: str, problems: list[str] | None = None) -> list[dict[str, Any]]:
    """events.jsonl of every writer, ordered by time (see `RunStore.read_records` for torn lines)."""
    events = RunStore(run_dir).read_records("events.jsonl", problems) or []
    return sorted(events, key=lambda e: e.get("time") or 0.0)


class Goodput:
    def __init__(self, run_dir: str, driver_start: float, background=None):
        self.store = RunStore(run_dir)
        self.background = background  # a BackgroundWriter: the newest state is written off the step
        state = self.store.read_json(PROGRESS, "restart accounting starts over from this attempt")
        state = state if isinstance(state, dict) else {}
        self.state: dict[str, Any] = {
            "run_start_time": driver_start, "attempts": 0, "restarts": 0, "max_step": 0, "last_time": None,
            "steps_redone": 0, "time_lost_restart_s": 0.0, "time_lost_checkpoint_s": 0.0, "recovering": None,
            "replicas_lost": 0, "replica_time_out_s": 0.0, "replicas_out": {},
            **state,
        }
        self.gate: Callable[[], bool] | None = None  # live recovery: only the quorum's rank 0 writes

    @property
    def run_start(self) -> float:
        return self.state["run_start_time"]

    def on_start(self, resumed_step: int) -> dict[str, Any]:
        """Called once per attempt after the checkpoint is loaded; returns what the event should say."""
        s = self.state
        s["attempts"] += 1
        info: dict[str, Any] = {"attempt": s["attempts"]}
        if s["attempts"] > 1:
            s["restarts"] += 1
            redone = max(0, s["max_step"] - resumed_step)
            s["steps_redone"] += redone
            info.update(previous_step=s["max_step"], resumed_step=resumed_step, steps_to_redo=redone)
            if s["last_time"] is not None:
                s["recovering"] = {"since": s["last_time"], "until_step": max(s["max_step"], resumed_step)}
            # a whole-group restart brings every replica back: one still out was out until the last progress
            for since in s["replicas_out"].values():
                s["replica_time_out_s"] += max(0.0, (s["last_time"] or since) - since)
            s["replicas_out"] = {}
        self.save()
        return info

    def on_progress(self, step: int, logged: bool) -> None:
        """After each step; persisted every step on local storage, else only on logged steps."""
        s = self.state
        now = time.time()
        if s["recovering"] is not None and step >= s["recovering"]["until_step"]:
            s["time_lost_restart_s"] += now - s["recovering"]["since"]
            s["recovering"] = None
        s["max_step"] = max(s["max_step"], step)
        s["last_time"] = now
        if self.store.local or logged:  # object stores: every write is a request
            self.save()

    def add_checkpoint_stall(self, seconds: float) -> None:
        self.state["time_lost_checkpoint_s"] += seconds

    def on_replica_lost(self, replica: int) -> None:
        self.state["replicas_lost"] += 1
        self.state["replicas_out"][str(replica)] = time.time()

    def on_replica_joined(self, replica: int, time_out_s: float) -> None:
        """A replica (live recovery) is back after `time_out_s`: replica-seconds the run trained without it."""
        self.state["replica_time_out_s"] += time_out_s
        self.state["replicas_out"].pop(str(replica), None)

    def save(self) -> None:
        if self.gate is not None and not self.gate():
            return
        if self.background is None:
            self.store.write_json(PROGRESS, clean(self.state))
            return
        state = json.loads(json.dumps(self.state))  # a snapshot: the training thread goes on changing it
        self.background.submit(lambda: self.store.write_json(PROGRESS, clean(state)), key=self.store.join(PROGRESS))

    def summary(self, final_step: int, tokens_per_step: int) -> dict[str, Any]:
        s = self.state
        now = time.time()
        wall = now - s["run_start_time"]
        still_out = sum(now - since for since in s["replicas_out"].values())  # lost and never back by the end
        return {
            "restarts": s["restarts"],
            "steps_redone": s["steps_redone"],
            "time_lost_restart_s": round(s["time_lost_restart_s"], 3),
            "time_lost_checkpoint_s": round(s["time_lost_checkpoint_s"], 3),
            "replicas_lost": s["replicas_lost"],
            "replica_time_out_s": round(s["replica_time_out_s"] + still_out, 3),
            "replicas_out_at_end": len(s["replicas_out"]),
            "run_wall_s": round(wall, 3),
            "useful_tokens_per_s": round(final_step * tokens_per_step / max(wall, 1e-9), 2),
        }
