"""Under CI=true a skip hides nothing: any skip but one for want of a CUDA GPU fails the run, naming the
test and the reason (tests/skip_policy.py); outside CI a skip stays a skip.

Each case is a pytest run in a subprocess: on small generated test files with the policy as a plugin
(`-p skip_policy`), and on the suite's own test files with a package hidden behind a stand-in that fails to
import, as if it were not installed (nothing is uninstalled)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"

GENERATED = {
    "other": """
        import pytest

        def test_runs():
            pass

        def test_hides_something():
            pytest.skip("something else")
    """,
    "module": """
        import pytest

        pytest.importorskip("no_such_package_for_raydist")

        def test_never_collected():
            pass
    """,
    "cuda": """
        import pytest
        from skip_policy import needs_cuda

        @pytest.mark.skip(reason=needs_cuda("none here"))
        def test_marked():
            pass

        def test_in_the_body():
            pytest.skip(needs_cuda("none here either"))

        @pytest.mark.xfail(reason="an expected failure is not a skip")
        def test_expected_to_fail():
            assert False
    """,
}


def pytest_run(args: list[str], cwd: Path, ci: bool, hidden: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m pytest ARGS` in `cwd`, with tests/ (skip_policy), the stand-ins in `hidden` and the
    repository first on the path (and no $RAYDIST_TEST_DURATIONS: the figures are the outer run's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "RAYDIST_TEST_DURATIONS")}
    if ci:
        env["CI"] = "true"
    path = [str(p) for p in (hidden, TESTS, ROOT) if p is not None]
    env["PYTHONPATH"] = os.pathsep.join([*path, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def generated_run(tmp_path: Path, name: str, ci: bool) -> subprocess.CompletedProcess:
    test = tmp_path / f"test_{name}.py"
    test.write_text(textwrap.dedent(GENERATED[name]))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # this folder is the root: no ini or conftest above it
    return pytest_run(["-p", "skip_policy", "-rA", test.name], tmp_path, ci)


def hide(tmp_path: Path, package: str) -> Path:
    """A folder whose `package` fails to import as a missing one does (ModuleNotFoundError)."""
    stand_in = tmp_path / "hidden" / package
    stand_in.mkdir(parents=True)
    message = f"No module named {package!r} (hidden by test_no_silent_skips)"
    (stand_in / "__init__.py").write_text(f"raise ModuleNotFoundError({message!r}, name={package!r})\n")
    return stand_in.parent


def test_a_skip_for_another_reason_fails_under_ci_naming_the_test_and_the_reason(tmp_path):
    run = generated_run(tmp_path, "other", ci=True)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "test_other.py::test_hides_something was skipped under CI=true: something else" in out
    assert "1 failed, 1 passed" in out and "skipped" not in out.splitlines()[-1]

    run = generated_run(tmp_path, "other", ci=False)  # outside CI: a skip, as before
    assert run.returncode == 0 and "1 passed, 1 skipped" in run.stdout, run.stdout + run.stderr


def test_a_module_skipped_at_collection_is_an_error_under_ci(tmp_path):
    run = generated_run(tmp_path, "module", ci=True)
    out = run.stdout + run.stderr
    assert run.returncode == 2, out  # interrupted: an error during collection
    assert "test_module.py was skipped under CI=true: could not import 'no_such_package_for_raydist'" in out


def test_skips_for_want_of_cuda_pass_under_ci(tmp_path):
    run = generated_run(tmp_path, "cuda", ci=True)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "2 skipped, 1 xfailed" in out and "needs a CUDA GPU: none here either" in out


def test_the_suite_with_transformers_missing_fails_under_ci_instead_of_skipping(tmp_path):
    """The issue's check, `CI=true python -m pytest ...` with transformers uninstalled, on test_hf.py's
    collection: transformers hidden, the run ends in an error that names the import (so it would outside
    CI too: the test extra installs transformers, and the tests import it plainly)."""
    run = pytest_run(["--collect-only", "tests/unit/test_hf.py"], ROOT, ci=True, hidden=hide(tmp_path, "transformers"))
    out = run.stdout + run.stderr
    assert run.returncode == 2, out  # interrupted: errors during collection
    assert "ERROR tests/unit/test_hf.py" in out
    assert "E   ModuleNotFoundError: No module named 'transformers' (hidden by test_no_silent_skips)" in out
    assert "skipped" not in out


@pytest.mark.parametrize("ci", [True, False], ids=["ci", "outside-ci"])
def test_a_triton_test_without_triton_fails_under_ci_and_skips_elsewhere(tmp_path, ci):
    """Triton is a dependency on Linux x86_64: a test that needs it skips only outside CI (a developer's
    machine without a wheel), and under CI the skip is a failure naming the reason."""
    test = "tests/unit/test_kernels_select.py::test_triton_attention_with_unsupported_head_dim_is_a_config_error"
    run = pytest_run([test], ROOT, ci=ci, hidden=hide(tmp_path, "triton"))
    out = run.stdout + run.stderr
    if ci:
        assert run.returncode == 1, out
        assert f"{test} was skipped under CI=true: triton not importable: ModuleNotFoundError" in out
    else:
        assert run.returncode == 0 and "1 skipped" in out, out
