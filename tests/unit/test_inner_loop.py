"""The inner loop (`pytest -m "not ray and not slow"`) leaves out every test tests/durations.json records at
1.0 s or more (INNER_LIMIT_S), and keeps the others and the tests it does not record yet. Each case collects
generated test files in a pytest subprocess with tests/durations.py as a plugin and a recorded-seconds file
beside them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

MODULE = """
    import pytest

    def test_quick():
        pass

    def test_costly():
        pass

    @pytest.mark.parametrize("case", ["cheap", "dear"])
    def test_cases(case):
        pass

    def test_new():
        pass

    @pytest.mark.slow
    def test_marked_by_hand():
        pass
"""


def _selected(tmp_path: Path, recorded: dict[str, float] | None) -> list[str]:
    (tmp_path / "test_generated.py").write_text(textwrap.dedent(MODULE))
    if recorded is not None:
        (tmp_path / "durations.json").write_text(json.dumps({"tests": recorded}))
    plugin = tmp_path / "durations_here.py"  # tests/durations.py, reading the durations.json beside it
    plugin.write_text((TESTS / "durations.py").read_text())
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("RAYDIST_TEST_DURATIONS", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "durations_here",
                          "-p", "no:cacheprovider", "-m", "not ray and not slow", "-c", os.devnull,
                          "--rootdir", str(tmp_path), str(tmp_path / "test_generated.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return sorted(line.split("::", 1)[1] for line in out.stdout.splitlines() if "::" in line)


def test_recorded_costly_tests_leave_the_inner_loop(tmp_path):
    recorded = {"test_generated.py::test_quick": 0.3, "test_generated.py::test_costly": 1.0,
                "test_generated.py::test_cases[cheap]": 0.9, "test_generated.py::test_cases[dear]": 14.0,
                "test_generated.py::test_marked_by_hand": 0.1}
    assert _selected(tmp_path, recorded) == ["test_cases[cheap]", "test_new", "test_quick"]


def test_without_the_file_only_hand_marks_count(tmp_path):
    assert _selected(tmp_path, None) == ["test_cases[cheap]", "test_cases[dear]", "test_costly", "test_new",
                                         "test_quick"]

