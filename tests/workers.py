"""How the suite shares the machine between pytest-xdist's workers (README's test command: `-n 2 --dist
loadfile`).

Alone, the Ray tests keep 1.4 of the two cores busy on average and leave the rest idle while they wait (a
cluster, actors and replacement workers starting, a hang timer running out); the rest of the suite keeps both
cores busy, so the two run side by side, and a run's wall time is about the CPU all of it needs over two cores:
- every test file marked `ray` joins one scope, run in order by one worker and handed out first (it is
  the longest): one local Ray cluster at a time (two at once confuse each other: Ray Train's
  placement-group cleaner asks the default dashboard address, see tests/faults/test_foreign_dashboard.py);
- every other file is its own scope, as `--dist loadfile` makes it, so a module-scoped fixture (one spawn
  for several layouts, a shared reference run) runs once, on one worker;
- a worker lowers its CPU priority (nice 19, inherited by the ranks it spawns) at its first test not
  marked `ray`: the Ray tests keep their own pace, their waits bounded by timeouts, and the rest of the
  suite fills the idle CPU; those tests get three times their timeout (`allow_for_low_priority`), since
  they may get little CPU for minutes. (Ray starts its worker processes at nice 15, `RAY_worker_niceness`:
  against them a niced rank still gets about 15/(15+36) of a core, by the kernel's weights, not nothing.)
  Measured on the 2-core machine without it: the Ray tests ran 2.3x slower beside the others
  (test_live_recovery.py 363 s alone, 851 s beside them) and became the run's critical path.

xdist's `loadgroup` would read an `xdist_group` mark instead, but xdist 3.8 puts the group into
`item._nodeid`, which pytest 9.2 no longer reads. xdist's scheduler sees node ids only, so a Ray file is one
whose source carries `pytest.mark.ray`; `check_ray_files` holds every collected test to that (a test
marked `ray` in any other file, or unmarked in such a file, fails the collection).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

RAY_SCOPE = "ray"
ROOT = Path(__file__).resolve().parent.parent  # node ids are relative to the repository root


@functools.lru_cache(maxsize=None)
def is_ray_file(path: str) -> bool:
    """Whether the test file at `path` (a node id's file part) marks its tests `ray`."""
    return "pytest.mark.ray" in (ROOT / path).read_text()


def file_of(nodeid: str) -> str:
    """A node id's file part (relative to the repository root)."""
    return nodeid.split("::", 1)[0]


def scope_of(nodeid: str) -> str:
    path = file_of(nodeid)
    return RAY_SCOPE if is_ray_file(path) else path


def shared_cluster_first(items: list[pytest.Item]) -> None:
    """Orders the Ray files' tests (in place, among their own positions): the files whose tests use the shared
    cluster (`ray_4cpu`, tests/ray_runs.py) first, then the others, each group in collection order, so that the
    shared cluster starts once per run. A file with a cluster of its own in between (test_elastic.py's fresh
    one, test_job_submit.py's `ray start`) shut it down, and the shared files after it (test_train_ray.py)
    paid a second cluster, cold workers and another set of warm spares (test_train_ray.py took 21-26 s in
    clean-clone runs before, 14-16 s after)."""
    positions = [i for i, item in enumerate(items) if scope_of(item.nodeid) == RAY_SCOPE]
    ray_items = [items[i] for i in positions]
    shared = {file_of(item.nodeid) for item in ray_items if "ray_4cpu" in item.fixturenames}
    ordered = sorted(ray_items, key=lambda item: file_of(item.nodeid) not in shared)  # (stable)
    for i, item in zip(positions, ordered):
        items[i] = item


def check_ray_files(items: list[pytest.Item]) -> None:
    wrong = [item.nodeid for item in items
             if bool(item.get_closest_marker("ray")) != (scope_of(item.nodeid) == RAY_SCOPE)]
    if wrong:
        raise pytest.UsageError(f"{wrong[0]} (and {len(wrong) - 1} more): mark every test of a file `ray` "
                                "(pytestmark) or none of them; tests/workers.py schedules Ray tests by file")


LOW_PRIORITY = 19


def yield_to_ray(item: pytest.Item) -> None:
    """Under xdist, before a worker's first test not marked `ray`: nice the worker (and what it spawns)."""
    if os.environ.get("PYTEST_XDIST_WORKER") and not item.get_closest_marker("ray"):
        current = os.nice(0)
        if current < LOW_PRIORITY:
            os.nice(LOW_PRIORITY - current)


STARVED_FACTOR = 3  # the timeout of a test not marked `ray` under xdist, over its own (or the default 180 s)


def patience(seconds: float) -> float:
    """A test's own wait (a child's result, a server coming up), in a process niced to LOW_PRIORITY: STARVED_FACTOR
    times `seconds`, as its timeout got (`allow_for_low_priority`). A clean-clone CI run waited 400 s for the
    ranks of test_live_replicas.py's tp case, a 20 s test alone, and failed with the test's timeout at 1,800 s
    still far off. Not niced (a test run alone, or marked `ray`), `seconds`."""
    return STARVED_FACTOR * seconds if os.nice(0) >= LOW_PRIORITY else seconds


def allow_for_low_priority(config, items: list[pytest.Item]) -> None:
    """Under xdist, every test not marked `ray` gets STARVED_FACTOR times its timeout: at nice 19 it gets
    almost no CPU while the Ray tests keep both cores busy (a live-recovery run's four workers and its
    replacement), and clean-clone CI runs timed out tests of 12-20 s at 180 s that way
    (test_hf_finetune.py's qwen3 export, test_live_replicas.py, test_pipeline.py's fixture). A hang still
    ends, later."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    default = float(config.getini("timeout") or 0)
    for item in items:
        if item.get_closest_marker("ray"):
            continue
        own = item.get_closest_marker("timeout")
        seconds = float(own.kwargs.get("timeout", own.args[0] if own.args else default)) if own else default
        if seconds > 0:
            item.add_marker(pytest.mark.timeout(STARVED_FACTOR * seconds), append=False)


UNRECORDED_S_PER_TEST = 1.0  # the order's guess for a file tests/durations.json does not hold yet


def work_order(scopes: dict[str, dict], recorded: dict[str, float]) -> list[str]:
    """The order the scopes are handed out in: the Ray scope first, then the other files longest first by
    their recorded seconds (a file not recorded: UNRECORDED_S_PER_TEST a test). Longest first, the run ends
    on short files: xdist's own order (by number of tests) left one worker running a 20-60 s file while the
    other had nothing left, and that run's last 200 s had 10-45% of the CPU idle. Waiting tests (a hang
    timer running out) also come early, beside the Ray tests."""
    def seconds(scope: str) -> float:
        return recorded.get(scope, UNRECORDED_S_PER_TEST * len(scopes[scope]))

    return sorted(scopes, key=lambda scope: (scope != RAY_SCOPE, -seconds(scope)))


def make_scheduler(config, log):
    """`loadfile`, with every Ray file in one scope that the first worker takes first, then the longest files
    first (`work_order`)."""
    from xdist.scheduler import LoadScopeScheduling

    from durations import recorded

    class RayApart(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # (the first call: the queue is whole)
                for scope in work_order(self.workqueue, recorded()["files"]):
                    self.workqueue.move_to_end(scope)
                self.ordered = True
            super()._assign_work_unit(node)

    return RayApart(config, log)
