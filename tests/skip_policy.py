"""Which skips a CI run allows: one kind only, a test that needs a CUDA GPU on a machine without one.

Any other skip hides breakage (a package the test extra installs that no longer imports, a kernel
interpreter that stopped working, a test waiting on code that has long been merged), so under CI=true the
hooks below turn it into a failure that names the test and the reason. A skip for want of CUDA says so
through `needs_cuda(why)`: its reason starts with CUDA_SKIP, the one thing the check keys on. Outside CI
every skip stays a skip (a developer's machine may lack Triton, say).

A pytest plugin: tests/conftest.py imports its hooks, and `pytest -p skip_policy` (with this folder on
the path) applies it to any test file.
"""

from __future__ import annotations

import os

import pytest

CUDA_SKIP = "needs a CUDA GPU"


def needs_cuda(why: str) -> str:
    """The reason of a skip for want of a CUDA GPU, the one kind of skip a CI run allows."""
    return f"{CUDA_SKIP}: {why}"


def in_ci() -> bool:
    """CI=true (or 1, yes), as CI services and the caller of .ci/run set it."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The reason of a skipped test or collector, without pytest's "Skipped: " prefix."""
    longrepr = report.longrepr
    message = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return message.removeprefix("Skipped: ")


def hidden_breakage(report: pytest.TestReport | pytest.CollectReport) -> str | None:
    """Under CI, for a skip (not an expected failure) whose reason does not start with CUDA_SKIP: the text
    of the failure that replaces it. Else None."""
    if not report.skipped or hasattr(report, "wasxfail") or not in_ci():
        return None
    reason = skip_reason(report)
    if reason.startswith(CUDA_SKIP):
        return None
    return (f"{report.nodeid} was skipped under CI=true: {reason}\n"
            f"A CI run allows only skips whose reason starts with {CUDA_SKIP!r} (tests/skip_policy.py, "
            "needs_cuda): any other skip would hide breakage. Fix the cause, or fail instead of skipping.")


def _fail_hidden_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    failure = hidden_breakage(report)
    if failure is not None:
        report.outcome, report.longrepr = "failed", failure


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test skipped in setup (a skip mark, a fixture) or in its body."""
    report = yield
    _fail_hidden_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A whole module skipped at collection (`pytest.skip(allow_module_level=True)`, `importorskip`)."""
    report = yield
    _fail_hidden_skip(report)
    return report
