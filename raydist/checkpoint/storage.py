"""Checkpoint files on any fsspec URI: the DCP reader/writer, the commit marker and its checksums.

A checkpoint directory `step_NNNNNNNN/` holds DCP's shard files (`__R_I.distcp`, tensors only, read back
with `torch.load(weights_only=True)`), DCP's `.metadata`, our `extra.json` (step, data position, LR
schedule, RNG, optimizer hyper-parameters) and, written last, `COMMIT.json`:

    {"step": 100, "files": {"<name>": {"size": bytes, "sha256": hex}, ...}, "time": unix seconds}

A directory without COMMIT.json is partial (a crash during the write) and never loaded. A file whose size
or hash differs from COMMIT.json is corrupt (e.g. truncated); loading falls back to an older checkpoint.

DCP writes `.metadata` with pickle. We only unpickle it after its checksum matched, and then through an
unpickler that admits nothing but DCP's metadata classes, torch.Size and dtypes.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import time

import fsspec
import torch
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

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
    fs, path = fsspec.core.url_to_fs(uri)
    with fs.open(path, "w") as f:
        json.dump(obj, f, indent=1)


def read_json(uri: str):
    fs, path = fsspec.core.url_to_fs(uri)
    with fs.open(path, "r") as f:
        return json.load(f)


def file_digests(ckpt_uri: str, names: list[str]) -> dict[str, dict]:
    fs, root = fsspec.core.url_to_fs(ckpt_uri)
    return {name: {"size": fs.size(f"{root}/{name}"), "sha256": sha256_file(fs, f"{root}/{name}")} for name in names}


def write_commit(ckpt_uri: str, step: int, files: dict[str, dict]) -> None:
    write_json(join(ckpt_uri, COMMIT), {"step": step, "files": files, "time": time.time()})


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
    """None if every committed file exists with its size, else what is wrong."""
    fs, root = fsspec.core.url_to_fs(ckpt_uri)
    for name, info in commit["files"].items():
        path = f"{root}/{name}"
        if not fs.exists(path):
            return f"{name} is missing"
        size = fs.size(path)
        if size != info["size"]:
            return f"{name} has {size} bytes, the commit says {info['size']} (truncated or overwritten)"
    return None


def check_hashes(ckpt_uri: str, commit: dict, names: list[str]) -> str | None:
    fs, root = fsspec.core.url_to_fs(ckpt_uri)
    for name in names:
        if sha256_file(fs, f"{root}/{name}") != commit["files"][name]["sha256"]:
            return f"{name} does not match its checksum"
    return None


def writer(ckpt_uri: str) -> FsspecWriter:
    return FsspecWriter(ckpt_uri, sync_files=True, thread_count=1, overwrite=True)


class SafeReader(FsspecReader):
    """DCP's fsspec reader, reading `.metadata` with the allowlist unpickler and refusing bytes entries."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f, path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_metadata(stream, path: str) -> Metadata:
    """DCP `Metadata` from `stream`, resolving only `_ALLOWED`; raises `UnsafeCheckpointError`.

    COMMIT.json's checksums prove integrity, not authorship: whoever can write the storage can rewrite
    them too, so the loader itself admits exactly DCP's metadata classes, torch dtypes and `torch.Size`.
    A name-prefix rule is not enough: under pickle protocol 4 a global may be dotted, and
    `torch.distributed.checkpoint.filesystem` imports `os`, so `os.system` would resolve through it."""
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
