"""Read a run directory (local path or fsspec URI) into plain Python for the report.

Files (all optional but metrics.jsonl; absent or unreadable ones become empty; JSON-lines files are
merged with their per-writer parts on object stores, see raydist.metrics.logger):
    config.toml              the resolved config (shown verbatim)
    metrics.jsonl            one JSON object per logged step (raydist.training.loop.RunLogger)
    summary.json             the run's summary; goodput fields when the elasticity work writes them
    events.jsonl             {"kind": start|restart|resize|checkpoint|checkpoint_failed|end, "step", "elapsed_s",
                             "time", ...} one per line
    pipeline_timeline.json   [{"rank", "stage", "chunk", "kind": "F"|"B", "microbatch", "start_s", "end_s"}, ...]
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from raydist.errors import ConfigError
from raydist.store.run_store import RunStore

EVENT_KINDS = ("start", "restart", "resize", "checkpoint", "checkpoint_failed", "end")


def format_value(value) -> str:
    """A number or field as the report prints it (4 significant digits; n/a for missing)."""
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


@dataclass
class RunData:
    run_dir: str
    config_text: str = ""
    metrics: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.run_dir.rstrip("/").rsplit("/", 1)[-1]

    def train_records(self) -> list[dict]:
        """Records of training steps (those with a step time), in file order."""
        return [r for r in self.metrics if r.get("step_time_s") is not None]

    def events_of(self, *kinds: str) -> list[dict]:
        return [e for e in self.events if e.get("kind") in kinds]

    def latest(self, key: str) -> dict | None:
        for record in reversed(self.metrics):
            if record.get(key) is not None:
                return record
        return None


def _read_text(store: RunStore, name: str) -> str | None:
    try:
        return store.read_text(name)
    except FileNotFoundError:
        return None


def load_run(run_dir: str) -> RunData:
    store = RunStore(run_dir)
    if not store.exists() or not store.isdir():
        raise ConfigError(f"run directory {run_dir!r} not found; pass <checkpoint.storage>/<train.run_name>")
    data = RunData(run_dir)
    metrics = store.read_records("metrics.jsonl", data.warnings)  # merged with per-writer parts
    if metrics is None:
        raise ConfigError(f"{run_dir!r} has no metrics.jsonl; is it a raydist run directory?")
    data.metrics = metrics
    data.config_text = _read_text(store, "config.toml") or ""
    summary = _read_text(store, "summary.json")
    if summary:
        try:
            data.summary = json.loads(summary)
        except json.JSONDecodeError:
            data.warnings.append("summary.json: not JSON, ignored")
    events = store.read_records("events.jsonl", data.warnings)
    if events:
        data.events = sorted(events, key=lambda e: (e.get("elapsed_s") or 0.0))
    timeline = _read_text(store, "pipeline_timeline.json")
    if timeline:
        try:
            value = json.loads(timeline)
            data.timeline = [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []
        except json.JSONDecodeError:
            data.warnings.append("pipeline_timeline.json: not JSON, ignored")
    return data


def goodput(data: RunData) -> dict[str, Any]:
    """The goodput summary: summary.json's fields where written, else what the events and metrics show."""
    s = data.summary
    restarts = data.events_of("restart")
    checkpoints = data.events_of("checkpoint")
    out: dict[str, Any] = {
        "status": s.get("status", "running" if not data.events_of("end") else "ended"),
        "steps": s.get("steps", max((r.get("step", 0) for r in data.metrics), default=0)),
        "elapsed_s": s.get("elapsed_s", max((r.get("elapsed_s") or 0 for r in data.metrics), default=0)),
        "restarts": s.get("restarts", len(restarts)),
        "resizes": len(data.events_of("resize")),
        "checkpoints": len(checkpoints),
        "checkpoints_failed": len(data.events_of("checkpoint_failed")),
        "steps_redone": s.get("steps_redone", _steps_redone(data)),
        "time_lost_restart_s": s.get("time_lost_restart_s"),
        "time_lost_checkpoint_s": s.get("time_lost_checkpoint_s"),
        "tokens_per_s": s.get("tokens_per_s"),
        "useful_tokens_per_s": s.get("useful_tokens_per_s"),
        "mfu": s.get("mfu", (data.latest("mfu") or {}).get("mfu")),
        "first_val_loss": s.get("first_val_loss"),
        "final_val_loss": s.get("final_val_loss", (data.latest("val_loss") or {}).get("val_loss")),
    }
    return out


def _steps_redone(data: RunData) -> int:
    """Steps trained twice: for each restart, the furthest step logged before it minus the step it
    resumed from (the event's `step`)."""
    redone = 0
    for event in data.events_of("restart"):
        before = [r.get("step", 0) for r in data.metrics if (r.get("elapsed_s") or 0) < (event.get("elapsed_s") or 0)]
        if before and event.get("step") is not None:
            redone += max(0, max(before) - int(event["step"]))
    return redone
