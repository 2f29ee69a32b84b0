"""Rank 0's bookkeeping writer (raydist.metrics.background): order, coalescing, errors, flush."""

import threading

import pytest

from raydist.metrics.background import BackgroundWriter


def test_jobs_run_in_order_and_keyed_jobs_coalesce():
    writer = BackgroundWriter()
    gate = threading.Event()
    done = []
    writer.submit(gate.wait)  # holds the thread so the jobs below queue up
    writer.submit(lambda: done.append("line 1"))
    for state in range(5):
        writer.submit(lambda state=state: done.append(f"progress {state}"), key="progress")
    writer.submit(lambda: done.append("line 2"))
    gate.set()
    writer.flush()
    # the keyed job kept its first place in the queue and only its newest value ran
    assert done == ["line 1", "progress 4", "line 2"]
    writer.close()


def test_an_error_reaches_the_training_thread_once():
    writer = BackgroundWriter()
    writer.submit(lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError, match="No space left"):
        writer.flush()
    writer.submit(lambda: None)  # the error was reported; the writer goes on
    writer.close()


def test_close_writes_everything_then_refuses_more():
    writer = BackgroundWriter()
    done = []
    for i in range(100):
        writer.submit(lambda i=i: done.append(i))
    writer.close()
    assert done == list(range(100))
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit(lambda: None)
