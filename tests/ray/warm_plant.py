"""A failure of `import torch` planted once, after torch._C and torch.library were loaded
(`plant_torch_failure`), and a job's worker_process_setup_hook for tests/ray/test_warm_spares_on_ray.py that
plants it in the job's first Ray Train worker process (the one that creates the marker file), then runs
raydist's own. tests/unit/test_warm_spares.py plants it in a subprocess."""

from __future__ import annotations

import importlib.abc
import os
import sys

from raydist.elastic import warm

MARKER_ENV = "RAYDIST_TEST_UNFIT_MARKER"


class FailOnce(importlib.abc.MetaPathFinder):
    armed = True

    def find_spec(self, name, path, target=None):
        if self.armed and name == "torch.utils._debug_mode":
            self.armed = False
            raise MemoryError("planted")
        return None


def plant_torch_failure() -> FailOnce:
    """The next `import torch` of this process fails (MemoryError) at torch.utils._debug_mode; `armed` is
    False once it did."""
    finder = FailOnce()
    sys.meta_path.insert(0, finder)
    return finder


def preload() -> None:
    marker = os.environ.get(MARKER_ENV)
    if marker and os.environ.get(warm.SPARE_ENV_VAR):
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            pass
        else:
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            plant_torch_failure()
    warm.preload()
