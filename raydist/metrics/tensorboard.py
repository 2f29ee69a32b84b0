"""TensorBoard event files for a run: RUN_DIR/tensorboard/, one scalar per numeric metric per logged step.

Written by the driver, like every tracker (raydist.metrics.tracking): `TensorBoardTracker` is handed each
metrics.jsonl record and events.jsonl event by the driver's Follower; workers write no event files.
Event files are written by `torch.utils.tensorboard.SummaryWriter` (needs the `tensorboard` package).
SummaryWriter writes to local files only, so for an fsspec run directory (s3://, gs://, ...) it writes to
a local temporary directory and copies the files up on `flush()` (with each committed checkpoint) and
`close()`; an event file is append-only, so copying the whole file again each time is correct.

    tb = TensorBoardTracker(run_dir, log); tb.start()   # a warning line when tensorboard is not installed
    tb.metric(record); tb.event({"kind": "restart", "step": 30, ...}); tb.end("FINISHED", summary)
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any, Callable

from raydist.metrics.tracking import Guard
from raydist.store.run_store import RunStore

SCALARS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "data_wait_s", "mfu",
           "mem_peak_mb", "world_size", "tokens")
EVENT_CODES = {"start": 0, "restart": 1, "resize": 2, "checkpoint": 3, "checkpoint_failed": 4, "end": 5, "hang": 6,
               "straggler": 7}


class TensorBoardWriter:
    """Scalars `train/<key>` for each numeric field of a record, at global step record['step']."""

    def __init__(self, run_dir: str, subdir: str = "tensorboard"):
        from torch.utils.tensorboard import SummaryWriter

        self.store, self.subdir = RunStore(run_dir), subdir
        self.target = self.store.join(subdir)
        self.local = self.store.local
        if self.local:
            self.store.makedirs(subdir)
            self.log_dir = self.store.local_path(subdir)
        else:
            self.log_dir = tempfile.mkdtemp(prefix="raydist-tb-")
        self.writer = SummaryWriter(log_dir=self.log_dir)

    def write(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        for key in SCALARS:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"train/{key}", value, step)
        for rank, value in enumerate(record.get("mem_peak_mb_per_rank") or []):
            if isinstance(value, (int, float)):
                self.writer.add_scalar(f"memory/peak_mb_rank{rank}", value, step)
        spread = (record.get("ranks") or {}).get("busy_spread")
        if isinstance(spread, (int, float)):
            self.writer.add_scalar("ranks/busy_spread", spread, step)
        pipeline = record.get("pipeline") or {}
        if isinstance(pipeline.get("bubble"), (int, float)):
            self.writer.add_scalar("pipeline/bubble", pipeline["bubble"], step)
        for stage, value in enumerate(pipeline.get("busy_s") or []):
            self.writer.add_scalar(f"pipeline/busy_s_stage{stage}", value, step)

    def event(self, event: dict[str, Any]) -> None:
        """A restart / resize / checkpoint as a scalar (its kind's code) and a text line, at its step."""
        kind = event.get("kind", "")
        step = int(event.get("step") or 0)
        self.writer.add_scalar(f"events/{kind}", EVENT_CODES.get(kind, -1), step)
        details = ", ".join(f"{k}={v}" for k, v in event.items() if k != "kind")
        self.writer.add_text("events", f"{kind}: {details}", step)

    def flush(self) -> None:
        self.writer.flush()
        if not self.local:
            self.store.put_files(self.log_dir, self.subdir)

    def close(self) -> None:
        self.writer.close()
        if not self.local:
            self.store.put_files(self.log_dir, self.subdir)
            shutil.rmtree(self.log_dir, ignore_errors=True)


class TensorBoardTracker:
    """RUN_DIR/tensorboard/ as a Tracker: the driver's Follower writes each record and event."""

    def __init__(self, run_dir: str, log: Callable[[str], None] = print):
        self.run_dir, self.log = run_dir, log
        self.writer: TensorBoardWriter | None = None
        self.guard = Guard("TensorBoard", log)

    def start(self) -> None:
        try:
            self.writer = TensorBoardWriter(self.run_dir)
        except ImportError:
            self.log("warning: tensorboard is not installed: no event files in RUN_DIR/tensorboard/ "
                     "(pip install tensorboard)")

    def metric(self, record: dict[str, Any]) -> None:
        if self.writer is not None:
            self.guard(f"step {record.get('step')}'s scalars", lambda: self.writer.write(record))

    def event(self, event: dict[str, Any]) -> None:
        if self.writer is None:
            return
        self.guard(f"the {event.get('kind')} event", lambda: self.writer.event(event))
        if event.get("kind") == "checkpoint":  # object stores: copy the event files up with each checkpoint
            self.guard("the event files", self.writer.flush)

    def end(self, status: str, summary: dict[str, Any]) -> None:
        if self.writer is not None:
            self.guard("the event files", self.writer.close)
