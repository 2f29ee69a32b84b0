"""The driver's console: raydist's own lines on the terminal, everything Ray prints in RUN_DIR/logs/.

`raydist train` prints what runs where, one progress bar (tqdm, on a terminal) or one line per logged step
(anywhere else: job logs, pipes), the warnings raydist means (restarts, hangs, stragglers, worker errors)
and the result, with rounded figures. What Ray itself prints goes to files instead (`--verbose` brings it
back to the console):

    RUN_DIR/logs/driver.log    the driver process's own stdout and stderr at the file-descriptor level:
                               Ray's and Ray Train's Python logging, warnings, the C++ core worker's lines
                               (the embedded Ray's raylet and GCS inherit it too)
    RUN_DIR/logs/workers.log   every line Ray streams to the driver from the cluster: the workers'
                               stdout/stderr, Ray Train's controller, raylet warnings, Ray Data's messages

`Console.quiet(run_dir)` does the redirection: fds 1 and 2 point at driver.log for the block, and the
console writes to duplicates of the original descriptors. On object-store run directories the logs are
written locally (~/.cache/raydist/logs/<run>) and copied to RUN_DIR/logs/ when the block ends.

`Follower` tails metrics.jsonl and events.jsonl (incrementally by byte offset on local storage) and hands
each new record to its sinks: the console's `ProgressSink`, and the trackers (raydist.metrics.tracking:
MLflow, W&B, TensorBoard), each Follower in its own thread so a slow tracking server never stalls the console.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any, TextIO

from raydist.store.cache import cache_dir
from raydist.store.run_store import RunStore


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def format_rate(per_s: float | None) -> str:
    """12.3k, 1.25M: three significant figures."""
    if not per_s:
        return "0"
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if per_s >= scale:
            return f"{per_s / scale:.3g}{suffix}"
    return f"{per_s:.3g}"


def _fig(value: Any, digits: int = 3) -> str:
    return "-" if not isinstance(value, (int, float)) else f"{value:.{digits}f}"


class Console:
    """Where raydist's own lines go; `quiet(run_dir)` sends everything else to RUN_DIR/logs/."""

    def __init__(self, verbose: bool = False, out: TextIO | None = None, err: TextIO | None = None):
        self.verbose = verbose
        self._out, self._err = out, err
        self.bar = None  # the live tqdm bar, if any
        self.logs_dir: str | None = None  # where the logs went (a run directory's logs/), once quiet
        self._lock = threading.Lock()

    @property
    def out(self) -> TextIO:
        return self._out or sys.stdout

    @property
    def err(self) -> TextIO:
        return self._err or sys.stderr

    def line(self, text: str) -> None:
        """One line of raydist's own (above the progress bar, when there is one)."""
        with self._lock:
            if self.bar is not None:
                self.bar.clear()
            self.out.write(text + "\n")
            self.out.flush()
            if self.bar is not None:
                self.bar.refresh()

    @contextlib.contextmanager
    def quiet(self, run_dir: str, run_name: str):
        """Fds 1 and 2 -> logs/driver.log for the block; `workers_log` is where Ray's streamed lines go."""
        if self.verbose or not _has_fds():
            yield None
            return
        store = RunStore(run_dir)
        local_logs = store.local_path("logs")  # None on object stores: logs go to a local cache, copied up after
        logs = local_logs or str(cache_dir() / "logs" / run_name)
        os.makedirs(logs, exist_ok=True)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        saved = {fd: os.dup(fd) for fd in (1, 2)}
        out = os.fdopen(os.dup(saved[1]), "w", buffering=1, encoding="utf-8", errors="replace")
        err = os.fdopen(os.dup(saved[2]), "w", buffering=1, encoding="utf-8", errors="replace")
        if hasattr(out, "reconfigure"):
            out.reconfigure(line_buffering=True)
        target = os.open(os.path.join(logs, "driver.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        previous = (self._out, self._err)
        self._out, self._err = _TtyAs(out, saved[1]), _TtyAs(err, saved[2])
        os.dup2(target, 1)
        os.dup2(target, 2)
        os.close(target)
        self.logs_dir = store.join("logs")
        try:
            yield logs
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            self._out, self._err = previous
            out.close()
            err.close()
            if local_logs is None:
                with contextlib.suppress(Exception):  # the run's outcome matters more than its log files
                    store.put_files(logs, "logs")


class _TtyAs:
    """A text stream over a duplicated descriptor that answers isatty() for the original one."""

    def __init__(self, stream: TextIO, fd: int):
        self._stream, self._tty = stream, os.isatty(fd)

    def isatty(self) -> bool:
        return self._tty

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _has_fds() -> bool:
    try:
        sys.stdout.fileno()
        sys.stderr.fileno()
        return True
    except (AttributeError, OSError, ValueError):  # e.g. a test's captured streams
        return False


class RayLogFile:
    """Receives what Ray streams to the driver (log_to_driver) and writes it to a file, one line per line
    with Ray's usual `(Actor pid=..., ip=...)` prefix; installed in place of Ray's console printer."""

    HANDLER = "ray_print_logs"

    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1, encoding="utf-8", errors="replace")
        self.lock = threading.Lock()

    def __call__(self, data: dict) -> None:
        pid = data.get("pid")
        lines = data.get("lines") or []
        if pid == "autoscaler":  # Ray prints only the autoscaler's events, not its periodic status dumps
            try:
                from ray._private.worker import filter_autoscaler_events

                lines = list(filter_autoscaler_events(lines))
            except Exception:
                pass
        if pid in ("raylet", "autoscaler"):
            prefix = f"({pid}) "
        else:
            who = data.get("actor_name") or data.get("task_name") or ""
            prefix = f"({who + ' ' if who else ''}pid={pid}, ip={data.get('ip')}) "
        with self.lock:
            for line in lines:
                self.file.write(prefix + line + "\n")

    def install(self) -> bool:
        """Replaces Ray's printer of streamed logs with this file (False if Ray's internals differ)."""
        try:
            from ray._private import worker as ray_worker

            dispatcher = ray_worker.global_worker_stdstream_dispatcher
            dispatcher.remove_handler(self.HANDLER)
            dispatcher.add_handler(self.HANDLER, self)
            return True
        except Exception:
            return False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            from ray._private import worker as ray_worker

            ray_worker.global_worker_stdstream_dispatcher.remove_handler(self.HANDLER)
        self.file.close()


# ---- following the run directory (tailing metrics and events) lives in follow.py ------------------------


class ProgressSink:
    """The console's view of a run: a tqdm bar on a terminal, a line per logged step elsewhere, and a line
    for each event an operator should know about."""

    def __init__(self, total_steps: int, console: Console, stream: TextIO | None = None, tty: bool | None = None):
        self.total, self.console = total_steps, console
        self.stream = stream or console.err
        self.tty = self.stream.isatty() if tty is None else tty
        self.bar = None
        self.last: dict[str, Any] = {}

    # ---- metrics -------------------------------------------------------------------------------
    def metric(self, rec: dict[str, Any]) -> None:
        self.last = rec
        if self.tty:
            self._bar(rec)
        else:
            self.console.line(self.format(rec))

    def _bar(self, rec: dict[str, Any]) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, file=self.stream, dynamic_ncols=True, leave=True, unit="step",
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} {postfix}", desc="train")
            self.console.bar = self.bar
        self.bar.n = rec.get("step", 0)
        self.bar.set_postfix_str(self.postfix(rec), refresh=False)
        self.bar.refresh()

    def postfix(self, rec: dict[str, Any]) -> str:
        parts = []
        if rec.get("loss") is not None:
            parts.append(f"loss {rec['loss']:.3f}")
        if rec.get("val_loss") is not None:
            parts.append(f"val {rec['val_loss']:.3f}")
        if rec.get("tokens_per_s"):
            parts.append(f"{format_rate(rec['tokens_per_s'])} tok/s")
            if rec.get("step_time_s"):
                parts.append(f"ETA {format_duration(rec['step_time_s'] * max(0, self.total - rec.get('step', 0)))}")
        if rec.get("mfu") is not None:
            parts.append(f"MFU {100 * rec['mfu']:.1f}%")
        parts.append(f"{rec['replicas']} replicas" if rec.get("replicas") else f"{rec.get('world_size')} workers")
        return " | ".join(parts)

    def format(self, rec: dict[str, Any]) -> str:
        return f"step {rec.get('step', 0)}/{self.total} | {self.postfix(rec)}"

    # ---- events --------------------------------------------------------------------------------
    def event(self, ev: dict[str, Any]) -> None:
        line = describe_event(ev)
        if line:
            self.console.line(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.console.bar = None
            self.bar = None


def _where(workers: list[dict] | None) -> str:
    """'2 on host-a (pids 11, 12)' from an event's workers list."""
    by_host: dict[str, list] = {}
    for w in workers or []:
        if isinstance(w, dict):
            by_host.setdefault(str(w.get("host")), []).append(w.get("pid"))
    return "; ".join(f"{len(p)} on {h} (pid{'s' if len(p) > 1 else ''} {', '.join(map(str, p))})"
                     for h, p in by_host.items())


def describe_event(ev: dict[str, Any]) -> str | None:
    """The console line for an event, or None for events only the files need."""
    kind = ev.get("kind")
    mesh = ev.get("mesh") or {}
    degrees = " x ".join(f"{k} {v}" for k, v in mesh.items() if isinstance(v, int) and v > 1) or "1 rank"
    if kind == "start":
        idle = f", {ev['idle_workers']} idle" if ev.get("idle_workers") else ""
        strict = " under strict collectives (NCCL's rules on gloo)" if ev.get("strict_collectives") else ""
        return (f"started {ev.get('world_size')} workers ({degrees}{idle}) at step {ev.get('step')}{strict}: "
                f"{_where(ev.get('workers'))}")
    if kind == "restart":
        return (f"warning: restart {ev.get('attempt', 1) - 1}: resumed at step {ev.get('resumed_step')} "
                f"({ev.get('steps_to_redo', 0)} steps to redo) on {ev.get('world_size')} workers ({degrees}): "
                f"{_where(ev.get('workers'))}")
    if kind == "resize":
        return f"resized: {ev.get('from_world_size')} -> {ev.get('world_size')} workers ({degrees})"
    if kind == "worker_error":
        return f"warning: rank {ev.get('rank')} failed: {ev.get('error', '').splitlines()[0] if ev.get('error') else ''}"
    if kind == "replica_lost":
        return f"warning: replica {ev.get('replica')} lost at step {ev.get('step')}; training goes on with {ev.get('replicas')}"
    if kind == "replica_joined":
        return (f"replica {ev.get('replica')} rejoined at step {ev.get('step')} after {ev.get('time_to_rejoin_s', 0):.0f}s; "
                f"{ev.get('replicas')} replicas")
    if kind == "checkpoint_skipped":
        return f"warning: {ev.get('reason')}"
    if kind == "hang":
        culprits = ", ".join(f"rank {c.get('rank')} (pid {c.get('pid')} on {c.get('host')}: {c.get('reason')})"
                             for c in ev.get("culprits") or []) or "no rank could be named"
        return (f"warning: hang at step {ev.get('step')} ({ev.get('trigger')}): {culprits}; "
                f"stacks in {ev.get('stacks')}; the run restarts")
    if kind == "timeouts":
        enforcer = "" if ev.get("enforced_by") != "watchdog" else ", enforced by the step watchdog"
        return (f"timeouts at step {ev.get('step')}: collectives {ev.get('collective_s', 0):.3g}s, step watchdog "
                f"{ev.get('watchdog_s', 0):.3g}s ({ev.get('factor', 0):g} x the longest step, "
                f"{ev.get('measured_s', 0):.3g}s; floor {ev.get('floor_s', 0):g}s, ceiling "
                f"{ev.get('ceiling_s', 0):g}s{enforcer})")
    if kind == "straggler":
        return (f"warning: straggler: rank {ev.get('rank')} (pid {ev.get('pid')} on {ev.get('host')}) is "
                f"{ev.get('ratio', 0):.2f}x the median rank's busy time for {ev.get('intervals')} logged intervals "
                f"({ev.get('busy_s', 0) * 1e3:.0f} ms vs {ev.get('median_busy_s', 0) * 1e3:.0f} ms per step)")
    return None


def result_line(summary: dict[str, Any], run_dir: str, wall_s: float) -> str:
    """The last line of `raydist train`: rounded figures."""
    parts = [f"done: {summary.get('steps')} steps in {format_duration(wall_s)}"]
    if summary.get("final_loss") is not None:
        parts.append(f"loss {_fig(summary.get('final_loss'))}")
    if summary.get("first_val_loss") is not None or summary.get("final_val_loss") is not None:
        parts.append(f"val loss {_fig(summary.get('first_val_loss'))} -> {_fig(summary.get('final_val_loss'))}")
    if summary.get("tokens_per_s"):
        parts.append(f"{format_rate(summary['tokens_per_s'])} tok/s")
    if summary.get("restarts"):
        parts.append(f"{summary['restarts']} restart{'s' if summary['restarts'] > 1 else ''}")
    return ", ".join(parts) + f"; {run_dir}"
