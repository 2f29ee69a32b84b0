"""tests/gpu: what the GPU check suite (benchmarks/gpu_suite.py) runs on a CUDA machine.

A test needs CUDA when it carries the `cuda` mark or runs with `device == "cuda"` (a `device` parameter,
or the `device` fixture below); without a CUDA device those alone are skipped, with a reason made by
tests/skip_policy.py's `needs_cuda` (the one kind of skip a CI run allows). The rest, the same test bodies
on the CPU (gloo instead of NCCL, Triton under TRITON_INTERPRET=1 on small shapes), run in the normal
suite, so that the code the GPU runs cannot rot unseen. Every test needing CUDA gets the
`cuda` mark here, and the suite selects those alone (`pytest tests/gpu -m cuda`).

Nothing here may import Ray (the GPU machines have none): the trainer, the loop and the harness import no
Ray, and data is prepared on the fly with the arrow reader (the `tiny_data` fixture of tests/conftest.py).
tests/unit/test_gpu_suite.py runs this folder with `import ray` blocked.
"""

from __future__ import annotations

import pytest
import torch

from skip_policy import needs_cuda

NO_CUDA = None if torch.cuda.is_available() else needs_cuda(
    f"none visible to torch {torch.__version__} (CUDA build: {torch.version.cuda or 'none'})")


@pytest.fixture(params=["cpu", "cuda"])
def device(request) -> str:
    """Both devices: the test body on cuda (skipped without one) and on the CPU."""
    return request.param


def device_of(item: pytest.Item) -> str | None:
    """The test's device: its `device` parameter, or "cuda" for a test marked `cuda`, else None."""
    params = getattr(item, "callspec", None)
    device = params.params.get("device") if params is not None else None
    if device is None and item.get_closest_marker("cuda") is not None:
        return "cuda"
    return device


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: the marks added here count
def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason=NO_CUDA or "")
    for item in items:
        if "tests/gpu/" not in str(item.path).replace("\\", "/") or device_of(item) != "cuda":
            continue
        item.add_marker(pytest.mark.cuda)
        if NO_CUDA is not None:
            item.add_marker(skip)
