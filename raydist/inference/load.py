"""A trained or pretrained model in this one process, for `raydist eval`, `generate` and `export`.

MODEL is a run directory (its newest committed checkpoint, or `--step N`) or `hf:DIR`. A run's model is
rebuilt from its config.toml (with its [peft] adapters) and its weights are read from the DCP checkpoint
in this one process: the checkpoint is keyed by unsharded names whatever layout wrote it (FSDP, TP, PP),
so DCP's reader reassembles every tensor from the shards (only the `model.*` entries are read, not the
optimizer state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raydist.checkpoint import storage
from raydist.config import RUN_FACTS, Config, ConfigError, ModelConfig, RunFacts, hf_dir_of, read_run_config
from raydist.models import hf
from raydist.models.gpt import GPT, build_model
from raydist.models.peft import apply_peft
from raydist.store.run_store import RunStore


@dataclass
class LoadedModel:
    model: GPT
    cfg: Config | None  # the run's config (None for hf:DIR)
    step: int | None  # the checkpoint's step (None for hf:DIR)
    source: str


def read_run_facts(run_dir: str) -> RunFacts | None:
    """What the driver resolved for the run (RUN_DIR/run.json: its data path, storage and name), or None for
    a run directory written before run.json existed (its config.toml then held them)."""
    raw = RunStore(run_dir).read_json(RUN_FACTS)
    return None if raw is None else RunFacts.from_dict(raw)


def find_checkpoint(run_dir: str, step: int | None = None) -> tuple[int, str, dict]:
    """(step, uri, COMMIT.json) of the newest committed checkpoint with every file at its size (or of `step`)."""
    dirs = storage.list_step_dirs(storage.join(run_dir, "checkpoints"))
    for s, uri in reversed(dirs):
        if step is not None and s != step:
            continue
        commit = storage.read_commit(uri)
        if commit is not None and storage.check_sizes(uri, commit) is None:
            return s, uri, commit
    have = [s for s, _ in dirs]
    what = f"checkpoint step {step}" if step is not None else "committed checkpoint"
    raise ConfigError(f"{run_dir} has no usable {what} (steps present: {have or 'none'}); "
                      "check it with `raydist verify RUN_DIR`" + (" or pick a --step from those" if have else ""))


def load_checkpoint_model(model: torch.nn.Module, uri: str, commit: dict) -> None:
    """Read the model's tensors of checkpoint `uri` into `model` (one process, any layout that wrote it)."""
    import torch.distributed.checkpoint as dcp

    stored = storage.SafeReader(uri, chunks=commit.get("chunks")).read_metadata().state_dict_metadata
    state = {n: t for n, t in model.state_dict().items() if f"model.{n}" in stored}
    missing = sorted(n for n in model.state_dict() if f"model.{n}" not in stored
                     and not (n == "output.weight" and model.tied))
    if missing:
        raise ConfigError(f"checkpoint {uri} lacks {missing[:5]}: written by a different model or [peft] "
                          "than the run's config.toml describes")
    dcp.load({"model": state}, storage_reader=storage.SafeReader(uri, chunks=commit.get("chunks")), no_dist=True)


def load_model(spec: str, max_seq_len: int, step: int | None = None) -> LoadedModel:
    """MODEL = a run directory or hf:DIR, in fp32 on the CPU, in eval mode."""
    if spec.startswith("hf:"):
        path = hf_dir_of(spec)
        model = build_model(ModelConfig(**hf.model_config_from_hf(path)), max_seq_len, seed=0)
        hf.load_hf_into(model, path)
        return LoadedModel(model.eval(), None, None, spec)
    cfg = read_run_config(spec)
    found_step, uri, commit = find_checkpoint(spec, step)
    model = build_model(cfg.model, max(max_seq_len, cfg.data.seq_len), cfg.train.seed)
    apply_peft(model, cfg.peft, cfg.train.seed)
    load_checkpoint_model(model, uri, commit)
    return LoadedModel(model.eval(), cfg, found_step, spec)

