"""Helpers shared by the fault tests (importable by name; conftest.py holds the fixtures)."""

from __future__ import annotations

import os

STEPS = 10


def small_config(data: str, steps: int = STEPS, **checkpoint) -> dict:
    """1 worker, 10 steps, a checkpoint every 5 steps (keep 1), blocking saves."""
    from raydist.testing import tiny_config  # (imports torch: not at module level, spawned helpers stay light)

    return tiny_config(data, train={"steps": steps},
                       checkpoint={"every_steps": 5, "keep": 1, "async_save": False, **checkpoint})


def files_under(root) -> dict[str, tuple[int, int]]:
    """{relative path: (size, mtime_ns)} of every file under `root`."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            st = os.stat(path)
            out[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
    return out
