"""Which failures a restart can fix, and how a run ends at once on one that it cannot.

Transient: a peer died or hung (connection reset, collective timeout), a node went away, a storage request
failed. Ray Train restarts the worker group and training resumes from the newest checkpoint.

Deterministic: bad input the driver could not see (a config relation checked in the worker, a corrupt or
incompatible checkpoint, a missing data file, a crafted checkpoint metadata), or a shape mismatch: the
next attempt would fail the same way, `max_failures` times (forever with -1). A worker that raises one
records it in RUN_DIR/fatal.json before raising; every worker of the next attempt finds the record and
returns at once, and the driver ends the run with the recorded message (`error: ...`, exit status 2), so a
deterministic failure costs one restart, not `max_failures` of them.
"""

from __future__ import annotations

import errno
import pickle
import time
from typing import Any

from raydist.errors import ConfigError, wrapped
from raydist.store.run_store import RunStore

FATAL = "fatal.json"

# Message fragments of deterministic RuntimeErrors raised by torch (DCP load into a differently shaped model)
DETERMINISTIC_MESSAGES = ("size mismatch", "shape mismatch", "Missing key", "Unexpected key")


class DeterministicFailure(ConfigError):
    """A worker failed in a way no restart fixes; the message is the worker's first line."""


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_deterministic(exc: BaseException) -> bool:
    from raydist.errors import DataError

    for e in _chain(exc):
        if isinstance(e, (ConfigError, DataError, pickle.UnpicklingError, FileNotFoundError, NotADirectoryError,
                          IsADirectoryError)):
            return True
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EROFS, errno.EACCES):
            return True  # full or read-only storage: a restart writes to the same place
        if isinstance(e, (RuntimeError, ValueError)) and any(m in str(e) for m in DETERMINISTIC_MESSAGES):
            return True
    return False


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def record(run_dir: str, exc: BaseException, rank: int) -> None:
    """Rank `rank` failed deterministically: say so for the next attempt and the driver."""
    RunStore(run_dir).write_json(FATAL, {"error": first_line(exc), "type": type(exc).__name__,
                                         "rank": rank, "time": time.time()})


def recorded(run_dir: str, since: float) -> dict[str, Any] | None:
    """The fatal record written after `since` (the driver's start: an older one belongs to an earlier run
    of this name), or None."""
    fatal = RunStore(run_dir).read_json(FATAL)
    if isinstance(fatal, dict) and fatal.get("time", 0) >= since:
        return fatal
    return None


def training_failure(exc: BaseException) -> BaseException | None:
    """A worker's ConfigError/DataError (raised inside Ray) surfaced as itself; other training failures
    (Ray Train's, a worker's) as a one-line RuntimeError; None for anything else."""
    from raydist.errors import DataError

    for e in wrapped(exc, _worker_failures):
        if isinstance(e, (ConfigError, DataError)):
            return e
    name = type(exc).__name__
    if "Training" in name or "RayTaskError" in name or "ActorDiedError" in name:
        return RuntimeError(f"training failed ({name}): {first_line(exc)}")
    return None


def _worker_failures(e: BaseException) -> list:
    """Ray Train's WorkerGroupError holds each failed worker's exception by rank."""
    failures = getattr(e, "worker_failures", None)
    return list(failures.values()) if isinstance(failures, dict) else []


def describe(exc: BaseException) -> str:
    """One line for the run's record of how it ended."""
    failure = training_failure(exc)
    return first_line(failure) if failure is not None else f"{type(exc).__name__}: {first_line(exc)}"
