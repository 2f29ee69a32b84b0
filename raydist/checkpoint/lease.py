"""One driver per run directory: RUN_DIR/lease.json, a lease the driver heartbeats while the run is live.

Two drivers on one run name would train into the same checkpoints and logs. `raydist train` therefore
takes the lease before Ray or any worker starts, renews it every `interval_s` from a thread, and deletes it
when the run ends (also on failure):

    {"pid": 4242, "host": "node-1", "since": 1750000000.0, "heartbeat": 1750000120.0, "run_id": "9f2c..."}

A lease whose heartbeat is younger than `stale_after_s` (3 x interval) is live: a second driver fails
with one `error:` line (exit 2). An older one is what a driver killed without cleanup leaves: it is taken
over with a `warning:` line. Liveness compares the holder's clock with the reader's, so driver hosts'
clocks must agree to well within the stale limit (NTP does).

Two drivers starting at the same moment (the run directory's `RunStore` knows which storage it is on and
provides the local primitives, `create_json_exclusive` and `lock`):
    local storage   the lease is created with exclusive-create semantics (a complete temporary file
                    hard-linked to lease.json: fails if it exists, never shows a partial file), and every
                    read-decide-write step (stale takeover, renewal, release) runs under `flock` on the run
                    directory, so exactly one driver wins. (flock does not span NFS clients: use one host
                    per run directory there, or object storage.)
    object stores   there is no exclusive create: a driver writes its lease, waits `settle_s`, reads it
                    back and holds the lease only if its own run_id is there. The window left: a driver
                    whose read-then-write takes longer than `settle_s` can overwrite a lease another driver
                    has already confirmed; both would then run. With settle_s = 2 s that needs a 2 s stall
                    between two consecutive requests.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from typing import Any, Callable

from raydist.config import ConfigError
from raydist.store.run_store import RunStore

LEASE = "lease.json"
INTERVAL_S = 10.0
STALE_FACTOR = 3.0
SETTLE_S = 2.0


class RunBusyError(ConfigError):
    """Another live driver holds the run's lease."""


def format_time(unix_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix_s))


class RunLease:
    """`with RunLease(run_dir, name): ...` holds RUN_DIR/lease.json for the block (see the module doc)."""

    def __init__(self, run_dir: str, run_name: str | None = None, *, interval_s: float = INTERVAL_S,
                 stale_after_s: float | None = None, settle_s: float = SETTLE_S,
                 log: Callable[[str], None] = print):
        self.run_dir = run_dir
        self.run_name = run_name or run_dir.rstrip("/").rsplit("/", 1)[-1]
        self.store = RunStore(run_dir)
        self.uri = self.store.join(LEASE)
        self.interval_s = interval_s
        self.stale_after_s = stale_after_s if stale_after_s is not None else STALE_FACTOR * interval_s
        self.settle_s = settle_s
        self.log = log
        self.run_id = secrets.token_hex(8)
        self.since = 0.0
        self.held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the lease file ------------------------------------------------------------------------
    def _record(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname(), "since": self.since,
                "heartbeat": time.time(), "run_id": self.run_id}

    def read(self) -> dict[str, Any] | None:
        """The current lease, or None when there is none (an unreadable one reads as None too)."""
        lease = self.store.read_json(LEASE, "a torn lease counts as none")
        return lease if isinstance(lease, dict) else None

    def is_live(self, lease: dict[str, Any], now: float | None = None) -> bool:
        heartbeat = lease.get("heartbeat")
        if not isinstance(heartbeat, (int, float)):
            return False
        return (now or time.time()) - heartbeat < self.stale_after_s

    def busy_error(self, lease: dict[str, Any]) -> RunBusyError:
        since = lease.get("since")
        when = format_time(since) if isinstance(since, (int, float)) else "an unknown time"
        return RunBusyError(f"run {self.run_name} is already running (pid {lease.get('pid')} on "
                            f"{lease.get('host')} since {when}); pick another train.run_name")

    # ---- acquire, renew, release ---------------------------------------------------------------
    def acquire(self) -> "RunLease":
        """Takes the lease or raises RunBusyError; a stale lease is taken over with a warning."""
        self.since = time.time()
        with self.store.lock():
            current = self.read()
            if current is not None and current.get("run_id") != self.run_id:
                if self.is_live(current):
                    raise self.busy_error(current)
                age = time.time() - current.get("heartbeat", 0) if isinstance(current.get("heartbeat"),
                                                                              (int, float)) else float("inf")
                self.log(f"warning: run {self.run_name}: taking over a stale lease (pid {current.get('pid')} on "
                         f"{current.get('host')}, last heartbeat {age:.0f}s ago, the limit is "
                         f"{self.stale_after_s:g}s); that driver is gone or stalled")
            if self.store.local:
                if current is None:
                    if not self.store.create_json_exclusive(LEASE, self._record()):  # one not under our flock (NFS)
                        raise self.busy_error(self.read() or {})
                else:
                    self.store.write_json(LEASE, self._record())
            else:
                self.store.write_json(LEASE, self._record())
                time.sleep(self.settle_s)
                back = self.read()
                if back is None or back.get("run_id") != self.run_id:
                    raise self.busy_error(back or current or {})
        self.held = True
        return self

    def renew(self) -> bool:
        """Writes a new heartbeat if the lease is still this driver's; False (with a warning) if not."""
        with self.store.lock():
            current = self.read()
            if current is None or current.get("run_id") != self.run_id:
                self.held = False
                holder = f"pid {current.get('pid')} on {current.get('host')}" if current else "nobody"
                self.log(f"warning: run {self.run_name}: lost its lease (now held by {holder}); another driver "
                         "may be writing this run directory")
                return False
            self.store.write_json(LEASE, self._record())
        return True

    def release(self) -> None:
        """Deletes the lease if it is still this driver's."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if not self.held:
            return
        self.held = False
        with self.store.lock():
            current = self.read()
            if current is not None and current.get("run_id") == self.run_id:
                self.store.remove(LEASE)

    def start_heartbeat(self) -> None:
        def beat():
            while not self._stop.wait(self.interval_s):
                try:
                    if not self.renew():
                        return
                except Exception as exc:  # a storage hiccup: try again next interval
                    self.log(f"warning: run {self.run_name}: lease heartbeat failed ({exc}); retrying")

        self._thread = threading.Thread(target=beat, daemon=True, name="raydist-lease")
        self._thread.start()

    def __enter__(self) -> "RunLease":
        self.acquire()
        self.start_heartbeat()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.release()
        except Exception as error:  # never hide the run's own outcome behind a cleanup failure
            self.log(f"warning: run {self.run_name}: could not release {LEASE} ({error}); it goes stale in "
                     f"{self.stale_after_s:g}s")
