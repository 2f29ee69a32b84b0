"""The suite's scheduling over pytest-xdist workers (tests/workers.py): every Ray file in one scope, every
other file its own, and a test whose `ray` mark disagrees with its file fails the collection."""

from __future__ import annotations

import os

import pytest

from workers import RAY_SCOPE, check_ray_files, scope_of


class _Item:
    def __init__(self, nodeid: str, ray: bool):
        self.nodeid, self.ray = nodeid, ray

    def get_closest_marker(self, name: str):
        return object() if name == "ray" and self.ray else None


def test_ray_files_share_one_scope_and_the_rest_go_by_file():
    assert scope_of("tests/ray/test_train_ray.py::test_x") == RAY_SCOPE
    assert scope_of("tests/faults/test_live_recovery.py::test_y[leader]") == RAY_SCOPE
    assert scope_of("tests/unit/test_fsdp.py::test_z") == "tests/unit/test_fsdp.py"
    check_ray_files([_Item("tests/ray/test_train_ray.py::t", True), _Item("tests/unit/test_fsdp.py::t", False)])


def test_the_ray_scope_goes_first_then_the_longest_files_by_their_recorded_seconds():
    from workers import UNRECORDED_S_PER_TEST, work_order

    scopes = {"tests/unit/a.py": {"t1": False}, RAY_SCOPE: {"r": False}, "tests/unit/b.py": {"t1": False},
              "tests/unit/new.py": {f"t{i}": False for i in range(7)}, "tests/unit/c.py": {"t1": False}}
    recorded = {"tests/unit/a.py": 2.0, "tests/unit/b.py": 30.0, "tests/unit/c.py": 9.0}
    assert 2.0 < 7 * UNRECORDED_S_PER_TEST < 9.0  # (new.py's guess falls between a and c)
    assert work_order(scopes, recorded) == [RAY_SCOPE, "tests/unit/b.py", "tests/unit/c.py", "tests/unit/new.py",
                                            "tests/unit/a.py"]


def test_the_ray_files_on_the_shared_cluster_run_one_after_another():
    """shared_cluster_first: the Ray files whose tests use `ray_4cpu` come first, so the shared cluster starts
    once; the other Ray files after them, in the Ray tests' own places (the plain files keep theirs); each group
    in collection order."""
    from workers import shared_cluster_first

    def item(nodeid, *fixtures):
        fake = _Item(nodeid, ray=not nodeid.startswith("tests/unit"))
        fake.fixturenames = list(fixtures)
        return fake

    items = [item("tests/faults/test_live_recovery.py::a", "ray_4cpu"), item("tests/unit/test_fsdp.py::p"),
             item("tests/ray/test_elastic.py::b", "ray_4cpu_fresh"), item("tests/ray/test_job_submit.py::c"),
             item("tests/ray/test_train_ray.py::d1", "ray_4cpu"), item("tests/unit/test_ddp.py::q"),
             item("tests/ray/test_train_ray.py::d2", "tiny_data")]  # (a file uses it if any of its tests does)
    shared_cluster_first(items)
    assert [i.nodeid.split("::")[1] for i in items] == ["a", "p", "d1", "d2", "b", "q", "c"]


@pytest.mark.parametrize("item", [_Item("tests/unit/test_fsdp.py::t", True),  # a Ray test in a plain file
                                  _Item("tests/ray/test_train_ray.py::t", False)],  # a plain test in a Ray file
                         ids=["ray-mark-elsewhere", "unmarked-in-ray-file"])
def test_a_test_whose_mark_disagrees_with_its_file_fails_the_collection(item):
    with pytest.raises(pytest.UsageError, match="mark every test of a file `ray`"):
        check_ray_files([item])


class _Config:
    def getini(self, name):
        assert name == "timeout"
        return "180"


def test_under_xdist_the_niced_tests_get_three_times_their_timeout(monkeypatch):
    from workers import STARVED_FACTOR, allow_for_low_priority

    def item(nodeid, ray=False, timeout=None):
        fake = _Item(nodeid, ray)  # (a stand-in with the calls allow_for_low_priority makes)
        fake.markers = [pytest.mark.timeout(timeout).mark] if timeout else []
        fake.get_closest_marker = lambda name: (object() if name == "ray" and ray else
                                               next((m for m in fake.markers if m.name == name), None))
        fake.add_marker = lambda marker, append=True: fake.markers.insert(0 if not append else len(fake.markers),
                                                                          marker.mark)
        return fake

    plain, slow, ray = item("tests/unit/a.py::t"), item("tests/unit/b.py::t", timeout=400), \
        item("tests/ray/c.py::t", ray=True, timeout=600)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    allow_for_low_priority(_Config(), [plain, slow, ray])
    assert (plain.markers, slow.markers[0].args, ray.markers[0].args) == ([], (400,), (600,))  # no xdist: as given
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    allow_for_low_priority(_Config(), [plain, slow, ray])
    assert plain.get_closest_marker("timeout").args == (STARVED_FACTOR * 180.0,)
    assert slow.get_closest_marker("timeout").args == (STARVED_FACTOR * 400.0,)
    assert ray.get_closest_marker("timeout").args == (600,)  # the Ray tests keep their pace and their limits


def test_a_niced_tests_own_waits_stretch_as_its_timeout_does():
    """patience(): a wait inside a test niced to LOW_PRIORITY gets STARVED_FACTOR times as long (a child
    process, since a process cannot take back its niceness)."""
    import subprocess
    import sys
    from pathlib import Path

    from workers import LOW_PRIORITY, STARVED_FACTOR, patience

    tests = str(Path(__file__).resolve().parent.parent)
    probe = f"import os, sys; sys.path.insert(0, {tests!r}); from workers import patience; print(patience(10.0))"
    assert patience(10.0) == (STARVED_FACTOR * 10.0 if os.nice(0) >= LOW_PRIORITY else 10.0)
    plain = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    niced = subprocess.run([sys.executable, "-c", f"import os; os.nice({LOW_PRIORITY}); " + probe],
                           capture_output=True, text=True, check=True)
    assert float(niced.stdout) == STARVED_FACTOR * 10.0
    if os.nice(0) < LOW_PRIORITY:  # (under xdist this worker is niced already, and so is every child)
        assert float(plain.stdout) == 10.0
