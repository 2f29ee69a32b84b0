"""The driver's console (raydist.driver.console): fd-level redirection of everything that is not raydist's, the
progress bar on a terminal and lines elsewhere, the lines events become, rounded figures."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

from raydist.driver.console import Console, ProgressSink, describe_event, format_rate, result_line
from raydist.driver.follow import Follower
from raydist.store.run_store import RunStore

REPO = Path(__file__).resolve().parents[2]


def test_quiet_sends_fd_level_output_to_driver_log_and_keeps_raydist_lines(tmp_path):
    """Python prints, warnings and a C-level write to fd 2 (what Ray's C++ core worker does) go to the file;
    the console's own lines stay on the terminal's descriptors; --verbose changes nothing."""
    script = textwrap.dedent(f"""
        import os, sys, warnings
        sys.path.insert(0, {str(REPO)!r})
        from raydist.driver.console import Console
        console = Console(verbose=sys.argv[1] == "verbose")
        with console.quiet({str(tmp_path / 'run')!r}, "run") as logs:
            print("(RayTrainWorker pid=1) noise on stdout")
            warnings.warn("a UserWarning from site-packages")
            os.write(2, b"[E core_worker.cc:1] noise on fd 2\\n")
            console.line("raydist line")
        console.line("after")
    """)
    quiet = subprocess.run([sys.executable, "-c", script, "quiet"], capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout == "raydist line\nafter\n" and quiet.stderr == ""
    log = (tmp_path / "run" / "logs" / "driver.log").read_text()
    assert "noise on stdout" in log and "UserWarning" in log and "core_worker.cc" in log
    loud = subprocess.run([sys.executable, "-c", script, "verbose"], capture_output=True, text=True, timeout=60)
    assert "noise on stdout" in loud.stdout and "core_worker.cc" in loud.stderr and "UserWarning" in loud.stderr


def record(step, **extra):
    return {"step": step, "loss": 2.123456, "tokens_per_s": 12345.678, "step_time_s": 0.5, "world_size": 2,
            "mfu": 0.1234, **extra}


def test_progress_is_a_line_per_step_off_a_terminal_and_a_bar_on_one():
    out = io.StringIO()
    sink = ProgressSink(100, Console(out=out), stream=io.StringIO(), tty=False)
    sink.metric(record(10, val_loss=2.5))
    assert out.getvalue() == ("step 10/100 | loss 2.123 | val 2.500 | 12.3k tok/s | ETA 45s | MFU 12.3% | "
                              "2 workers\n")
    bar_stream = io.StringIO()
    lines = io.StringIO()
    console = Console(out=lines)
    sink = ProgressSink(100, console, stream=bar_stream, tty=True)
    sink.metric(record(10))
    sink.metric(record(20))
    console.line("a raydist line while the bar is up")
    sink.close()
    bar = bar_stream.getvalue()
    assert "20/100" in bar and "loss 2.123" in bar and "12.3k tok/s" in bar and "ETA 40s" in bar
    assert lines.getvalue() == "a raydist line while the bar is up\n"


def test_events_an_operator_should_see_become_lines():
    workers = [{"host": "node-a", "pid": 11}, {"host": "node-a", "pid": 12}]
    assert describe_event({"kind": "start", "step": 0, "world_size": 2, "mesh": {"dp_replicate": 2, "tp": 1},
                           "workers": workers}) == \
        "started 2 workers (dp_replicate 2) at step 0: 2 on node-a (pids 11, 12)"
    hang = describe_event({"kind": "hang", "step": 13, "trigger": "collective timeout after 20s",
                           "culprits": [{"rank": 1, "pid": 12, "host": "node-a", "reason": "no heartbeat for 21s"}],
                           "stacks": "runs/r/logs/hang-20260101-000000"})
    assert hang.startswith("warning: hang at step 13 (collective timeout after 20s): rank 1 (pid 12 on node-a")
    assert "stacks in runs/r/logs/hang-20260101-000000" in hang
    assert describe_event({"kind": "checkpoint", "step": 5}) is None


def test_result_line_rounds():
    line = result_line({"steps": 300, "final_loss": 2.13114187, "first_val_loss": 5.557673096656799,
                        "final_val_loss": 2.131141871213913, "tokens_per_s": 4702.04, "restarts": 1}, "runs/r", 98.6)
    assert line == "done: 300 steps in 1m38s, loss 2.131, val loss 5.558 -> 2.131, 4.7k tok/s, 1 restart; runs/r"
    assert format_rate(999.4) == "999" and format_rate(1.234e6) == "1.23M"


def test_the_follower_hands_each_new_record_once_and_skips_torn_lines(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")  # before the follower: not news
    seen = []

    class Sink:
        def metric(self, rec):
            seen.append(("m", rec["step"]))

        def event(self, ev):
            seen.append(("e", ev["kind"]))

        def close(self):
            seen.append("closed")

    with Follower(str(tmp_path), [Sink()], interval_s=60) as follower:
        with open(tmp_path / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": 1}) + "\n" + '{"step": 2, "lo')  # the second is still being written
        (tmp_path / "events.jsonl").write_text(json.dumps({"kind": "start"}) + "\n{torn\n")
        follower.poll()
        with open(tmp_path / "metrics.jsonl", "a") as f:
            f.write('ss": 1.0}\n')
    assert seen == [("m", 1), ("e", "start"), ("m", 2), "closed"]
    assert [r["step"] for r in RunStore(str(tmp_path)).tail("metrics.jsonl").new()] == [0, 1, 2]
