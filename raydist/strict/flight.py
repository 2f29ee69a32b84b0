"""The strict mode's flight record, for hang diagnosis: what this process's strict groups have issued and
not completed (raydist.strict.runtime.StrictRuntime.pending), empty when the mode is off."""

from __future__ import annotations

from raydist.strict import runtime


def pending() -> list[dict]:
    """[{"group", "ranks", "seq", "op", "state", "since", "kind"}], the running operation first per group."""
    current = runtime.current()
    return current.pending() if current is not None else []


def counters() -> dict[str, dict[str, int]]:
    """{group: {"issued", "completed"}} collectives per strict group of this process."""
    current = runtime.current()
    return current.counters() if current is not None else {}
