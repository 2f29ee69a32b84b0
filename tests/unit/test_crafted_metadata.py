"""A crafted checkpoint `.metadata` must never run code on resume.

DCP writes `.metadata` with pickle. An attacker who can write the storage can also rewrite COMMIT.json, so
its checksums prove nothing here: the loader itself must refuse anything but DCP's metadata classes.
"""

import hashlib
import io
import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from raydist.checkpoint import storage
from raydist.testing import run_fit, tiny_config


def _global(module: str, name: str) -> bytes:
    def text(s: str) -> bytes:
        raw = s.encode()
        return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE

    return text(module) + text(name) + b"\x93"  # STACK_GLOBAL


def call_payload(module: str, name: str, argument: str) -> bytes:
    """Protocol-4 pickle of `module.name(argument)`; `name` may be dotted (`os.system`)."""
    arg = argument.encode()
    return (b"\x80\x04" + _global(module, name) + b"\x8c" + bytes([len(arg)]) + arg
            + b"\x85" + b"R" + b".")  # TUPLE1, REDUCE, STOP


def test_the_payload_is_live_under_plain_pickle(tmp_path):
    """The crafted bytes do run code under an unrestricted unpickler: the refusals below are meaningful."""
    marker = tmp_path / "pwned"
    pickle.loads(call_payload("torch.distributed.checkpoint.filesystem", "os.system", f"touch {marker}"))
    assert marker.exists()


@pytest.mark.parametrize("module,name", [
    ("torch.distributed.checkpoint.filesystem", "os.system"),  # dotted name through a module importing os
    ("torch.distributed.checkpoint.metadata", "os.system"),
    ("builtins", "eval"),
    ("os", "system"),
    ("torch", "load"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
])
def test_refused_names(tmp_path, module, name):
    marker = tmp_path / "pwned"
    with pytest.raises(storage.UnsafeCheckpointError, match="not allowed"):
        storage.load_metadata(io.BytesIO(call_payload(module, name, f"touch {marker}")), "crafted")
    assert not marker.exists()


def _real_metadata(tmp_path):
    sd = {"model": {"w": torch.randn(3, 4), "h": torch.zeros(2, dtype=torch.bfloat16)}}
    dcp.save(sd, storage_writer=storage.writer(str(tmp_path / "ck")), no_dist=True)
    return (tmp_path / "ck" / ".metadata").read_bytes()


def test_real_metadata_loads(tmp_path):
    metadata = storage.load_metadata(io.BytesIO(_real_metadata(tmp_path)), "real")
    assert set(metadata.state_dict_metadata) == {"model.w", "model.h"}


def test_bytes_entry_refused(tmp_path):
    """A bytes entry would be read with torch.load(weights_only=False): refused even if it unpickles."""
    metadata = pickle.loads(_real_metadata(tmp_path))
    metadata.state_dict_metadata["model.w"] = BytesStorageMetadata()
    with pytest.raises(storage.UnsafeCheckpointError):
        storage.load_metadata(io.BytesIO(pickle.dumps(metadata, protocol=4)), "crafted")


def test_resume_from_crafted_checkpoint_runs_no_code(tiny_data, tmp_path):
    """End to end: a committed checkpoint whose .metadata (and COMMIT.json, re-hashed) an attacker rewrote."""
    run_dir = str(tmp_path / "run")
    raw = tiny_config(tiny_data, train={"steps": 2, "global_batch": 2, "micro_batch": 1},
                      checkpoint={"every_steps": 2, "keep": 2, "async_save": False})
    run_fit(raw, 1, run_dir)
    ckpt = os.path.join(run_dir, "checkpoints", storage.step_dir_name(2))
    marker = tmp_path / "pwned"
    crafted = call_payload("torch.distributed.checkpoint.filesystem", "os.system", f"touch {marker}")
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        f.write(crafted)
    commit_path = os.path.join(ckpt, storage.COMMIT)
    commit = json.load(open(commit_path))
    commit["files"][".metadata"] = {"size": len(crafted), "sha256": hashlib.sha256(crafted).hexdigest()}
    json.dump(commit, open(commit_path, "w"))

    raw["train"]["steps"] = 4
    with pytest.raises(RuntimeError, match="os.system, which is not allowed"):
        run_fit(raw, 1, run_dir)
    assert not marker.exists()
