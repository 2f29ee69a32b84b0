"""The suite's scheduling over pytest-xdist workers (tests/workers.py): every Ray file in one scope, every
other file its own, and a test whose `ray` mark disagrees with its file fails the collection."""

from __future__ import annotations

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


@pytest.mark.parametrize("item", [_Item("tests/unit/test_fsdp.py::t", True),  # a Ray test in a plain file
                                  _Item("tests/ray/test_train_ray.py::t", False)],  # a plain test in a Ray file
                         ids=["ray-mark-elsewhere", "unmarked-in-ray-file"])
def test_a_test_whose_mark_disagrees_with_its_file_fails_the_collection(item):
    with pytest.raises(pytest.UsageError, match="mark every test of a file `ray`"):
        check_ray_files([item])
