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
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

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
    """DCP's fsspec reader, reading `.metadata` with an allowlist unpickler."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path}: not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module in _ALLOWED_MODULES and not name.startswith("__"):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")
