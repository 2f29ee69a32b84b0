"""`raydist export RUN_DIR --hf OUT_DIR`: config.json + safetensors (sharded with an index above
--max-shard-size) that `transformers.AutoModelForCausalLM.from_pretrained` loads; LoRA adapters are merged
into their weights (W + alpha/r B A), or with --adapter-only written alone in PEFT's format. The run's model
is loaded by raydist.inference.load from any layout that wrote the checkpoint."""

from __future__ import annotations

import json

import torch

from raydist.config import Config, ConfigError
from raydist.inference.load import load_model
from raydist.models import hf
from raydist.models.gpt import GPT
from raydist.models.peft import LoRALinear, is_adapter, lora_targets


def merged_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """The plain model's state dict: each LoRA projection's weight replaced by W + alpha/r B A."""
    out = {n: t for n, t in model.state_dict().items() if not is_adapter(n)}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LoRALinear):
                out[f"{name}.weight"] = module.merged_weight().detach()
    return out


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
            b = hf.to_hf(f"{name}.weight", module.lora_b.detach(), model.cfg)  # q/k rows: HF's order
            tensors[f"base_model.model.{base}.lora_A.weight"] = module.lora_a.detach().contiguous()
            tensors[f"base_model.model.{base}.lora_B.weight"] = b.contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.peft.lora_rank,
              "lora_alpha": cfg.peft.lora_alpha, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              # each adapted projection's Hugging Face module name (q_proj, gate_proj, ...), from the name table
              "target_modules": sorted(hf.raydist_to_hf_name(f"layers.0.{t}.weight").split(".")[-2]
                                       for t in lora_targets(model.cfg, cfg.peft.lora_targets)),
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
    p = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face directory of its model family")
    p.add_argument("run_dir", help="the run directory (<checkpoint.storage>/<train.run_name>)")
    p.add_argument("--hf", required=True, metavar="OUT_DIR", help="the output directory")
    p.add_argument("--step", type=int, help="this checkpoint instead of the newest")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--max-shard-size-mb", type=float, default=5000.0, help="one file per this many MiB")
    p.add_argument("--adapter-only", action="store_true", help="LoRA runs: only the adapters, in PEFT's format")
    p.set_defaults(func=cmd_export)
