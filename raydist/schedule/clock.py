"""When each pipeline action ran: CUDA events on a GPU, `time.perf_counter` on a CPU.

A GPU runs kernels asynchronously: the host returns from an action once its kernels are queued, so host
clocks around an action measure launch time, not compute, and the idle time of a rank would read as
near-total. On CUDA devices each action is bracketed by a pair of events recorded on the current stream,
and the events are read once, after one synchronisation at the step's end (reading them earlier would
stall the pipeline). Times are seconds from the step's start event.
"""

from __future__ import annotations

import time

import torch


class ActionClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[object, object, dict]] = []

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

    def finish(self) -> tuple[float, list[dict]]:
        """(busy seconds: the sum of the actions' durations, [info + start_s / end_s per action]); on CUDA
        this synchronises the device once."""
        if self.cuda:
            torch.cuda.synchronize()

            def since(mark) -> float:
                return self.origin.elapsed_time(mark) / 1000.0
        else:
            def since(mark) -> float:
                return mark - self.origin
        busy, rows = 0.0, []
        for begin, end, info in self.marks:
            start_s, end_s = since(begin), since(end)
            busy += end_s - start_s
            rows.append({**info, "start_s": round(start_s, 6), "end_s": round(end_s, 6)})
        self.marks = []
        return busy, rows
