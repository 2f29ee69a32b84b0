"""Whole-file writes that a crash cannot tear, and reads that survive a file torn by someone else.

Every bookkeeping file that is written whole (progress.json, summary.json, config.toml, manifest.json,
extra.json, COMMIT.json, lease.json, pipeline_timeline.json, the report) goes through `replace_bytes`, so
a reader sees either the previous content or the new one, never a prefix:

    local paths     a temporary file in the same directory, flushed and fsynced, then `os.replace`d over
                    the target (a rename within one directory is atomic on POSIX file systems). The
                    directory itself is not fsynced: after a power loss the rename may be lost, which
                    leaves the previous version, not a torn one.
    other fsspec    one `fs.pipe_file` (one PUT): object stores make an object visible whole or not at
                    all (large bodies go up as a multipart upload, which also appears only when complete).

A file torn anyway (written by an older version, copied half, truncated by hand) is read by
`json_or_none` as absent with a warning, never a crash: bookkeeping must not stop a run.

Files of a run directory are read and written through `raydist.store.run_store.RunStore`, which decides
local-or-remote once for the directory; the URI functions here (`write_bytes_atomic`, `write_json_atomic`)
are for single files elsewhere: a checkpoint's COMMIT.json and extra.json, a dataset's manifest.json.
"""

from __future__ import annotations

import json
import os
import secrets
import warnings
from typing import Any

import fsspec

from raydist.store.redact import redact


def is_local(fs) -> bool:
    """True for fsspec's local file system (plain paths and file://)."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocols or "local" in protocols


def replace_bytes(fs, path: str, data: bytes, local: bool) -> None:
    """Replace `path` on `fs` with `data` so that no reader ever sees a partial file (module docstring);
    `local` is `is_local(fs)`, decided by the caller once."""
    parent = fs._parent(path)
    if not local:
        if parent:
            fs.makedirs(parent, exist_ok=True)  # no-op on object stores; real directories elsewhere
        fs.pipe_file(path, data)
        return
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def json_bytes(obj: Any, indent: int | None = 1) -> bytes:
    """How raydist writes a JSON file (one format for every whole JSON file)."""
    return json.dumps(obj, indent=indent).encode("utf-8")


def json_or_none(data: bytes, uri: str, what: str | None = None, stacklevel: int = 2) -> Any | None:
    """`data` (the content of `uri`) as JSON; None with a warning when it is empty or not JSON (torn)."""
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        state = "empty" if not data.strip() else f"not valid JSON ({exc})"
        warnings.warn(f"{redact(uri)} is {state}; treating it as absent ({what or 'it is rebuilt'})",
                      RuntimeWarning, stacklevel=stacklevel + 1)
        return None


def write_bytes_atomic(uri: str, data: bytes) -> None:
    """Replace the file at `uri` with `data` so that no reader ever sees a partial file."""
    fs, path = fsspec.core.url_to_fs(uri)
    replace_bytes(fs, path, data, is_local(fs))


def write_json_atomic(uri: str, obj: Any, indent: int | None = 1) -> None:
    write_bytes_atomic(uri, json_bytes(obj, indent))


def probe_writable(root_uri: str) -> None:
    """Writes and deletes a small file under `root_uri`; raises what the storage raised (unreachable,
    read-only, bad credentials) so the driver can fail before any worker starts."""
    probe = root_uri.rstrip("/") + f"/.raydist-probe-{secrets.token_hex(4)}"
    fs, path = fsspec.core.url_to_fs(probe)
    replace_bytes(fs, path, b"raydist storage probe\n", is_local(fs))
    fs.rm(path)
