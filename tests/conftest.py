"""Shared fixtures: a small prepared corpus (real text: a slice of the Python standard library). And the
skip policy: under CI=true a skip for any reason but the want of a CUDA GPU fails (tests/skip_policy.py)."""

from __future__ import annotations

import os
import sys

import pytest

from durations import mark_slow, pytest_runtest_logreport, pytest_terminal_summary  # noqa: F401  (hooks: seconds
from skip_policy import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401  by file; CI's skips)
from workers import allow_for_low_priority, check_ray_files, make_scheduler, shared_cluster_first, yield_to_ray

os.environ.setdefault("RAY_DEDUP_LOGS", "1")
# Every multi-process test runs under NCCL's rules (raydist.strict): the ranks raydist.parallel.runtime.spawn starts and
# the Ray Train workers of the local clusters the tests start (their processes inherit this environment).
# A test of plain gloo's own behaviour asks for the `plain_gloo` fixture; RAYDIST_STRICT_COLLECTIVES=0 runs
# the whole suite on plain gloo.
os.environ.setdefault("RAYDIST_STRICT_COLLECTIVES", "1")


def pytest_collection_modifyitems(config, items) -> None:
    mark_slow(items)  # the inner loop's `slow` marks, from tests/durations.json
    check_ray_files(items)  # Ray tests are scheduled by file (tests/workers.py)
    shared_cluster_first(items)  # the Ray files on the shared cluster one after another (tests/workers.py)
    allow_for_low_priority(config, items)  # under xdist, the niced tests' timeouts x3 (tests/workers.py)


def pytest_runtest_setup(item) -> None:
    yield_to_ray(item)  # under xdist, the other tests' processes run at low CPU priority (tests/workers.py)
    if not {"ray_4cpu", "ray_4cpu_fresh"} & set(item.fixturenames):
        _release_shared_ray()  # the Ray files' shared cluster ends before a test that does not use it


def pytest_sessionfinish(session) -> None:
    _release_shared_ray()


def _release_shared_ray() -> None:
    ray_runs = sys.modules.get("ray_runs")  # (no test imported it: no cluster of its)
    if ray_runs is not None:
        ray_runs.SHARED.release()


try:
    import xdist  # noqa: F401  (the hook below exists only with xdist installed)
except ImportError:
    pass
else:
    def pytest_xdist_make_scheduler(config, log):
        """`--dist loadfile`: the Ray files as one scope, first (tests/workers.py)."""
        return make_scheduler(config, log) if config.getvalue("dist") == "loadfile" else None


@pytest.fixture
def plain_gloo(monkeypatch):
    """This test's processes use gloo as it is (a test of gloo's own behaviour, or of the audit on it)."""
    monkeypatch.setenv("RAYDIST_STRICT_COLLECTIVES", "0")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> str:
    """~0.6 MB of stdlib source, byte-level, seq_len 32, small shards (several per epoch)."""
    from raydist.config import DataConfig
    from raydist.data.prepare import prepare

    out = str(tmp_path_factory.mktemp("data") / "stdlib-s32")
    prepare(DataConfig(corpus="stdlib", seq_len=32, max_corpus_mb=0.6, shard_rows=1024, val_fraction=0.15),
            out, log=lambda *_: None)
    return out


@pytest.fixture(scope="session")
def single_4_layers(tiny_data):
    """The single-process reference run (`run_layout`'s default steps, captured gradients) of the 4-layer
    tiny config that the layout-equivalence tests compare against."""
    from raydist.testing import run_layout, tiny_config

    [ref] = run_layout(tiny_config(tiny_data, model={"num_layers": 4}), 1)
    return ref
