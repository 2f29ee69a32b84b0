"""The run directory: config.toml, metrics.jsonl, summary.json on any fsspec storage.

JSON-lines files (metrics.jsonl, events.jsonl) are appended by whoever logs: rank 0 during `fit`, and
for events also any rank outside it (`launch`, `worker_error`), and every restart attempt again. How
appends stay safe with several writers:

    local storage   every writer appends to RUN_DIR/<name> with one O_APPEND `write` per line, which the
                    kernel applies whole, so lines from different processes never interleave.
    object stores   cannot append, and rewriting one shared object from each writer's memory loses the
                    other writers' lines. So each writer owns one part, RUN_DIR/<name>.d/<writer>.jsonl
                    (creation time, host, pid, a nonce), rewritten whole with one PUT per line;
                    `read_jsonl` merges the parts (and a RUN_DIR/<name> written by older versions).

A crash in the middle of an append leaves a torn last line. Readers skip lines that are not JSON (the
last one silently: it may be a write in flight; others with a warning), and a writer that finds the file
not ending in a newline starts its line on a new one, so a torn line never swallows the next record.
Files written whole go through `raydist.store.atomic` (never torn), and a torn one is read as absent.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import secrets
import socket
import time
import warnings
from typing import Any, Callable

import fsspec

from raydist.store.atomic import is_local, read_json_or_none, write_bytes_atomic, write_text_atomic


def join(root: str, *names: str) -> str:
    return "/".join([root.rstrip("/"), *names])


def _clean(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


_WRITERS = itertools.count()


def writer_id() -> str:
    """Unique per writer, sorting by creation time: `<unix ns>-<host>-<pid>-<n>-<nonce>` (n orders the
    writers one process creates within a clock tick)."""
    host = "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname())[:40]
    return f"{time.time_ns():020d}-{host}-{os.getpid()}-{next(_WRITERS):06d}-{secrets.token_hex(3)}"


class MetricsWriter:
    """Appends JSON lines to RUN_DIR/<name> (see the module docstring for object stores)."""

    def __init__(self, run_dir: str, name: str = "metrics.jsonl", background=None):
        self.path = join(run_dir, name)
        self.fs, self.fs_path = fsspec.core.url_to_fs(self.path)
        self.local = is_local(self.fs)
        self.lines: list[str] = []
        self.part_path = None if self.local else f"{self.fs_path}.d/{writer_id()}.jsonl"
        self.background = background  # a BackgroundWriter (metrics/background.py): writes leave the caller
        # live recovery: every replica keeps the bookkeeping, only the one the gate names (the quorum's
        # rank 0, which may change during the run) writes it
        self.gate: Callable[[], bool] | None = None

    def write(self, record: dict[str, Any]) -> None:
        if self.gate is not None and not self.gate():
            return
        line = json.dumps(_clean(record), sort_keys=False)  # serialised now: the record may change later
        if self.background is not None:
            self.background.submit(lambda: self._write_line(line))
        else:
            self._write_line(line)

    def _write_line(self, line: str) -> None:
        if self.local:
            append_line(self.fs_path, line)
        else:
            if not self.lines:  # object stores: a no-op; file systems with directories need it
                self.fs.makedirs(self.fs._parent(self.part_path), exist_ok=True)
            self.lines.append(line)
            self.fs.pipe_file(self.part_path, ("\n".join(self.lines) + "\n").encode())


def append_line(path: str, line: str) -> None:
    """One O_APPEND write of `line` + newline (preceded by a newline if the file ends in a torn line)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        torn = size > 0 and os.pread(fd, 1, size - 1) != b"\n"
        data = (("\n" if torn else "") + line + "\n").encode()
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


def read_jsonl(run_dir: str, name: str, problems: list[str] | None = None) -> list[dict[str, Any]] | None:
    """Every record of RUN_DIR/<name> and its per-writer parts (parts in creation order); None if there
    is no such file at all. Lines that are not JSON objects are skipped: a torn last line silently, others
    noted in `problems` (or warned about when it is None)."""
    fs, path = fsspec.core.url_to_fs(join(run_dir, name))
    sources = []
    try:
        sources.append((name, fs.cat_file(path)))
    except (FileNotFoundError, IsADirectoryError):
        pass
    parts_dir = f"{path}.d"
    fs.invalidate_cache(parts_dir)  # object stores cache listings; parts appear while a run goes on
    try:
        parts = sorted(p for p in fs.ls(parts_dir, detail=False) if p.endswith(".jsonl"))
    except (FileNotFoundError, NotADirectoryError):
        parts = []
    for part in parts:
        try:
            sources.append((f"{name}.d/{part.rsplit('/', 1)[-1]}", fs.cat_file(part)))
        except FileNotFoundError:
            continue
    if not sources:
        return None
    records: list[dict[str, Any]] = []
    for source, data in sources:
        lines = data.decode("utf-8", errors="replace").split("\n")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                value = None
            if isinstance(value, dict):
                records.append(value)
            elif number < len(lines) or data.endswith(b"\n"):  # not a write still in flight
                message = f"{source}:{number}: not a JSON record (a torn line?), skipped"
                if problems is None:
                    warnings.warn(message, RuntimeWarning, stacklevel=2)
                else:
                    problems.append(message)
    return records


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    return read_jsonl(run_dir, "metrics.jsonl") or []


def write_json(path: str, obj: Any) -> None:
    write_bytes_atomic(path, json.dumps(_clean(obj), indent=1).encode())


def read_json(path: str) -> Any | None:
    """The JSON at `path`, or None when absent or torn (with a warning)."""
    return read_json_or_none(path)


def write_text(path: str, text: str) -> None:
    write_text_atomic(path, text)
