"""The compatibility record: what a checkpoint can only be resumed with.

Every checkpoint's `run` part carries `compat`:

    model      every [model] key that changes the parameters' shapes or their meaning (not init_std,
               which only matters before step 0, nor init_from)
    seq_len    the sample length (the data position counts samples of this length)
    tokenizer  the prepared data's tokenizer (ids mean something only with it)
    data       a fingerprint of the training split's layout (shards, rows, window): the data position is
               a global sample index into exactly this sequence
    seed       the sample order is a pure function of (seed, epoch)
    peft       [peft] method and the settings that shape or scale what it trains: lora_rank, lora_alpha and
               lora_targets for `lora` (the adapters' shapes, names and scale), trainable_last_layers for
               `freeze` (which parameters the optimizer state belongs to)

Resuming with a different value for any of these would silently train another model or read other
samples (`num_layers` 4 -> 2 loaded a subset of the parameters, and keep-k then deleted the real model's
checkpoints). The driver refuses it before any worker starts (`check_run_dir`), naming the field; the worker
checks again before loading (a checkpoint written while the driver ran). What may change between attempts:
the layout, the worker count, the learning-rate settings, the number of steps, checkpoint and logging
settings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from raydist.checkpoint import storage
from raydist.checkpoint.storage import EXTRA, join
from raydist.errors import ConfigError

NOT_SHAPE = ("init_std", "init_from")  # [model] keys a resume may change


def data_fingerprint(manifest: dict) -> str:
    """sha256 of the training split's shard list (names, rows, first sample ids), window and row group size
    (which shapes the sample order)."""
    train = manifest["splits"]["train"]
    layout = {"window": manifest.get("window", manifest["seq_len"] + 1),
              "shards": [{k: s.get(k) for k in ("path", "rows", "first_sample_id")} for s in train["shards"]]}
    if manifest.get("row_group_rows", 1) != 1:  # the sample order's block (absent before row groups: 1)
        layout["row_group_rows"] = manifest["row_group_rows"]
    return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()


PEFT_KEYS = {"none": (), "lora": ("lora_rank", "lora_alpha", "lora_targets"), "freeze": ("trainable_last_layers",)}


def peft_record(peft) -> dict[str, Any]:
    """The [peft] settings a checkpoint belongs to (only those of its method: the others are unused)."""
    return {"method": peft.method, **{k: getattr(peft, k) for k in PEFT_KEYS[peft.method]}}


def compat_record(cfg, manifest: dict) -> dict[str, Any]:
    model = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k not in NOT_SHAPE}
    return {"model": model, "seq_len": cfg.data.seq_len, "tokenizer": manifest.get("tokenizer"),
            "data": data_fingerprint(manifest), "seed": cfg.train.seed, "peft": peft_record(cfg.peft)}


def differences(saved: dict, current: dict) -> list[str]:
    """Human-readable differences, each naming the config key: `model.d_model: checkpoint 128, config 64`.
    A key the saved record lacks (written before it was recorded) is not compared."""
    out = []
    for key, value in saved.items():
        mine = current.get(key)
        if key in ("model", "peft") and isinstance(value, dict):
            for name in sorted(set(value) | set(mine or {}), key=lambda n: (n != "method", n)):  # method first
                if value.get(name) != (mine or {}).get(name):
                    out.append(f"{key}.{name}: the checkpoint has {value.get(name)!r}, the config "
                               f"{(mine or {}).get(name)!r}")
        elif value != mine:
            label = {"seq_len": "data.seq_len", "seed": "train.seed", "tokenizer": "the data's tokenizer",
                     "data": "the training data (shards, rows or window)"}.get(key, key)
            shown = (f" (the checkpoint has {value!r}, the config {mine!r})"
                     if key in ("seq_len", "seed") else "")
            out.append(f"{label} differs{shown}")
    return out


def refuse(run_dir: str, step: int, problems: list[str]) -> ConfigError:
    return ConfigError(f"{problems[0]}: the run directory {run_dir} holds checkpoint step {step} of another "
                       "model or data, which cannot be resumed with this config; restore the setting or pick "
                       "another train.run_name" + (f" ({len(problems) - 1} more difference(s))"
                                                   if len(problems) > 1 else ""))


def newest_record(run_dir: str) -> tuple[int, dict] | None:
    """(step, compat) of the newest committed checkpoint whose extra.json matches its commit record, read
    on the driver without a process group; None when there is none (or it predates the record)."""
    for step, uri in reversed(storage.list_step_dirs(join(run_dir, "checkpoints"))):
        commit = storage.read_commit(uri)
        if commit is None or EXTRA not in commit.get("files", {}):
            continue
        if storage.check_sizes(uri, {"files": {EXTRA: commit["files"][EXTRA]}}) is not None:
            continue
        if storage.check_hashes(uri, commit, [EXTRA]) is not None:
            continue
        extra = storage.read_json(join(uri, EXTRA))
        compat = extra.get("parts", {}).get("run", {}).get("compat") if isinstance(extra, dict) else None
        return (step, compat) if compat else None
    return None


def check_run_dir(run_dir: str, cfg, manifest: dict) -> None:
    """The driver's check before any worker starts: a ConfigError if the newest checkpoint in `run_dir` was
    written by an incompatible config."""
    found = newest_record(run_dir)
    if found is None:
        return
    step, saved = found
    problems = differences(saved, compat_record(cfg, manifest))
    if problems:
        raise refuse(run_dir, step, problems)
