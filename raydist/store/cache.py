"""The machine's local cache directory: $RAYDIST_CACHE, else ~/.cache/raydist. It holds the prepared default
corpora (data/), the planner's calibration.json, the measured kernel choices (kernel_choices.json) and the
console's logs of a run whose directory is on an object store (logs/<run>, copied there when the run ends)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("RAYDIST_CACHE") or Path.home() / ".cache" / "raydist")
