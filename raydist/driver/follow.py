"""Following a run directory from the driver: new lines of metrics.jsonl and events.jsonl (and their
per-writer parts) as they are written, for the console's progress and the trackers (raydist.metrics.tracking)."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from typing import Any, Iterable

import fsspec

from raydist.metrics.logger import join, read_jsonl
from raydist.store.atomic import is_local



class JsonlTail:
    """The records appended to RUN_DIR/<name> since the last call (by byte offset locally; on object
    stores, the merged per-writer parts read again, skipping what was seen)."""

    def __init__(self, run_dir: str, name: str, from_end: bool = False):
        self.run_dir, self.name = run_dir, name
        self.fs, self.path = fsspec.core.url_to_fs(join(run_dir, name))
        self.local = is_local(self.fs)
        self.offset, self.pending, self.count = 0, b"", 0
        if from_end:  # only what is appended from now on (a resumed run's earlier records are not news)
            if self.local:
                self.offset = os.path.getsize(self.path) if os.path.exists(self.path) else 0
            else:
                self.count = len(read_jsonl(run_dir, name, problems=[]) or [])

    def new(self) -> list[dict[str, Any]]:
        if not self.local:
            records = read_jsonl(self.run_dir, self.name, problems=[]) or []
            out, self.count = records[self.count:], len(records)
            return out
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self.pending + data).split(b"\n")
        self.pending = lines.pop()  # a line still being written
        out = []
        for line in lines:
            try:
                value = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue  # a torn line (see metrics/logger.py): skipped by every reader
            if isinstance(value, dict):
                out.append(value)
        return out


class Follower:
    """A thread that hands each new metrics record and event of a run to its sinks (`metric(rec)`,
    `event(ev)`, and `close()`, where a sink has one, after a last poll when the block ends; a Tracker has
    none: the launcher ends it with the run's status)."""

    def __init__(self, run_dir: str, sinks: Iterable[Any], interval_s: float = 1.0, name: str = "raydist-follow",
                 from_end: bool = True):
        self.sinks = list(sinks)
        self.metrics = JsonlTail(run_dir, "metrics.jsonl", from_end)
        self.events = JsonlTail(run_dir, "events.jsonl", from_end)
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)

    def __enter__(self) -> "Follower":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()
        for sink in self.sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # a slow object store, a torn line: next tick
                pass

    def poll(self) -> None:
        for rec in self.metrics.new():
            for sink in self.sinks:
                sink.metric(rec)
        for ev in self.events.new():
            for sink in self.sinks:
                sink.event(ev)
