"""Where the suite's time goes, and the inner loop it defines.

Every test's setup + call + teardown seconds, summed per file, are printed at the end of a run (the ten
costliest files) and written as JSON to $RAYDIST_TEST_DURATIONS when it is set ({"total_s", "files":
{file: s}, "tests": {nodeid: s}}). pytest's own `--durations` lists single phases of single tests only.

The inner loop: `RECORDED` (tests/durations.json) holds the seconds of every test not marked `ray`, from a
whole run on a 2-core machine (that JSON, as a run writes it). A test recorded at `INNER_LIMIT_S` or more is
marked `slow` at collection, so `pytest -m "not ray and not slow"` runs the tests that took less, and a test
not recorded yet (a new one) until the file is rewritten. Refresh it after changing what tests cost:
`RAYDIST_TEST_DURATIONS=tests/durations.json python -m pytest -q -m "not ray" tests` (as README.md says).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest

RECORDED = os.path.join(os.path.dirname(__file__), "durations.json")
INNER_LIMIT_S = 1.0  # the 4-minute inner loop: 1.5 s let it reach 240 s once the suite got faster (2026-11-30)

_TESTS: dict[str, float] = defaultdict(float)


def recorded(path: str = RECORDED) -> dict:
    """The recorded run ({"total_s", "files": {file: s}, "tests": {nodeid: s}}; empty parts without the file)."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return {"total_s": 0.0, "files": {}, "tests": {}}


def recorded_seconds(path: str = RECORDED) -> dict[str, float]:
    """Each test's recorded seconds by node id."""
    return recorded(path)["tests"]


def pytest_collection_modifyitems(config, items) -> None:  # as a plugin of its own (tests/unit/test_inner_loop.py)
    mark_slow(items)


def mark_slow(items) -> None:
    seconds = recorded_seconds()
    for item in items:
        if seconds.get(item.nodeid, 0.0) >= INNER_LIMIT_S and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)


def pytest_runtest_logreport(report) -> None:
    _TESTS[report.nodeid] += report.duration  # on xdist's controller: every worker's reports


def _by_file() -> dict[str, float]:
    files: dict[str, float] = defaultdict(float)
    for nodeid, seconds in _TESTS.items():
        files[nodeid.split("::", 1)[0]] += seconds
    return dict(sorted(files.items(), key=lambda kv: -kv[1]))


def pytest_terminal_summary(terminalreporter) -> None:
    if not _TESTS or os.environ.get("PYTEST_XDIST_WORKER"):  # xdist's controller sums every worker's reports
        return
    files = _by_file()
    total = sum(files.values())
    terminalreporter.section("seconds by test file")
    for name, seconds in list(files.items())[:10]:
        terminalreporter.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {name}")
    terminalreporter.write_line(f"{total:8.1f}s in {len(files)} files, {len(_TESTS)} tests")
    from workers import RAY_SCOPE, scope_of

    ray_files = {name: s for name, s in files.items() if scope_of(name) == RAY_SCOPE}
    if ray_files:  # one xdist worker runs them in order (tests/workers.py): no run is shorter
        terminalreporter.write_line(f"{sum(ray_files.values()):8.1f}s in the {len(ray_files)} Ray files, one "
                                    "worker's chain: " + ", ".join(f"{n.rsplit('/', 1)[-1]} {s:.0f}"
                                                                  for n, s in ray_files.items()))
    path = os.environ.get("RAYDIST_TEST_DURATIONS")
    if path:
        with open(path, "w") as f:
            json.dump({"total_s": round(total, 2), "files": {k: round(v, 2) for k, v in files.items()},
                       "tests": {k: round(v, 2) for k, v in sorted(_TESTS.items(), key=lambda kv: -kv[1])}},
                      f, indent=1)
