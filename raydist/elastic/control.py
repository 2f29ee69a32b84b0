"""Coordination of a worker group that has idle workers, and a watchdog for hangs.

Ray Train's `report` is a barrier over all workers, so a worker that fits no layout (idle) must report
exactly when the active ones do. Rank 0 publishes each report in the process group's key-value store
(`raydist/ctl/<n>`) and a heartbeat (`raydist/ctl/heartbeat`); idle workers follow the messages and
give up, with an error, if the heartbeat stops for longer than the collective timeout (so a dead rank 0
ends in a restart, not a hang). The store's server lives in rank 0's process: a stopped rank 0 would block
a follower's store call forever, so every call is bounded (raydist.elastic.bounded_store) and a store that does not
answer counts as a silent rank 0.

`Watchdog` ends this process if the current phase of the worker's life (construction, resume, the first
step, a step, evaluation, a save, a report to Ray Train) makes no progress within that phase's limit: a hang
that no collective notices (a stuck read, a deadlocked thread, Ray Train's report barrier waiting for a dead
peer) becomes a worker failure that Ray Train restarts.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
from typing import Any, Callable

import torch.distributed as dist

from raydist.elastic.bounded_store import BoundedStore

PREFIX = "raydist/ctl/"


class ControlChannel:
    def __init__(self, store: dist.Store, rank: int):
        self.store = store
        self.bounded = BoundedStore(store)  # a follower's reads (rank 0, the store's host, writes to itself)
        self.rank = rank
        self.sent = 0

    def publish(self, message: dict[str, Any]) -> None:
        """Rank 0: the next control message ({"kind": "report"|"done", ...})."""
        if self.rank == 0:
            self.store.set(f"{PREFIX}{self.sent}", json.dumps(message))
        self.sent += 1

    def heartbeat(self, step: int) -> None:
        if self.rank == 0:
            self.store.set(f"{PREFIX}heartbeat", f"{step}:{time.time()}")

    def follow(self, on_report: Callable[[dict], None], timeout_s: float, poll_s: float = 5.0) -> None:
        """Idle workers: handle messages until "done"; error if rank 0 goes silent for `timeout_s`."""
        index = 0
        last_beat, last_change = None, time.monotonic()
        while True:
            key = f"{PREFIX}{index}"
            try:
                self.bounded.wait([key], datetime.timedelta(seconds=poll_s))
            except Exception:  # a timeout, or no answer: check that rank 0 is still alive
                if not self.bounded.reachable:  # (a stuck store fails at once: no busy loop)
                    time.sleep(min(poll_s, 1.0))
                beat = self._get(f"{PREFIX}heartbeat")
                if beat != last_beat:
                    last_beat, last_change = beat, time.monotonic()
                elif time.monotonic() - last_change > timeout_s:
                    raise RuntimeError(f"idle worker: no heartbeat from rank 0 for {timeout_s:.0f}s") from None
                continue
            message = json.loads(self.bounded.get(key))
            index += 1
            if message["kind"] == "done":
                return
            on_report(message)

    def _get(self, key: str) -> str | None:
        try:
            self.bounded.wait([key], datetime.timedelta(seconds=0.1))
            return self.bounded.get(key).decode()
        except Exception:
            return None


class Watchdog:
    """Calls `on_hang` (default: exit the process with status 86) when `beat()` stops for the current
    phase's `timeout_s`; `phase(name, timeout_s)` starts a phase (and counts as a beat)."""

    EXIT_CODE = 86

    def __init__(self, timeout_s: float, on_hang: Callable[[], None] | None = None, phase: str = "step"):
        self.timeout_s = timeout_s
        self.name = phase
        self.on_hang = on_hang or self._exit
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="raydist-watchdog")

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def beat(self) -> None:
        self._last = time.monotonic()

    def phase(self, name: str, timeout_s: float) -> None:
        self.name, self.timeout_s = name, timeout_s
        self.beat()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(min(5.0, max(0.05, self.timeout_s / 4))):
            if time.monotonic() - self._last > self.timeout_s:
                self.on_hang()
                return

    def _exit(self) -> None:
        print(f"error: no progress in phase '{self.name}' for {self.timeout_s:.0f}s; ending this worker so the run "
              "restarts", file=sys.stderr, flush=True)
        os._exit(self.EXIT_CODE)
