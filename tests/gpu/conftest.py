"""tests/gpu: what needs a CUDA GPU. On a machine without one every test here is skipped, with the reason.

The GPU check suite (benchmarks/gpu_suite.py) runs this directory first. Nothing here may import Ray (the
GPU machines have none): the trainer, the loop and the harness import no Ray, and data is prepared on the
fly with the arrow reader (the `tiny_data` fixture of tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

NO_CUDA = None if torch.cuda.is_available() else (
    f"needs a CUDA GPU: none visible to torch {torch.__version__} (CUDA build: {torch.version.cuda or 'none'})")


def pytest_collection_modifyitems(config, items):
    if NO_CUDA is None:
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
