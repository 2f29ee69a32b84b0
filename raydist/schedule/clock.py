"""When each action of a step ran: CUDA events on a GPU, `time.perf_counter` on a CPU.

A GPU runs kernels asynchronously: the host returns from an action once its kernels are queued, so host
clocks around an action measure launch time, not compute, and the idle time of a rank would read as
near-total. On CUDA devices each action is bracketed by a pair of events recorded on the current stream.

Reading an event makes the host wait until the device has reached it, so a step records its events and
reads none: `finish()` returns the step's `StepTimes`, read when first asked (at a logged step, after the
step's loss has been read; by then the device is past the step's events and reading them waits no more),
and the host runs ahead of the GPU on every other step. Times are seconds from the step's start mark.

    clock.start_step(); began = clock.begin(); ...; clock.end(began, info); times = clock.finish()
    times.busy_s, times.wall_s, times.rows      # the first of these reads the events
"""

from __future__ import annotations

import time

import torch


class StepTimes:
    """One step's marks, read on first use: `busy_s` (the sum of the actions' durations), `wall_s` (the
    step's start mark to its `finish`) and `rows` (each action's info with its start_s and end_s). On CUDA
    the first read waits for the step's last event only if the device has not passed it yet (at most one
    host sync); the events are released after it."""

    def __init__(self, cuda: bool, origin, marks: list[tuple[object, object, dict]], stop):
        self._cuda, self._origin, self._marks, self._stop = cuda, origin, marks, stop
        self._values: tuple[float, float, list[dict]] | None = None

    def _since(self, mark) -> float:
        return self._origin.elapsed_time(mark) / 1000.0 if self._cuda else mark - self._origin

    def _read(self) -> tuple[float, float, list[dict]]:
        if self._values is None:
            if self._cuda and not self._stop.query():
                self._stop.synchronize()  # the device is still in this step: the one wait
            busy, rows = 0.0, []
            for begin, end, info in self._marks:
                start_s, end_s = self._since(begin), self._since(end)
                busy += end_s - start_s
                rows.append({**info, "start_s": round(start_s, 6), "end_s": round(end_s, 6)})
            self._values = (busy, self._since(self._stop), rows)
            self._origin = self._marks = self._stop = None
        return self._values

    @property
    def busy_s(self) -> float:
        return self._read()[0]

    @property
    def wall_s(self) -> float:
        return self._read()[1]

    @property
    def rows(self) -> list[dict]:
        return self._read()[2]


class ActionClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[object, object, dict]] = []
        self.origin = None

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start_step(self) -> None:
        self.marks = []
        self.origin = self._now()

    def begin(self):
        return self._now()

    def end(self, begin, info: dict) -> None:
        self.marks.append((begin, self._now(), info))

    def finish(self) -> StepTimes:
        """Ends the step (its wall time stops here) and hands over its marks, unread: no host sync."""
        times = StepTimes(self.cuda, self.origin, self.marks, self._now())
        self.marks, self.origin = [], None
        return times
