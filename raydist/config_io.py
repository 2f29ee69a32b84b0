"""TOML in and out for `raydist.config`: reading files, `--set section.key=value` overrides, typed section
construction, writing the resolved config back, and the field docs read from config.py's source (the
README's reference table)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from raydist.config_sections import CHOICES, SECTIONS
from raydist.errors import ConfigError
from raydist.families.registry import FAMILIES, family_for_hf

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found; pass an existing TOML file "
                          "(e.g. workloads/gpt_tiny.toml)")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def parse_override(item: str) -> tuple[str, str, Any]:
    """`section.key=value` -> (section, key, value); the value is parsed as a TOML value when it can be,
    else kept as a bare string (so `--set checkpoint.storage=/tmp/x` needs no quotes)."""
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.steps=100)")
    dotted, text = item.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    return section, key.strip(), value


def build_section(name: str, values: dict[str, Any]):
    cls = SECTIONS[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            near = _closest(key, fields)
            hint = f"; did you mean {name}.{near}?" if near else f"; valid keys: {', '.join(fields)}"
            raise ConfigError(f"unknown key {name}.{key}{hint}")
        kwargs[key] = _coerce(f"{name}.{key}", value, fields[key].type)
    return cls(**kwargs)


def _coerce(dotted: str, value: Any, annotation: str) -> Any:
    kind = {"int": int, "float": float, "bool": bool, "str": str}[annotation]
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    else:
        if isinstance(value, bool) and dotted in CHOICES:  # use_gpu = true in TOML
            value = str(value).lower()
        if isinstance(value, str):
            if dotted in CHOICES and value not in CHOICES[dotted]:
                raise ConfigError(f"{dotted}={value!r} is not one of {', '.join(CHOICES[dotted])}")
            return value
    example = {"int": "4", "float": "0.5", "bool": "true", "str": "'text'"}[annotation]
    raise ConfigError(f"{dotted}={value!r} has the wrong type: expected {annotation} (e.g. {dotted}={example})")


def _closest(key: str, options) -> str | None:
    import difflib

    match = difflib.get_close_matches(key, list(options), n=1, cutoff=0.6)
    return match[0] if match else None


def dump_toml(sections: dict[str, dict[str, Any]]) -> str:
    """Writes the flat two-level tables this config uses (scalars only)."""
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            return {math.inf: "inf", -math.inf: "-inf"}.get(value, "nan")
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"cannot write {value!r} as TOML")


@functools.lru_cache(maxsize=1)
def field_docs() -> dict[str, str]:
    """{'section.key': docstring} parsed from the attribute docstrings of the section classes."""
    modules = dict.fromkeys(sys.modules[cls.__module__] for cls in SECTIONS.values())
    nodes = [node for module in modules for node in ast.parse(inspect.getsource(module)).body]
    class_to_section = {cls.__name__: name for name, cls in SECTIONS.items()}
    docs = {}
    for node in nodes:
        if isinstance(node, ast.ClassDef) and node.name in class_to_section:
            body = node.body
            for stmt, nxt in zip(body, body[1:]):
                if (isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                        and isinstance(getattr(nxt, "value", None), ast.Constant)):
                    doc = " ".join(str(nxt.value.value).split())
                    docs[f"{class_to_section[node.name]}.{stmt.target.id}"] = doc
    return docs


def reference_markdown() -> str:
    """The README's config reference: one table per section, from the dataclasses and docstrings."""
    docs = field_docs()
    out = []
    for name, cls in SECTIONS.items():
        out.append(f"### [{name}]\n\n| key | default | meaning |\n| --- | --- | --- |")
        for f in dataclasses.fields(cls):
            default = _toml_value(f.default)
            choices = CHOICES.get(f"{name}.{f.name}")
            doc = docs[f"{name}.{f.name}"]
            out.append(f"| `{f.name}` | `{default}` | {doc}" + (f" One of {', '.join(choices)}." if choices and
                                                                  "`" not in doc else "") + " |")
        out.append("")
    return "\n".join(out)


# ---- config.json -----------------------------------------------------------------------------------------

# ModelConfig field -> config.json key, for the fields read from config.json.
HF_CONFIG_KEYS = {"family": "model_type", "head_dim": "head_dim",
                  "vocab_size": "vocab_size", "d_model": "hidden_size", "num_layers": "num_hidden_layers",
                  "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
                  "ffn_hidden": "intermediate_size", "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps",
                  "tie_embeddings": "tie_word_embeddings", "moe_experts": "num_experts",
                  "moe_top_k": "num_experts_per_tok", "moe_ffn_hidden": "moe_intermediate_size",
                  "moe_norm_topk": "norm_topk_prob"}


def _read_config(hf_dir_or_config: str | os.PathLike | Mapping) -> tuple[dict[str, Any], str]:
    """(config.json as a dict, its path for messages); a dict is taken as is, a directory or file is read."""
    if isinstance(hf_dir_or_config, Mapping):
        return dict(hf_dir_or_config), "config.json"
    path = Path(hf_dir_or_config)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"{path} not found; a Hugging Face model directory holds config.json and "
                          "*.safetensors (save_pretrained writes them)")
    return json.loads(path.read_text()), str(path)


def model_config_from_hf(hf_dir_or_config_dict: str | os.PathLike | Mapping) -> dict[str, Any]:
    """ModelConfig field values from a Llama config.json; ConfigError for anything raydist cannot represent.

    Handles both the transformers 4 keys (`rope_theta`, `rope_scaling`) and the transformers 5 ones
    (`rope_parameters` = {rope_type, rope_theta}). Absent optional keys take LlamaConfig's defaults.
    """
    c, src = _read_config(hf_dir_or_config_dict)
    family = family_for_hf(model_type := c.get("model_type"))
    if family is None:
        raise ConfigError(f"{src} model_type={model_type!r} is not supported; raydist loads model_type "
                          f"{', '.join(repr(f.hf_model_type) for f in FAMILIES.values())} (raydist.families.registry)")
    if (window := family.sliding_window_on(c)) is not None:
        key, off = family.sliding_window_key[0], "false" if family.sliding_window_key[1] is False else "null"
        raise ConfigError(f"{src} {window}: raydist has no sliding-window attention; only {model_type} "
                          f"checkpoints with {key} {off} load")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if not isinstance(c.get(key), int):
            raise ConfigError(f"{src} {key}={c.get(key)!r} must be an integer; add it to config.json")
    d, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or 0
    if head_dim and head_dim * heads == d:
        head_dim = 0  # the default: d_model / num_heads
    if not head_dim and d % heads:
        raise ConfigError(f"{src} hidden_size={d} is not divisible by num_attention_heads={heads} and head_dim "
                          "is not set; add head_dim to config.json")
    # Qwen2's q/k/v biases are its family's (no key says so); elsewhere a bias is a key raydist has no layer for
    for key in (k for k in ("attention_bias", "mlp_bias") if c.get(k)):
        raise ConfigError(f"{src} {key}=true: raydist's {model_type} layers have no such biases; only "
                          f"checkpoints with {key} false load")
    if c.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"{src} hidden_act={c['hidden_act']!r}: raydist's MLP is SwiGLU (silu); only "
                          "hidden_act 'silu' loads")
    rope = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or rope
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":
        key = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
        raise ConfigError(f"{src} {key} has rope_type={rope_type!r}: raydist has no RoPE scaling yet; only "
                          "checkpoints with plain RoPE (rope_scaling null, rope_type 'default') load")
    if rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError(f"{src} partial_rotary_factor != 1: raydist rotates the whole head")
    return {"family": family.name, "vocab_size": c["vocab_size"], "d_model": d, "num_layers": c["num_hidden_layers"],
            "num_heads": heads, "head_dim": head_dim, "num_kv_heads": c.get("num_key_value_heads") or heads,
            "ffn_hidden": c["intermediate_size"],
            "rope_theta": float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            "norm_eps": float(c.get("rms_norm_eps", 1e-6)), "tie_embeddings": bool(c.get("tie_word_embeddings")),
            **(_moe_from_hf(c, src, family.name) if family.moe else {})}


def _moe_from_hf(c: dict[str, Any], src: str, family: str) -> dict[str, Any]:
    """[model]'s mixture-of-experts keys from a Mixtral or Qwen3-MoE config.json."""
    experts = c.get("num_experts", c.get("num_local_experts"))
    if not isinstance(experts, int) or experts < 1 or not isinstance(c.get("num_experts_per_tok"), int):
        raise ConfigError(f"{src} num_experts={experts!r}, num_experts_per_tok={c.get('num_experts_per_tok')!r} must "
                          "be positive integers; add them to config.json")
    if c.get("router_jitter_noise"):
        raise ConfigError(f"{src} router_jitter_noise={c['router_jitter_noise']}: raydist's router adds no noise; "
                          "only checkpoints with router_jitter_noise 0 load")
    if c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1:
        raise ConfigError(f"{src} mlp_only_layers={c.get('mlp_only_layers')}, decoder_sparse_step="
                          f"{c.get('decoder_sparse_step')}: raydist makes every block a mixture of experts; only "
                          "checkpoints with mlp_only_layers [] and decoder_sparse_step 1 load")
    if c.get("shared_expert_intermediate_size"):
        raise ConfigError(f"{src} shared_expert_intermediate_size: {family} checkpoints with a gated shared expert "
                          "do not load (raydist's shared expert has no gate)")
    if family == "mixtral":  # experts are intermediate_size wide and always renormalised
        return {"moe_experts": experts, "moe_top_k": c["num_experts_per_tok"], "moe_ffn_hidden": 0,
                "moe_norm_topk": True}
    if not isinstance(c.get("moe_intermediate_size"), int):
        raise ConfigError(f"{src} moe_intermediate_size={c.get('moe_intermediate_size')!r} must be an integer")
    return {"moe_experts": experts, "moe_top_k": c["num_experts_per_tok"],
            "moe_ffn_hidden": c["moe_intermediate_size"], "moe_norm_topk": bool(c.get("norm_topk_prob", False))}


def check_explicit_keys(user_model_section: Mapping[str, Any], from_hf: Mapping[str, Any],
                        source: str = "hf:<dir>") -> None:
    """ConfigError when a key the user set in [model] disagrees with the checkpoint's config.json."""
    for key, value in user_model_section.items():
        if key in from_hf and value != from_hf[key]:
            hf_key = HF_CONFIG_KEYS.get(key, key)
            raise ConfigError(f"model.{key}={value!r} disagrees with {source} config.json "
                              f"{hf_key}={from_hf[key]!r}; remove model.{key} (it is read from config.json) "
                              f"or use a checkpoint whose {hf_key} is {value!r}")


# ---- model.init_from = "hf:DIR" ------------------------------------------------------------------


def hf_dir_of(init_from: str) -> str:
    """The directory of `model.init_from = "hf:DIR"` (ConfigError for any other form)."""
    if not isinstance(init_from, str) or not init_from.startswith("hf:") or not init_from[3:]:
        raise ConfigError(f"model.init_from={init_from!r} must be 'hf:DIR', a Hugging Face Llama directory "
                          "(config.json and *.safetensors), e.g. init_from = \"hf:./Llama-3.2-1B\"")
    return init_from[3:]


def model_from_init(section: dict[str, Any]) -> dict[str, Any]:
    """[model] with the shape keys of `init_from`'s config.json filled in (DIR made absolute); a key the
    user set that disagrees is a ConfigError."""
    path = hf_dir_of(section["init_from"])
    path = path if "://" in path else str(Path(path).expanduser().resolve())
    if not Path(path).is_dir():
        raise ConfigError(f"model.init_from={section['init_from']!r}: {path} is not a directory; download the "
                          "model (e.g. `huggingface-cli download meta-llama/Llama-3.2-1B --local-dir DIR`)")
    from_hf = model_config_from_hf(path)
    check_explicit_keys({k: v for k, v in section.items() if k != "init_from"}, from_hf, f"hf:{path}")
    return {**section, **from_hf, "init_from": f"hf:{path}"}
