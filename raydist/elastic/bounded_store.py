"""A key-value store whose every call returns within a deadline, whatever the store's server does.

A `torch.distributed.TCPStore` client blocks for as long as its server is stopped: with the server's process
under SIGSTOP its socket stays open and the kernel accepts the request, so `check`, `get`, `add` and `wait`
wait for an answer that never comes, whatever timeout the client was built with (measured with torch 2.13:
still blocked after 20 s with a 3 s client timeout; `set` returns at once, its bytes buffered). Under Ray
Train the rendezvous store's server runs inside rank 0's process, which may be the very process that hangs.
`BoundedStore` runs each call in a daemon thread and waits for it at most `timeout_s`: a call that has not
returned by then raises `StoreUnreachable`, and so does every later call while it is still stuck (they
would queue behind it in the client), so a stopped server costs one timeout, then nothing. When the
server answers again the stuck call returns and the store is usable again. Each outage (first failure to
the next success, wall-clock times) is kept: a rank's beats missed during one are not evidence against it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

STORE_TIMEOUT_S = 5.0


class StoreUnreachable(RuntimeError):
    pass


class BoundedStore:
    def __init__(self, store: Any, timeout_s: float = STORE_TIMEOUT_S):
        self.store, self.timeout_s = store, timeout_s
        self.down_since: float | None = None  # time.time() of the first failure of the current outage
        self.outages: list[tuple[float, float]] = []  # earlier outages, (first failure, next success)
        self._stuck: threading.Thread | None = None
        self._stuck_since = 0.0
        self._lock = threading.Lock()

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        timeout = self.timeout_s if timeout_s is None else max(0.0, timeout_s)
        with self._lock:
            stuck = self._stuck if self._stuck is not None and self._stuck.is_alive() else None
        if stuck is not None:
            self._failed()
            raise StoreUnreachable(f"the store has not answered a call for {time.monotonic() - self._stuck_since:.0f}s")
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["value"] = getattr(self.store, method)(*args)
            except BaseException as exc:  # handed to the caller
                box["error"] = exc
            finally:
                done.set()

        thread = threading.Thread(target=run, daemon=True, name=f"raydist-store-{method}")
        thread.start()
        if not done.wait(timeout):
            with self._lock:
                if self._stuck is None or not self._stuck.is_alive():
                    self._stuck, self._stuck_since = thread, time.monotonic() - timeout
            self._failed()
            raise StoreUnreachable(f"store.{method} did not return within {timeout:.1f}s")
        if "error" in box:  # a wait or get that timed out is an answer; a broken connection is not
            if "timeout" not in str(box["error"]).lower() and "timed out" not in str(box["error"]).lower():
                self._failed()
            raise box["error"]
        self._answered()
        return box["value"]

    @property
    def reachable(self) -> bool:
        return self.down_since is None

    def _failed(self) -> None:
        if self.down_since is None:
            self.down_since = time.time()

    def _answered(self) -> None:
        if self.down_since is not None:
            self.outages = (self.outages + [(self.down_since, time.time())])[-8:]
            self.down_since = None

    def outages_until(self, now: float) -> list[tuple[float, float]]:
        """Every outage, the current one ending `now`."""
        return self.outages + ([(self.down_since, now)] if self.down_since is not None else [])

    # the calls raydist makes, each bounded
    def set(self, key: str, value: str, timeout_s: float | None = None) -> None:
        self.call("set", key, value, timeout_s=timeout_s)

    def get(self, key: str, timeout_s: float | None = None) -> bytes:
        return self.call("get", key, timeout_s=timeout_s)

    def check(self, keys: list[str], timeout_s: float | None = None) -> bool:
        return bool(self.call("check", keys, timeout_s=timeout_s))

    def add(self, key: str, amount: int, timeout_s: float | None = None) -> int:
        return int(self.call("add", key, amount, timeout_s=timeout_s))

    def multi_get(self, keys: list[str], timeout_s: float | None = None) -> list[bytes]:
        if hasattr(self.store, "multi_get"):
            return list(self.call("multi_get", keys, timeout_s=timeout_s))
        return [self.get(k, timeout_s=timeout_s) for k in keys]

    def wait(self, keys: list[str], wait_timeout) -> None:
        """store.wait(keys, wait_timeout) (which raises when the keys do not appear in time), given the
        store's timeout beyond its own to answer."""
        self.call("wait", keys, wait_timeout, timeout_s=wait_timeout.total_seconds() + self.timeout_s)
