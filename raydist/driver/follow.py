"""Following a run directory from the driver: new lines of metrics.jsonl and events.jsonl (and their
per-writer parts) as they are written, for the console's progress and the trackers (raydist.metrics.tracking)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterable

from raydist.store.run_store import RunStore


class Follower:
    """A thread that hands each new metrics record and event of a run to its sinks (`metric(rec)`,
    `event(ev)`, and `close()`, where a sink has one, after a last poll when the block ends; a Tracker has
    none: the launcher ends it with the run's status)."""

    def __init__(self, run_dir: str, sinks: Iterable[Any], interval_s: float = 1.0, name: str = "raydist-follow",
                 from_end: bool = True):
        self.sinks = list(sinks)
        store = RunStore(run_dir)
        # by byte offset on local storage, the per-writer parts read again on object stores
        self.metrics = store.tail("metrics.jsonl", from_end)
        self.events = store.tail("events.jsonl", from_end)
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
