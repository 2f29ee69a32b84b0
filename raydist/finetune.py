"""`raydist eval` and `raydist export`: a trained or pretrained model in one process.

MODEL is a run directory (its newest committed checkpoint, or `--step N`) or `hf:DIR`. A run's model is
rebuilt from its config.toml (with its [peft] adapters) and its weights are read from the DCP checkpoint
in this one process: the checkpoint is keyed by unsharded names whatever layout wrote it (FSDP, TP, PP),
so DCP's reader reassembles every tensor from the shards (only the `model.*` entries are read, not the
optimizer state).

    eval    mean next-token cross-entropy over every row of a prepared split: one JSON line
            {"loss", "tokens", ...}; the same number transformers computes on those tokens
    export  config.json + safetensors (sharded with an index above --max-shard-size) that
            `transformers.AutoModelForCausalLM.from_pretrained` loads; LoRA adapters are merged into
            their weights (W + alpha/r B A), or with --adapter-only written alone in PEFT's format
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raydist.checkpoint import storage
from raydist.config import Config, ConfigError, ModelConfig, hf_dir_of
from raydist.data.sft import IGNORE, split_rows
from raydist.models import hf
from raydist.models.gpt import GPT, build_model
from raydist.peft import LoRALinear, TARGETS, apply_peft, is_adapter


@dataclass
class LoadedModel:
    model: GPT
    cfg: Config | None  # the run's config (None for hf:DIR)
    step: int | None  # the checkpoint's step (None for hf:DIR)
    source: str


def read_run_config(run_dir: str) -> Config:
    """The resolved config a run was launched with (RUN_DIR/config.toml); init_from is dropped (the
    checkpoint holds every weight, the pretrained directory need not exist any more)."""
    import tomllib

    uri = storage.join(run_dir, "config.toml")
    try:
        text = storage.read_text(uri)
    except FileNotFoundError:
        raise ConfigError(f"{run_dir} has no config.toml: not a raydist run directory (MODEL is a run "
                          "directory or hf:DIR)") from None
    return Config.from_dict(tomllib.loads(text), ["model.init_from="])


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


# ---- eval ------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate_split(model: GPT, data_path: str, split: str = "val", batch_rows: int = 16) -> dict:
    """{"loss": mean next-token cross-entropy over every target token of the split (the response tokens of
    prompt/response data), "tokens": their count}."""
    from raydist.data.prepare import read_manifest
    from raydist.data.stream import Split, read_shard

    manifest = read_manifest(data_path)
    if manifest["tokenizer"]["vocab_size"] > model.cfg.vocab_size:
        raise ConfigError(f"{data_path} was tokenized with a vocabulary of {manifest['tokenizer']['vocab_size']} "
                          f"but the model has vocab_size={model.cfg.vocab_size}; prepare the data with the "
                          "model's tokenizer")
    if manifest["seq_len"] > model.max_seq_len:
        raise ConfigError(f"{data_path} has seq_len={manifest['seq_len']}, longer than the model's "
                          f"{model.max_seq_len} positions")
    data = Split.open(data_path, split, manifest)
    total, count = 0.0, 0
    for index in range(len(data.shards)):
        tokens = torch.from_numpy(read_shard(data, index).tokens)
        for rows in tokens.split(batch_rows):
            inputs, targets = split_rows(rows, data.masked)  # prompt/response data: only response targets count
            logits = model(inputs)  # (B, T, V)
            total += float(F.cross_entropy(logits.flatten(0, 1).double(), targets.flatten(), ignore_index=IGNORE,
                                           reduction="sum"))
            count += int((targets != IGNORE).sum())
    return {"loss": total / max(count, 1), "tokens": count}


def cmd_eval(args) -> int:
    from raydist.data.prepare import read_manifest

    manifest = read_manifest(args.data)
    if args.model.startswith("hf:"):  # data made with another tokenizer than DIR's tokenizer.json: refused
        from raydist.models.hf_load import check_data_tokenizer

        check_data_tokenizer(hf_dir_of(args.model), manifest["tokenizer"], args.data)
    seq_len = manifest["seq_len"]
    loaded = load_model(args.model, seq_len, args.step)
    result = evaluate_split(loaded.model, args.data, args.split, args.batch_rows)
    result.update(model=args.model, step=loaded.step, split=args.split, data=args.data)
    print(json.dumps(result))
    return 0


# ---- export ----------------------------------------------------------------------------------------


def merged_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """The plain model's state dict: each LoRA projection's weight replaced by W + alpha/r B A."""
    out = {n: t for n, t in model.state_dict().items() if not is_adapter(n)}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LoRALinear):
                out[f"{name}.weight"] = module.merged_weight().detach()
    return out


HF_PROJ = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
           "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
           "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj"}


def save_peft_adapter(model: GPT, cfg: Config, out_dir: str) -> list[str]:
    """PEFT's LoRA adapter format: adapter_config.json + adapter_model.safetensors with
    `base_model.model.<HF module>.lora_A.weight` (r x in) and `.lora_B.weight` (out x r); B's rows of q/k
    carry the same rotary permutation as their base weights."""
    from pathlib import Path

    from safetensors.torch import save_file

    if cfg.peft.method != "lora":
        raise ConfigError(f"--adapter-only needs a run trained with peft.method='lora' (it has "
                          f"{cfg.peft.method!r}); export the whole model without it")
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            base = hf.raydist_to_hf_name(f"{name}.weight").removesuffix(".weight")
            b = hf.to_hf(f"{name}.weight", module.lora_b.detach(), model.cfg)  # rows of wq/wk: HF's order
            tensors[f"base_model.model.{base}.lora_A.weight"] = module.lora_a.detach().contiguous()
            tensors[f"base_model.model.{base}.lora_B.weight"] = b.contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.peft.lora_rank,
              "lora_alpha": cfg.peft.lora_alpha, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "target_modules": sorted(HF_PROJ[t].split(".")[1] for t in TARGETS[cfg.peft.lora_targets]),
              "base_model_name_or_path": "", "inference_mode": True, "modules_to_save": None}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return ["adapter_model.safetensors", "adapter_config.json"]


def cmd_export(args) -> int:
    loaded = load_model(args.run_dir, 0, args.step)
    if loaded.cfg is None:
        raise ConfigError("export reads a run directory (hf:DIR is already a Hugging Face model)")
    if args.adapter_only:
        written = save_peft_adapter(loaded.model, loaded.cfg, args.hf)
    else:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
        written = hf.save_hf(merged_state_dict(loaded.model), loaded.model.cfg, args.hf,
                             max_shard_bytes=args.max_shard_size_mb * 2**20, dtype=dtype,
                             max_position_embeddings=max(loaded.cfg.data.seq_len, 2048))
    print(json.dumps({"exported": args.hf, "step": loaded.step, "files": written}))
    return 0


def register_cli(sub) -> None:
    p = sub.add_parser("eval", help="mean token cross-entropy of a run's checkpoint or hf:DIR on a prepared split")
    p.add_argument("model", help="a run directory (its newest committed checkpoint) or hf:DIR")
    p.add_argument("--data", required=True, help="prepared data (a directory or URI holding manifest.json)")
    p.add_argument("--split", default="val", choices=("train", "val"))
    p.add_argument("--step", type=int, help="this checkpoint of the run instead of the newest")
    p.add_argument("--batch-rows", type=int, default=16, help="rows per forward")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face Llama directory")
    p.add_argument("run_dir", help="the run directory (<checkpoint.storage>/<train.run_name>)")
    p.add_argument("--hf", required=True, metavar="OUT_DIR", help="the output directory")
    p.add_argument("--step", type=int, help="this checkpoint instead of the newest")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--max-shard-size-mb", type=float, default=5000.0, help="one file per this many MiB")
    p.add_argument("--adapter-only", action="store_true", help="LoRA runs: only the adapters, in PEFT's format")
    p.set_defaults(func=cmd_export)

