"""The strict-collectives mode's switch and names: the environment variable, the backend's name, the
error it raises, and the backend a DEVICE group gets (see raydist.strict for the mode itself)."""

from __future__ import annotations

import os

ENV = "RAYDIST_STRICT_COLLECTIVES"
BACKEND = "raydist_strict"


class StrictCollectiveError(RuntimeError):
    """An operation NCCL would hang on or reject; the message names the ranks, operations and groups."""


def enabled() -> bool:
    """Whether this process runs under the strict-collectives mode ($RAYDIST_STRICT_COLLECTIVES=1)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def device_backend(device_type: str) -> str:
    """The backend of a DEVICE group on `device_type`: NCCL on CUDA, else the strict backend under the mode,
    gloo otherwise."""
    if device_type == "cuda":
        return "nccl"
    return BACKEND if enabled() else "gloo"
