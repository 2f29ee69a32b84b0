"""Rank 0's bookkeeping writes (progress.json, metrics and event lines) off the training thread.

Writing progress.json after every step is an fsynced whole-file replace: on a fast step that is a
noticeable share of the step, and on slow storage a stall. The training thread hands each write to one
background thread instead:

- jobs run in submission order (metrics lines stay in step order);
- a job submitted with a `key` replaces a job with the same key that has not started yet (progress.json:
  only the newest state matters, so a slow disk never builds a backlog);
- a job that raises is not lost silently: the error is raised in the training thread at its next
  `submit` or `flush` (a full disk still ends the run, one step later than a synchronous write would);
- `flush()` waits until everything submitted so far is written: called before a checkpoint commits, at
  the end of the run, and on close.

A process that dies between a step and its background write loses at most that one write; the readers
of these files already treat a missing last step (progress.json lagging, a torn last line) as normal.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Hashable


class BackgroundWriter:
    def __init__(self, name: str = "raydist-bookkeeping"):
        self._jobs: collections.OrderedDict[object, Callable[[], None]] = collections.OrderedDict()
        self._cond = threading.Condition()
        self._busy = False
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None], key: Hashable | None = None) -> None:
        """Queue `job`; with `key`, it replaces a queued, not yet started job of the same key (keeping
        that job's place in the order)."""
        with self._cond:
            self._raise_pending()
            if self._closed:
                raise RuntimeError("the bookkeeping writer is closed")
            slot = ("keyed", key) if key is not None else ("once", object())
            self._jobs[slot] = job
            self._cond.notify_all()

    def flush(self) -> None:
        """Returns when every job submitted before the call has run; raises the first error one raised."""
        with self._cond:
            while self._jobs or self._busy:
                self._cond.wait()
            self._raise_pending()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._thread.join()

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return  # closed and drained
                _, job = self._jobs.popitem(last=False)
                self._busy = True
            try:
                job()
            except BaseException as exc:  # handed to the training thread
                with self._cond:
                    if self._error is None:
                        self._error = exc
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
