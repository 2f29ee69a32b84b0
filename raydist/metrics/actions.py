"""What this process is doing now: its current action (a string, or a tuple formatted when published),
since when, and at which step. The training step, the pipeline executor and the Ray session mark their
actions here; the hang monitor's heartbeat (raydist.elastic.hang.heartbeat) publishes the record and reads
the peers'."""

from __future__ import annotations

import contextlib
import time
from typing import Any


class Actions:
    """This process's current action: `what` (a string, or a tuple formatted when published), since when,
    and the step. `doing(what)` nests: on normal exit the outer action comes back; on an exception the
    record stays where the failure happened (what a diagnosis wants to read)."""

    def __init__(self):
        self.what: Any = "starting"
        self.since = time.time()
        self.step: int | None = None

    def enter(self, what: Any) -> tuple[Any, float]:
        previous = (self.what, self.since)
        self.what, self.since = what, time.time()
        return previous

    @contextlib.contextmanager
    def doing(self, what: Any):
        previous = self.enter(what)
        yield
        self.what, self.since = previous

    def describe(self) -> str:
        return describe(self.what)

    def record(self) -> dict[str, Any]:
        return {"step": self.step, "action": self.describe(), "since": round(self.since, 3)}


def describe(what: Any) -> str:
    if isinstance(what, tuple):
        return " ".join(str(part) for part in what if part is not None and part != "")
    return str(what)


ACTIONS = Actions()
doing = ACTIONS.doing
