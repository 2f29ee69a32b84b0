"""Where the suite's time goes: every test's setup + call + teardown seconds, summed per file, printed at the
end of a run (the ten costliest files) and written as JSON to $RAYDIST_TEST_DURATIONS when it is set
({"total_s", "files": {file: s}, "tests": {nodeid: s}}), so that a CI run leaves the figures a budget of
the suite is kept by. pytest's own `--durations` lists single phases of single tests only."""

from __future__ import annotations

import json
import os
from collections import defaultdict

_TESTS: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report) -> None:
    _TESTS[report.nodeid] += report.duration


def _by_file() -> dict[str, float]:
    files: dict[str, float] = defaultdict(float)
    for nodeid, seconds in _TESTS.items():
        files[nodeid.split("::", 1)[0]] += seconds
    return dict(sorted(files.items(), key=lambda kv: -kv[1]))


def pytest_terminal_summary(terminalreporter) -> None:
    if not _TESTS:
        return
    files = _by_file()
    total = sum(files.values())
    terminalreporter.section("seconds by test file")
    for name, seconds in list(files.items())[:10]:
        terminalreporter.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {name}")
    terminalreporter.write_line(f"{total:8.1f}s in {len(files)} files, {len(_TESTS)} tests")
    path = os.environ.get("RAYDIST_TEST_DURATIONS")
    if path:
        with open(path, "w") as f:
            json.dump({"total_s": round(total, 2), "files": {k: round(v, 2) for k, v in files.items()},
                       "tests": {k: round(v, 2) for k, v in sorted(_TESTS.items(), key=lambda kv: -kv[1])}},
                      f, indent=1)
