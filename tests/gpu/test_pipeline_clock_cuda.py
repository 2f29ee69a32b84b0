"""Pipeline action timings on a GPU come from CUDA events, not host clocks: an action that only queues
kernels returns at once on the host, but its events span the kernels' execution.

The CUDA test is skipped without a GPU; the CPU path (perf_counter) runs everywhere."""

from __future__ import annotations

import time

import pytest
import torch

from raydist.schedule.clock import ActionClock


@pytest.mark.cuda
def test_cuda_action_times_are_device_times():
    device = torch.device("cuda")
    a = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize()
    clock = ActionClock(device)
    clock.start_step()
    began = clock.begin()
    host = time.perf_counter()
    for _ in range(20):
        a = a @ a / 64.0  # queued; the host does not wait
    host = time.perf_counter() - host
    clock.end(began, {"kind": "F"})
    times = clock.finish()  # nothing read yet
    busy, rows = times.busy_s, times.rows  # reading waits for the device
    assert rows[0]["kind"] == "F" and rows[0]["end_s"] > rows[0]["start_s"] >= 0
    assert busy == pytest.approx(rows[0]["end_s"] - rows[0]["start_s"], abs=1e-6)
    assert busy > host  # the kernels ran longer than it took the host to queue them


def test_cpu_clock_measures_host_time():
    clock = ActionClock(torch.device("cpu"))
    clock.start_step()
    began = clock.begin()
    time.sleep(0.01)
    clock.end(began, {"kind": "W"})
    times = clock.finish()
    busy, rows = times.busy_s, times.rows
    assert busy >= 0.01 and rows[0]["kind"] == "W"
