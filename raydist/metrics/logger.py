"""The run directory: config.toml, metrics.jsonl, summary.json on any fsspec storage.

Local storage appends to metrics.jsonl line by line. Object stores cannot append, so there the whole
file is rewritten from the lines kept in memory each time (metrics files stay small: one line per
logged step).
"""

from __future__ import annotations

import json
import math
from typing import Any

import fsspec


def join(root: str, *names: str) -> str:
    return "/".join([root.rstrip("/"), *names])


def _clean(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


class MetricsWriter:
    """Appends JSON lines to RUN_DIR/<name>."""

    def __init__(self, run_dir: str, name: str = "metrics.jsonl"):
        self.path = join(run_dir, name)
        self.fs, self.fs_path = fsspec.core.url_to_fs(self.path)
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        self.lines: list[str] = []
        if not self.local and self.fs.exists(self.fs_path):  # resuming: keep the earlier attempts' lines
            with self.fs.open(self.fs_path, "r") as f:
                self.lines = f.read().splitlines()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(_clean(record), sort_keys=False)
        if self.local:
            self.fs.makedirs(self.fs._parent(self.fs_path), exist_ok=True)
            with self.fs.open(self.fs_path, "a") as f:
                f.write(line + "\n")
        else:
            self.lines.append(line)
            with self.fs.open(self.fs_path, "w") as f:
                f.write("\n".join(self.lines) + "\n")


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    path = join(run_dir, "metrics.jsonl")
    fs, fs_path = fsspec.core.url_to_fs(path)
    if not fs.exists(fs_path):
        return []
    with fs.open(fs_path, "r") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_json(path: str, obj: Any) -> None:
    fs, fs_path = fsspec.core.url_to_fs(path)
    fs.makedirs(fs._parent(fs_path), exist_ok=True)
    with fs.open(fs_path, "w") as f:
        json.dump(_clean(obj), f, indent=1)


def read_json(path: str) -> Any | None:
    fs, fs_path = fsspec.core.url_to_fs(path)
    if not fs.exists(fs_path):
        return None
    with fs.open(fs_path, "r") as f:
        return json.load(f)


def write_text(path: str, text: str) -> None:
    fs, fs_path = fsspec.core.url_to_fs(path)
    fs.makedirs(fs._parent(fs_path), exist_ok=True)
    with fs.open(fs_path, "w") as f:
        f.write(text)
