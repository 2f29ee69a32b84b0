"""The dependency order of a schedule: each rank runs its actions in order, and an action waits only for the
tensor it receives (an F for the previous stage's F, a B for the next stage's B; W only for its own B, earlier
on the same rank). `execution_order` interleaves the ranks' lists into one order that respects every such
dependency, the global clock the pipeline's transfers are planned against
(raydist.schedule.transfer_plan), or names the ranks that wait forever.
"""

from __future__ import annotations

from raydist.errors import ConfigError
from raydist.schedule.actions import Action, Schedule, dependency_key


class ScheduleError(ConfigError):
    """A schedule that cannot run correctly; the message names the rank and action."""


def _dependency(schedule: Schedule, a: Action) -> Action | None:
    key = dependency_key(a.kind, a.stage, a.microbatch, schedule.num_stages - 1)
    return None if key is None else Action(*key)


def execution_order(schedule: Schedule) -> list[tuple[int, Action]]:
    """(rank, action) in an order that respects every dependency, or ScheduleError on a deadlock."""
    pointers = [0] * schedule.num_ranks
    done: set[tuple[str, int, int]] = set()  # (kind, stage, micro-batch) of the actions run
    last = schedule.num_stages - 1
    order = []
    remaining = sum(len(a) for a in schedule.actions)
    while remaining:
        progressed = False
        for rank, actions in enumerate(schedule.actions):
            while pointers[rank] < len(actions):
                a = actions[pointers[rank]]
                dep = dependency_key(a.kind, a.stage, a.microbatch, last)
                if dep is not None and dep not in done:
                    break
                done.add((a.kind, a.stage, a.microbatch))
                order.append((rank, a))
                pointers[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = [f"rank {r} waits at {acts[p]} for {_dependency(schedule, acts[p])}"
                       for r, (acts, p) in enumerate(zip(schedule.actions, pointers)) if p < len(acts)]
            raise ScheduleError("deadlock: " + "; ".join(blocked))
    return order
