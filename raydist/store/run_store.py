"""The run directory as one object: `RunStore(uri)` reads and writes the files of
`<checkpoint.storage>/<train.run_name>/` (config.toml, metrics.jsonl, events.jsonl, summary.json,
progress.json, lease.json, fatal.json, mlflow.json, wandb.json, logs/, tensorboard/, ...), and decides once,
when it is made, whether that directory is on this machine's disk or on other fsspec storage (s3://, gs://,
memory://, ...). Callers name files relative to the directory ("logs/driver.log"; "" is the directory)
and never ask which kind of storage they are on; `store.local` is there for policies that differ (how
often progress.json is worth a request).

    store = RunStore("s3://bucket/runs/my-run")
    store.write_json("progress.json", state)          # whole: a reader sees the old file or the new one
    store.read_json("summary.json")                   # None when absent, or torn (with a warning)
    events = store.appender("events.jsonl")           # one per writer
    events.append({"kind": "start", "step": 0})
    store.read_records("events.jsonl")                # every whole record of every writer
    tail = store.tail("metrics.jsonl"); tail.new()    # the records appended since the last call

Whole files (`write_bytes`, `write_text`, `write_json`) are replaced atomically: a temporary file and a
rename locally, the object store's single PUT remotely (raydist.store.atomic). A torn file (an older
version's, one copied half) is read by `read_json` as absent with a warning.

JSON-lines files (metrics.jsonl, events.jsonl) are appended by whoever logs: rank 0 during `fit`, and for
events also any rank outside it (`launch`, `worker_error`), and every restart attempt again. How appends
stay safe with several writers:

    local storage   every appender appends to RUN_DIR/<name> with one O_APPEND `write` per line, which the
                    kernel applies whole, so lines from different processes never interleave.
    object stores   cannot append, and rewriting one shared object from each writer's memory loses the
                    other writers' lines. So each appender owns one part, RUN_DIR/<name>.d/<writer>.jsonl
                    (creation time, host, pid, a nonce), rewritten whole with one PUT per line;
                    `read_records` merges the parts (and a RUN_DIR/<name> written by older versions).

A crash in the middle of an append leaves a torn last line. Readers return complete records only: they
skip lines that are not JSON objects (the last one silently: it may be a write in flight; others with a
warning), and an appender that finds the file not ending in a newline starts its line on a new one, so a
torn line never swallows the next record.

What needs a real file on this machine asks `local_path(name)` (None on remote storage: SummaryWriter and
the console's log files then write locally and `put_files` copies them up); `lock()` and
`create_json_exclusive` serve the run's lease (raydist.checkpoint.lease). Everything read is JSON or text:
nothing from storage is unpickled.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import itertools
import json
import os
import secrets
import socket
import time
import warnings
from typing import Any, Iterator

import fsspec

from raydist.store.atomic import is_local, json_bytes, json_or_none, replace_bytes
from raydist.store.redact import redact


def join(root: str, *names: str) -> str:
    """`root/name/...` for a URI or path (one trailing slash of `root` dropped; empty names skipped)."""
    return "/".join([root.rstrip("/"), *(n for n in names if n)])


_WRITERS = itertools.count()


def writer_id() -> str:
    """Unique per writer, sorting by creation time: `<unix ns>-<host>-<pid>-<n>-<nonce>` (n orders the
    writers one process creates within a clock tick)."""
    host = "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname())[:40]
    return f"{time.time_ns():020d}-{host}-{os.getpid()}-{next(_WRITERS):06d}-{secrets.token_hex(3)}"


def append_line(path: str, line: str) -> None:
    """One O_APPEND write of `line` + newline to a local file (preceded by a newline if the file ends in a
    torn line)."""
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


class RunStore:
    """One run directory on local or remote storage (see the module docstring)."""

    def __init__(self, uri: str):
        self.uri = uri.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.uri)
        self.local = is_local(self.fs)  # the one place the kind of storage is decided

    def __repr__(self) -> str:
        return f"RunStore({redact(self.uri)!r})"

    # ---- names -------------------------------------------------------------------------------------
    def join(self, *names: str) -> str:
        """The URI of `name` in the run directory (what messages and events show, after `redact`)."""
        return join(self.uri, *names)

    def path(self, *names: str) -> str:
        """The path of `name` on the store's file system (fsspec's, without the protocol)."""
        return join(self.root, *names)

    def local_path(self, *names: str) -> str | None:
        """The path of `name` on this machine's disk, or None when the run directory is remote."""
        return self.path(*names) if self.local else None

    # ---- what is there -----------------------------------------------------------------------------
    def exists(self, name: str = "") -> bool:
        return self.fs.exists(self.path(name))

    def isdir(self, name: str = "") -> bool:
        return self.fs.isdir(self.path(name))

    def list(self, name: str = "") -> list[str]:
        """The names directly under `name`, sorted; [] when it is absent or not a directory."""
        path = self.path(name)
        self.fs.invalidate_cache(path)  # object stores cache listings; files appear while a run goes on
        try:
            entries = self.fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def makedirs(self, name: str = "") -> None:
        """Creates `name` as a directory (a no-op on object stores, which have none)."""
        self.fs.makedirs(self.path(name), exist_ok=True)

    def remove(self, name: str) -> None:
        self.fs.rm(self.path(name))

    # ---- whole files -------------------------------------------------------------------------------
    def read_bytes(self, name: str) -> bytes:
        """The content of `name`; FileNotFoundError when it is absent."""
        return self.fs.cat_file(self.path(name))

    def read_text(self, name: str) -> str:
        return self.read_bytes(name).decode("utf-8")

    def read_json(self, name: str, what: str | None = None) -> Any | None:
        """The JSON in `name`; None when absent, and None with a warning when empty or not JSON (torn);
        `what` says in the warning what follows from that."""
        try:
            data = self.read_bytes(name)
        except FileNotFoundError:
            return None
        return json_or_none(data, self.join(name), what)

    def write_bytes(self, name: str, data: bytes) -> None:
        """Replaces `name` whole: a reader sees the old content or `data`, never a part."""
        replace_bytes(self.fs, self.path(name), data, self.local)

    def write_text(self, name: str, text: str) -> None:
        self.write_bytes(name, text.encode("utf-8"))

    def write_json(self, name: str, obj: Any, indent: int | None = 1) -> None:
        self.write_bytes(name, json_bytes(obj, indent))

    def put_files(self, local_dir: str, name: str) -> None:
        """Copies every file of the local directory `local_dir` into `name`/ (the console's logs and the
        TensorBoard event files of a remote run); tries them all, then raises the first failure."""
        self.makedirs(name)
        failure = None
        for entry in sorted(os.listdir(local_dir)):
            try:
                self.fs.put_file(os.path.join(local_dir, entry), self.path(name, entry))
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    # ---- JSON lines --------------------------------------------------------------------------------
    def appender(self, name: str) -> "Appender":
        """A writer of records to `name` (one per writing object: on object stores it owns a part)."""
        return Appender(self, name)

    def read_records(self, name: str, problems: list[str] | None = None) -> list[dict[str, Any]] | None:
        """Every record of `name` and its per-writer parts (parts in creation order); None if there is no
        such file at all. Lines that are not JSON objects are skipped: a torn last line silently, others
        noted in `problems` (or warned about when it is None)."""
        sources = []
        try:
            sources.append((name, self.read_bytes(name)))
        except (FileNotFoundError, IsADirectoryError):
            pass
        for part in (p for p in self.list(f"{name}.d") if p.endswith(".jsonl")):
            try:
                sources.append((f"{name}.d/{part}", self.read_bytes(f"{name}.d/{part}")))
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
                value = _record(line)
                if value is not None:
                    records.append(value)
                elif number < len(lines) or data.endswith(b"\n"):  # not a write still in flight
                    message = f"{source}:{number}: not a JSON record (a torn line?), skipped"
                    if problems is None:
                        warnings.warn(message, RuntimeWarning, stacklevel=2)
                    else:
                        problems.append(message)
        return records

    def tail(self, name: str, from_end: bool = False) -> "Tail":
        """A reader of the records appended to `name` since its last call (`from_end`: only those
        appended after it was made)."""
        return Tail(self, name, from_end)

    # ---- the lease's primitives (local storage) ----------------------------------------------------
    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """`flock` on the run directory for the block (local storage: serialises read-decide-write steps
        of processes on this host; it does not span NFS clients). A no-op on remote storage, which has no
        lock to take."""
        if not self.local:
            yield
            return
        os.makedirs(self.root, exist_ok=True)
        fd = os.open(self.root, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def create_json_exclusive(self, name: str, obj: Any) -> bool:
        """Local storage: `name` appears with `obj` as JSON, complete, and only if it does not exist yet (a
        complete temporary file hard-linked to it); False if it exists. Object stores have no exclusive
        create: io.UnsupportedOperation."""
        if not self.local:
            raise io.UnsupportedOperation(f"{redact(self.join(name))}: remote storage has no exclusive create")
        path = self.path(name)
        tmp = f"{path}.{secrets.token_hex(8)}.tmp"
        replace_bytes(self.fs, tmp, json_bytes(obj), True)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)


def _record(line: str | bytes) -> dict[str, Any] | None:
    """The JSON object on one line, or None (not JSON, torn, or JSON but not an object)."""
    try:
        value = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


class Appender:
    """Appends JSON-lines records to one file of a run directory: one O_APPEND write per line locally,
    one part of its own rewritten whole (one PUT) per line remotely (module docstring)."""

    def __init__(self, store: RunStore, name: str):
        self.store, self.name = store, name
        self.part = None if store.local else store.path(f"{name}.d/{writer_id()}.jsonl")
        self.lines: list[str] = []  # remote: the part's content so far

    def append(self, record: dict[str, Any]) -> None:
        self.append_line(json.dumps(record))

    def append_line(self, line: str) -> None:
        """`line` (one JSON object, already serialised, no newline) as the file's next line."""
        if self.part is None:
            append_line(self.store.path(self.name), line)
            return
        fs = self.store.fs
        if not self.lines:  # object stores: a no-op; file systems with directories need it
            fs.makedirs(fs._parent(self.part), exist_ok=True)
        self.lines.append(line)
        fs.pipe_file(self.part, ("\n".join(self.lines) + "\n").encode())  # the whole part, one PUT


class Tail:
    """The records appended to one JSON-lines file since the last `new()`: by byte offset locally (a line
    still being written waits for its newline); remotely, the merged parts read again, skipping what was
    seen. Lines that are not JSON objects are skipped silently."""

    def __init__(self, store: RunStore, name: str, from_end: bool = False):
        self.store, self.name = store, name
        self.offset, self.pending, self.count = 0, b"", 0
        if from_end:  # only what is appended from now on (a resumed run's earlier records are not news)
            if store.local:
                path = store.path(name)
                self.offset = os.path.getsize(path) if os.path.exists(path) else 0
            else:
                self.count = len(store.read_records(name, problems=[]) or [])

    def new(self) -> list[dict[str, Any]]:
        if not self.store.local:
            records = self.store.read_records(self.name, problems=[]) or []
            out, self.count = records[self.count:], len(records)
            return out
        try:
            with open(self.store.path(self.name), "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self.pending + data).split(b"\n")
        self.pending = lines.pop()  # a line still being written
        return [r for r in map(_record, lines) if r is not None]
