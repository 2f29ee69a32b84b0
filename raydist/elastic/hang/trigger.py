"""What starts a hang diagnosis (raydist.elastic.hang.diagnosis), and the timeout the process groups get so
that it can.

On gloo a collective that waits too long raises: `is_hang` tells that exception (a timeout) from others, and
the session diagnoses. On NCCL, and under the strict-collectives mode (raydist.strict), collectives never
raise in Python: the group's watchdog aborts the process. There (`watched`) the hang monitor's heartbeat
watches this rank's in-flight collectives and, when one has waited longer than
`elastic.collective_timeout_s`, calls `on_stuck(op)` once: the session diagnoses and ends the worker before
the group's own timeout (`group_timeout_s`) would abort the process without a word. The step watchdog
(raydist.elastic.control.Watchdog) triggers a diagnosis too.
"""

from __future__ import annotations

import threading

from raydist import strict

from raydist.elastic import inflight

DIAGNOSE_BUDGET_S = 45.0  # the whole diagnosis, from the trigger to the failure going on
EXIT_MARGIN_S = 10.0  # after the budget, before a group's own timeout may end the process

WATCHING = threading.Event()  # set while a hang monitor of this process watches its in-flight collectives


def watched(backend: str) -> bool:
    """Whether raydist's monitor, not the process group, ends a collective that waits too long on `backend`
    (a group's backend name, e.g. dist.get_backend()): NCCL, whose collectives never raise in Python (its
    watchdog aborts the process), and the strict-collectives mode's, whose collectives end the process the
    same way (raydist.strict). gloo raises at its timeout."""
    return "nccl" in str(backend) or strict.BACKEND in str(backend)


def group_timeout_s(collective_timeout_s: float, backend: str, interval_s: float = 2.0,
                    monitored: bool | None = None) -> float:
    """The timeout to give process groups of `backend`. Where a monitor watches (`watched`, and `monitored`:
    by default whether one runs in this process), it sees an op pending longer than `collective_timeout_s`
    at its next poll (`inflight.poll_s`, plus one heartbeat of jitter), diagnoses within DIAGNOSE_BUDGET_S
    and ends the worker: the group's own timeout (NCCL's watchdog abort) must come after all that, or the
    process dies without naming anyone. Elsewhere (gloo, or no monitor: spawn, tests) the group's own
    timeout is `collective_timeout_s`: gloo raises, NCCL and the strict mode abort."""
    monitored = WATCHING.is_set() if monitored is None else monitored
    if not (watched(backend) and monitored):
        return collective_timeout_s
    return (collective_timeout_s + inflight.poll_s(collective_timeout_s, interval_s) + interval_s
            + DIAGNOSE_BUDGET_S + EXIT_MARGIN_S)


def is_hang(error: BaseException) -> bool:
    """A collective (or the store) timed out: a peer never arrived."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = f"{type(error).__name__} {error}".lower()
        if "timed out" in text or "timeout" in text:
            return True
        error = error.__cause__ or error.__context__
    return False
