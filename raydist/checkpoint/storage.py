"""Checkpoint files on any fsspec URI: the DCP reader/writer, the commit marker and its checksums.

A checkpoint directory `step_NNNNNNNN/` holds raw chunk files (`__R_I.raw`, rawio.py; `__R_I.distcp` in
checkpoints of earlier versions, read back with `torch.load(weights_only=True)`), DCP's `.metadata`, our
`extra.json` (the stateful parts' JSON) and, written last, `COMMIT.json`:

    {"step": 100, "files": {"<name>": {"size": bytes, "crc32": int}, ...},
     "chunks": {"<raw file>": {"<offset>": crc32, ...}}, "time": unix seconds}

A directory without COMMIT.json is partial (a crash during the write) and never loaded. A file whose size
differs from COMMIT.json is corrupt (e.g. truncated) and skipped when looking for the newest checkpoint; a
chunk whose bytes changed fails its checksum while it is read, and loading falls back to an older
checkpoint. `raydist verify RUN_DIR` checks every file in full. extra.json and COMMIT.json are written
atomically (`raydist.store.atomic`), and a directory is deleted COMMIT.json first (`remove_dir`), so no crash
leaves a directory that looks committed but is not.

DCP writes `.metadata` with pickle. A checksum proves integrity, not authorship (whoever can write the
storage can rewrite COMMIT.json too), so `.metadata` is read through an unpickler that resolves only an
exact list of (module, name) pairs: DCP's metadata dataclasses, torch.Size, the dtypes and torch's layout
helper. Nothing else, and no dotted names (pickle protocol 4 resolves `os.system` inside any module that
imports `os`). A metadata that lists a non-tensor (bytes) entry is refused too: DCP reads those with
`torch.load(weights_only=False)`, and raydist never writes one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import pickle
import re
import time
import zlib

import fsspec
import torch
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from raydist.checkpoint.rawio import RawReader, RawWriter
from raydist.store.atomic import write_bytes_atomic, write_json_atomic
from raydist.store.redact import redact

COMMIT = "COMMIT.json"
EXTRA = "extra.json"
STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def join(root: str, *names: str) -> str:
    return "/".join([root.rstrip("/"), *names])


def sha256_file(fs, path: str, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def list_files(uri: str) -> list[str]:
    """File names (not paths) directly inside `uri`, sorted."""
    fs, root = fsspec.core.url_to_fs(uri)
    if not fs.exists(root):
        return []
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)
                  if fs.isfile(p))


def list_step_dirs(checkpoints_uri: str) -> list[tuple[int, str]]:
    """[(step, uri)] of every step_* directory, oldest first (committed or not)."""
    fs, root = fsspec.core.url_to_fs(checkpoints_uri)
    if not fs.exists(root):
        return []
    out = []
    for path in fs.ls(root, detail=False):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        match = STEP_DIR.match(name)
        if match and fs.isdir(path):
            out.append((int(match.group(1)), join(checkpoints_uri, name)))
    return sorted(out)


def write_json(uri: str, obj) -> None:
    write_json_atomic(uri, obj)  # a reader never sees half a COMMIT.json or extra.json


def write_json_recorded(uri: str, obj) -> dict:
    """`write_json`, returning the file's {size, crc32} for the commit record (from the bytes written, not
    read back)."""
    data = json.dumps(obj, indent=1).encode("utf-8")
    write_bytes_atomic(uri, data)
    return {"size": len(data), "crc32": zlib.crc32(data)}


def read_json(uri: str):
    fs, path = fsspec.core.url_to_fs(uri)
    with fs.open(path, "r") as f:
        return json.load(f)


def read_text(uri: str) -> str:
    fs, path = fsspec.core.url_to_fs(uri)
    with fs.open(path, "r") as f:
        return f.read()


def crc32_file(fs, path: str, chunk: int = 8 << 20) -> tuple[int, int]:
    """(size, CRC-32) of a file, read once."""
    crc, size = 0, 0
    with fs.open(path, "rb") as f:
        while block := f.read(chunk):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return size, crc


def file_digests(ckpt_uri: str, names: list[str]) -> dict[str, dict]:
    """{name: {size, crc32}} of small files written outside the tensor writer (.metadata, extra.json)."""
    fs, root = fsspec.core.url_to_fs(ckpt_uri)
    out = {}
    for name in names:
        size, crc = crc32_file(fs, f"{root}/{name}")
        out[name] = {"size": size, "crc32": crc}
    return out


def write_commit(ckpt_uri: str, step: int, files: dict[str, dict], chunks: dict | None = None) -> None:
    """COMMIT.json, written last: {step, files: {name: {size, crc32}}, chunks: {file: {offset: crc32}}, time}."""
    record = {"step": step, "files": files, "time": time.time()}
    if chunks is not None:
        record["chunks"] = chunks
    write_json(join(ckpt_uri, COMMIT), record)


def read_commit(ckpt_uri: str) -> dict | None:
    fs, root = fsspec.core.url_to_fs(ckpt_uri)
    if not fs.exists(f"{root}/{COMMIT}"):
        return None
    try:
        commit = read_json(join(ckpt_uri, COMMIT))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return commit if isinstance(commit, dict) and "files" in commit else None


def check_sizes(ckpt_uri: str, commit: dict) -> str | None:
    """None if every committed file exists with its size, else what is wrong (one listing, not a request
    per file: on object stores this runs for every kept checkpoint at each save)."""
    fs, root = fsspec.core.url_to_fs(ckpt_uri)
    fs.invalidate_cache(root)
    try:
        listed = {p["name"].rstrip("/").rsplit("/", 1)[-1]: p.get("size") for p in fs.ls(root, detail=True)}
    except FileNotFoundError:
        listed = {}
    for name, info in commit["files"].items():
        if name not in listed:
            return f"{name} is missing"
        size = listed[name]
        if size != info["size"]:
            return f"{name} has {size} bytes, the commit says {info['size']} (truncated or overwritten)"
    return None


def check_hashes(ckpt_uri: str, commit: dict, names: list[str]) -> str | None:
    """None if every file in `names` matches its recorded CRC-32 (or SHA-256, in commits of earlier
    versions), else what is wrong. Reads the files in full: `raydist verify`, not the load path."""
    fs, root = fsspec.core.url_to_fs(ckpt_uri)
    for name in names:
        info = commit["files"][name]
        if "crc32" in info:
            ok = crc32_file(fs, f"{root}/{name}")[1] == info["crc32"]
        else:
            ok = sha256_file(fs, f"{root}/{name}") == info["sha256"]
        if not ok:
            return f"{name} does not match its checksum"
    return None


def remove_dir(uri: str) -> None:
    """Deletes a checkpoint directory, its COMMIT.json first: a crash half-way through leaves a partial
    directory (skipped quietly, deleted later), never a committed one with files missing."""
    fs, root = fsspec.core.url_to_fs(uri)
    if fs.exists(f"{root}/{COMMIT}"):
        fs.rm(f"{root}/{COMMIT}")
    if fs.exists(root):
        fs.rm(root, recursive=True)


class _StreamErrors(FileSystem):
    """DCP's fsspec file system, with write streams that keep the OSError a `write` raised: torch.save's
    zip writer swallows it and fails later with "unexpected pos N vs M", so a full disk (ENOSPC) would
    surface as that. The kept error is raised instead (DCP then reports it from every rank)."""

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as stream:
            if not any(c in mode for c in "wa+"):
                yield stream
                return
            recording = _RecordingStream(stream)
            try:
                yield recording
            except Exception as exc:
                if recording.error is not None and recording.error is not exc:
                    raise recording.error from exc
                raise


class _RecordingStream:
    def __init__(self, stream):
        self._stream, self.error = stream, None

    def write(self, data):
        try:
            return self._stream.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _Writer(RawWriter):
    """DCP's fsspec writer: write errors kept (`_StreamErrors`), and the checkpoint id it records in
    `.metadata` redacted (the real URI may carry credentials, and `.metadata` is written to storage)."""

    def __init__(self, path: str, **kwargs):
        super().__init__(path, **kwargs)
        self.fs = _StreamErrors()
        self.path = self.fs.init_path(path)

    def storage_meta(self) -> StorageMeta | None:
        meta = super().storage_meta()
        if meta is not None and isinstance(meta.checkpoint_id, str):
            meta.checkpoint_id = redact(meta.checkpoint_id)
        return meta


def writer(ckpt_uri: str, thread_count: int = 2) -> RawWriter:
    """Raw chunk files written by `thread_count` threads per rank (rawio.py)."""
    return _Writer(ckpt_uri, thread_count=thread_count)


class SafeReader(RawReader):
    """The raw-chunk reader (checksums checked while reading when the commit's `chunks` are given), reading
    `.metadata` with the allowlist unpickler and refusing bytes entries."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f, path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_metadata(stream, path: str) -> Metadata:
    """DCP `Metadata` from `stream`, resolving only `_ALLOWED`; raises `UnsafeCheckpointError`."""
    try:
        metadata = _MetadataUnpickler(stream).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # a torn or foreign file: not loadable, and not code
        raise UnsafeCheckpointError(f"{path}: not readable DCP metadata ({exc})") from exc
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise UnsafeCheckpointError(f"{path}: not DCP metadata")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise UnsafeCheckpointError(
                f"{path}: entry {key!r} is {type(entry).__name__}, not a tensor; raydist writes only tensors "
                "(DCP would read it with torch.load(weights_only=False))")
    return metadata


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint's metadata names something outside the allowlist: refused, never executed."""


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {(_DCP_METADATA, name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                        "TensorStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
       ("torch.serialization", "_get_layout")}
    | {("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)})


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise UnsafeCheckpointError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")
        return super().find_class(module, name)
