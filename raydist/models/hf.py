"""Hugging Face checkpoints (Llama, Mistral, Qwen2/2.5, Qwen3: raydist.families.registry) <-> raydist's GPT:
config, parameter names, RoPE layout, safetensors I/O.

Both models are the Llama decoder (Touvron et al., 2023, "LLaMA: Open and Efficient Foundation Language
Models"): RMSNorm, SwiGLU MLP, grouped-query attention and rotary position embeddings (RoPE; Su et al.,
"RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021). They differ in names and in which
coordinates of a head of size E RoPE pairs up. With angle a_i = pos * theta^(-2i/E), i < E/2:

- raydist (as in the RoFormer paper and Meta's original Llama code) rotates INTERLEAVED pairs
      (x[2i], x[2i+1]) -> (x[2i] cos a_i - x[2i+1] sin a_i,  x[2i] sin a_i + x[2i+1] cos a_i);
- Hugging Face ("rotate_half") rotates HALVES
      (x[i], x[i+E/2]) -> (x[i] cos a_i - x[i+E/2] sin a_i,  x[i] sin a_i + x[i+E/2] cos a_i).

The attention scores q.k are invariant under the same permutation of q's and k's coordinates, so the two
models agree exactly once the output rows of wq and wk (and their biases, and the per-head q/k norm
weights of Qwen3, which scale the same coordinates) are reordered within each head:
      hf_row[h*E + j*E/2 + i] = raydist_row[h*E + 2i + j]     (j in {0, 1}, i < E/2),
i.e. per head the even rows first, then the odd rows (`to_hf`), and the inverse (`to_raydist`). Every
other tensor has the same layout in both. The permutation never mixes rows of different heads, so a row
slice aligned to whole heads (tensor-parallel and FSDP shards of wq/wk usually are) can be read and
permuted on its own (`read_hf_slice`); column slices need no alignment.

Tied embeddings: Hugging Face stores only `model.embed_tokens.weight` (an `lm_head.weight` may be present
and must then be equal); raydist's `GPT.state_dict()` holds both `tok_embeddings.weight` and
`output.weight` (the same tensor), and `save_hf` writes only the embedding.

Only safetensors and JSON are read (nothing is unpickled); `safetensors` is imported inside functions.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from raydist.config_io import HF_CONFIG_KEYS, check_explicit_keys, model_config_from_hf
from raydist.config_sections import ModelConfig
from raydist.errors import ConfigError
from raydist.families.registry import family_of
from raydist.models.gpt import GPT

INDEX_FILE = "model.safetensors.index.json"

# The mapping, written once: raydist name <-> Hugging Face name ({i} is the block index).
_NAME_TABLE: list[tuple[str, str]] = [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attention.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    # the families' extra tensors (raydist.families.registry): Qwen2's q/k/v biases, Qwen3's per-head q/k norms
    ("layers.{i}.attention.wq.bias", "model.layers.{i}.self_attn.q_proj.bias"),
    ("layers.{i}.attention.wk.bias", "model.layers.{i}.self_attn.k_proj.bias"),
    ("layers.{i}.attention.wv.bias", "model.layers.{i}.self_attn.v_proj.bias"),
    ("layers.{i}.attention.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("layers.{i}.attention.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
]
# raydist suffixes whose rows (the coordinates of each head) RoPE pairs up: permuted between conventions
_ROTARY = {"attention.wq.weight", "attention.wk.weight", "attention.wq.bias", "attention.wk.bias",
           "attention.q_norm.weight", "attention.k_norm.weight"}
# Non-parameter buffers some older exports wrote; recomputed from rope_theta, so skipped when reading.
_IGNORED_HF = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


# A mixture of experts (raydist.models.moe) stacks its E experts' weights in one (E, out, in) tensor per
# projection; Hugging Face checkpoints hold one tensor per expert ({j}), under the family's module names.
EXPERT_PROJECTIONS = ("w1", "w3", "w2")  # raydist's gate, up, down


def _moe_table(family) -> list[tuple[str, str]]:
    if family is None or family.hf_moe is None:
        return []
    module, names = family.hf_moe
    return [("layers.{i}.feed_forward.router.weight", f"model.layers.{{i}}.{module}.gate.weight")] + [
        (f"layers.{{i}}.feed_forward.experts.{ours}.weight", f"model.layers.{{i}}.{module}.experts.{{j}}.{theirs}.weight")
        for ours, theirs in zip(EXPERT_PROJECTIONS, names)]


def _compile(pairs: list[tuple[str, str]]) -> list[tuple[re.Pattern, str]]:
    return [(re.compile(re.escape(a).replace(re.escape("{i}"), r"(?P<i>\d+)").replace(re.escape("{j}"), r"(?P<j>\d+)")
                        + "$"), b) for a, b in pairs]


@functools.lru_cache(maxsize=None)
def _tables(family_name: str | None = None) -> tuple[list[tuple[re.Pattern, str]], list[tuple[re.Pattern, str]]]:
    """(Hugging Face -> raydist, raydist -> Hugging Face) patterns, compiled once per family: the shared
    table, plus the family's mixture-of-experts names (every MoE family's when reading, whose names do not
    collide)."""
    from raydist.families.registry import FAMILIES

    family = None if family_name is None else FAMILIES[family_name]
    readers = [f for f in FAMILIES.values() if f.moe] if family is None else [family]
    to_raydist = _compile([(hf, ours) for ours, hf in _NAME_TABLE + [p for f in readers for p in _moe_table(f)]])
    return to_raydist, _compile(_NAME_TABLE + _moe_table(family))


def _translate(name: str, table: list[tuple[re.Pattern, str]], kind: str, expert: int | None = None
               ) -> tuple[str, int | None]:
    for pattern, target in table:
        if m := pattern.match(name):
            groups = m.groupdict()
            out = target.replace("{i}", groups["i"]) if groups.get("i") is not None else target
            if "{j}" in out:
                if expert is None:
                    raise KeyError(f"{name!r} is a stack of experts: name one (expert=)")
                out = out.replace("{j}", str(expert))
            return out, None if groups.get("j") is None else int(groups["j"])
    raise KeyError(f"{name!r} is not a {kind} parameter name raydist knows")


def hf_to_raydist_name(name: str) -> str:
    """'model.layers.3.self_attn.q_proj.weight' -> 'layers.3.attention.wq.weight'; an expert's tensor
    ('model.layers.3.mlp.experts.5.up_proj.weight') -> its stack ('layers.3.feed_forward.experts.w3.weight')."""
    return hf_to_raydist(name)[0]


def hf_to_raydist(name: str) -> tuple[str, int | None]:
    """(raydist name, expert index or None): where a Hugging Face tensor goes."""
    return _translate(name, _tables()[0], "Hugging Face")


def raydist_to_hf_name(name: str, family=None, expert: int | None = None) -> str:
    """'layers.3.attention.wq.weight' -> 'model.layers.3.self_attn.q_proj.weight'; a stacked expert weight
    needs its family (raydist.families.registry) and the expert's index."""
    return _translate(name, _tables(family and family.name)[1], "raydist", expert)[0]


def is_expert_stack(name: str) -> bool:
    """A raydist parameter holding every expert of a block, stacked along dim 0."""
    return re.search(r"\.feed_forward\.experts\.w[123]\.weight$", name) is not None


def hf_names(name: str, cfg: ModelConfig) -> list[str]:
    """The Hugging Face tensors raydist parameter `name` is made of: one, or each expert's in order."""
    family = family_of(cfg)
    if is_expert_stack(name):
        return [raydist_to_hf_name(name, family, j) for j in range(cfg.moe_experts)]
    return [raydist_to_hf_name(name, family)]


def _is_rotary(raydist_name: str) -> bool:
    return raydist_name.startswith("layers.") and raydist_name.split(".", 2)[-1] in _ROTARY


def _permute_rows(w: torch.Tensor, cfg: ModelConfig, from_pairs: bool) -> torch.Tensor:
    """Within each head of E rows (any number of whole heads): interleaved pairs -> halves, or back."""
    e = cfg.head_size
    inner = (e // 2, 2) if from_pairs else (2, e // 2)
    return w.reshape(w.shape[0] // e, *inner, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def to_raydist(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """A tensor of raydist parameter `name` in Hugging Face layout -> raydist layout (inverse of `to_hf`)."""
    return _permute_rows(tensor, cfg, from_pairs=False) if _is_rotary(name) else tensor


def to_hf(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """A tensor of raydist parameter `name` in raydist layout -> Hugging Face layout (inverse of `to_raydist`)."""
    return _permute_rows(tensor, cfg, from_pairs=True) if _is_rotary(name) else tensor


# ---- reading safetensors ---------------------------------------------------------------------------------


def _tensor_files(hf_dir: str | os.PathLike) -> dict[str, Path]:
    """Hugging Face tensor name -> its .safetensors file: from the index, else model.safetensors, else every
    *.safetensors file (an index or model.safetensors wins over e.g. a Meta-format consolidated.safetensors)."""
    from safetensors import safe_open

    root = Path(hf_dir)
    if (root / INDEX_FILE).is_file():
        return {name: root / f for name, f in json.loads((root / INDEX_FILE).read_text())["weight_map"].items()}
    single = root / "model.safetensors"
    files = [single] if single.is_file() else sorted(root.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in {root}; export with save_pretrained (safetensors)")
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:  # reads the header only
            where.update(dict.fromkeys(fh.keys(), f))
    return where


Parts = list[tuple[str, Path]]  # a raydist tensor's Hugging Face tensors and their files (E for an expert stack)


def _raydist_sources(hf_dir, cfg: ModelConfig) -> dict[str, Parts]:
    """raydist name -> its parts (Hugging Face name, file) for every tensor in the checkpoint, an expert
    stack's in expert order; unknown names and incomplete expert stacks fail."""
    out: dict[str, dict[int | None, tuple[str, Path]]] = {}
    unknown = []
    for hf_name, f in _tensor_files(hf_dir).items():
        try:
            name, expert = hf_to_raydist(hf_name)
        except KeyError:
            unknown += [] if _IGNORED_HF.match(hf_name) else [hf_name]
            continue
        out.setdefault(name, {})[expert] = (hf_name, f)
    if unknown:
        raise ConfigError(f"{hf_dir}: unexpected tensors {unknown[:5]} (not part of a model raydist knows)")
    sources: dict[str, Parts] = {}
    for name, parts in out.items():
        if is_expert_stack(name):
            if sorted(parts) != list(range(cfg.moe_experts)):
                raise ConfigError(f"{hf_dir}: {name} has experts {sorted(parts)[:8]}, config.json says "
                                  f"{cfg.moe_experts} (0..{cfg.moe_experts - 1}); the checkpoint is incomplete")
            sources[name] = [parts[j] for j in range(cfg.moe_experts)]
        else:
            sources[name] = [parts[None]]
    if cfg.tie_embeddings and "output.weight" not in sources and "tok_embeddings.weight" in sources:
        sources["output.weight"] = sources["tok_embeddings.weight"]  # read the embedding for a tied head
    return sources


def _is_alias(name: str, parts: Parts) -> bool:
    """A tied head read through the embedding's tensor (not stored under its own name)."""
    return name == "output.weight" and parts[0][0] == "model.embed_tokens.weight"


def _select(hf_dir, cfg: ModelConfig | None, names: Iterable[str] | None):
    """(cfg, sources, the raydist names to read): cfg defaults to config.json's; names must be present."""
    cfg = cfg if cfg is not None else ModelConfig(**model_config_from_hf(hf_dir))
    sources = _raydist_sources(hf_dir, cfg)
    if names is None:  # what the checkpoint stores (not the alias of a tied head)
        return cfg, sources, [n for n, parts in sources.items() if not _is_alias(n, parts)]
    missing = [n for n in names if n not in sources]
    if missing:
        raise ConfigError(f"{hf_dir}: missing tensors {missing[:5]} "
                          f"(Hugging Face names {[hf_names(n, cfg)[0] for n in missing[:5]]})")
    return cfg, sources, list(names)


def read_parts(open_file, name: str, parts: Parts, cfg: ModelConfig, index: tuple[slice, ...] = ()) -> torch.Tensor:
    """tensor[index] of raydist parameter `name` in raydist layout from its parts, reading only that block:
    `open_file(path)` gives a safetensors handle. An expert stack's first index picks experts, the rest
    index each expert's tensor. Rotary row slices must cover whole heads (see `read_hf_slice`)."""
    def get(hf_name: str, f: Path, idx: tuple[slice, ...]) -> torch.Tensor:
        return open_file(f).get_slice(hf_name)[idx] if idx else open_file(f).get_tensor(hf_name)

    if is_expert_stack(name):
        chosen = parts[index[0]] if index else parts
        return torch.stack([get(h, f, tuple(index[1:])) for h, f in chosen])
    return to_raydist(name, get(*parts[0], tuple(index)), cfg)


class _Files:
    """safetensors handles opened once each (`files(path)`), all closed when the with-block ends."""

    def __init__(self):
        import contextlib

        self.stack, self.handles = contextlib.ExitStack(), {}

    def __call__(self, path: Path):
        from safetensors import safe_open

        if path not in self.handles:
            self.handles[path] = self.stack.enter_context(safe_open(str(path), framework="pt"))
        return self.handles[path]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stack.close()
        self.handles.clear()


def iter_hf_tensors(hf_dir: str | os.PathLike, names: Iterable[str] | None = None,
                    cfg: ModelConfig | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(raydist name, tensor in raydist layout and its stored dtype), one tensor at a time, file by file.

    names: raydist names to read (default: every tensor in the checkpoint; a tied head that the checkpoint
    does not store is not yielded unless asked for). cfg defaults to the one in config.json. An expert stack
    is read expert by expert and stacked.
    """
    names = None if names is None else list(names)
    cfg, sources, wanted = _select(hf_dir, cfg, names)
    order = [n for _, _, n in sorted((str(sources[n][0][1]), i, n) for i, n in enumerate(wanted))]  # file by file
    with _Files() as files:
        for n in order:
            yield n, read_parts(files, n, sources[n], cfg)


def read_hf_slice(hf_dir: str | os.PathLike, name: str, dim: int, start: int, stop: int,
                  cfg: ModelConfig | None = None) -> torch.Tensor:
    """tensor[start:stop] along `dim` of raydist parameter `name` in raydist layout, reading only that slice.

    For wq/wk a row slice (dim 0) must cover whole heads (start, stop multiples of head_dim): the rotary
    permutation only moves rows within a head, so such a slice is permuted on its own.
    """
    cfg, sources, _ = _select(hf_dir, cfg, [name])
    e = cfg.head_size
    if _is_rotary(name) and dim == 0 and (start % e or stop % e):
        raise ValueError(f"row slice [{start}:{stop}] of {name} must be aligned to whole heads of {e} rows")
    with _Files() as files:  # get_slice reads only the slice's bytes
        return read_parts(files, name, sources[name], cfg, (slice(None),) * dim + (slice(start, stop),))


def load_hf_into(model: torch.nn.Module, hf_dir: str | os.PathLike) -> None:
    """Copy a Hugging Face checkpoint into an unsharded raydist GPT (cast to the model's dtypes).

    ConfigError for a config.json that disagrees with model.cfg, missing or unexpected tensors, shape
    mismatches (the model may then be partly overwritten), or a tied model's stored lm_head that differs
    from the embedding.
    """
    cfg: ModelConfig = model.cfg
    check_explicit_keys({k: getattr(cfg, k) for k in HF_CONFIG_KEYS}, model_config_from_hf(hf_dir),
                        source=f"hf:{hf_dir}")
    targets, sources = model.state_dict(keep_vars=True), _raydist_sources(hf_dir, cfg)
    unexpected, missing = sorted(set(sources) - set(targets)), sorted(set(targets) - set(sources))
    if unexpected or missing:
        raise ConfigError(f"{hf_dir}: " + "; ".join(f"{what} tensors {names[:5]}" for what, names in
                                                    (("missing", missing), ("unexpected", unexpected)) if names))
    stored_head = None
    with torch.no_grad():
        for name, tensor in iter_hf_tensors(hf_dir, cfg=cfg):
            if tensor.shape != targets[name].shape:
                raise ConfigError(f"{hf_dir}: {hf_names(name, cfg)[0]} has shape {tuple(tensor.shape)}, "
                                  f"raydist's {name} needs {tuple(targets[name].shape)}")
            if cfg.tie_embeddings and name == "output.weight":
                stored_head = tensor  # the embedding is the head; compare once it is loaded
            else:
                targets[name].copy_(tensor)
        if stored_head is not None and not torch.equal(stored_head.to(model.output.weight.dtype),
                                                       model.output.weight):
            raise ConfigError(f"{hf_dir}: tie_word_embeddings is true but lm_head.weight differs from "
                              "model.embed_tokens.weight; set tie_word_embeddings false in config.json")


# ---- writing -----------------------------------------------------------------------------------------------


def _replace_into(path: Path, write) -> None:
    """write(tmp) then os.replace(tmp, path): readers never see a partial file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """raydist name -> unsharded shape of every parameter of a `cfg` model (both halves of a tied pair), from
    the model built on the meta device (no storage): the tensors a checkpoint of its family and depth holds."""
    with torch.device("meta"):
        model = GPT(cfg, max_seq_len=2)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _moe_config(cfg: ModelConfig, family) -> dict[str, Any]:
    """config.json's mixture-of-experts keys of a `family` model (ConfigError for one its family cannot hold)."""
    if bool(cfg.moe_experts) != family.moe:
        raise ConfigError(f"model.moe_experts={cfg.moe_experts} with family {family.name!r}: Hugging Face's "
                          f"{family.hf_architecture} is {'a mixture of experts' if family.moe else 'dense'}; export "
                          "a mixture of experts as family 'mixtral' or 'qwen3_moe'")
    if not family.moe:
        return {}
    if cfg.moe_shared_ffn_hidden:
        raise ConfigError(f"model.moe_shared_ffn_hidden={cfg.moe_shared_ffn_hidden}: {family.hf_architecture} has "
                          "no shared expert; only models without one export")
    common = {"num_experts_per_tok": cfg.moe_top_k, "output_router_logits": False}
    if family.name == "mixtral":
        if not cfg.moe_norm_topk or cfg.expert_hidden != cfg.ffn_hidden:
            raise ConfigError("a Mixtral renormalises its top-k weights and its experts are intermediate_size wide: "
                              "export with model.moe_norm_topk true and model.moe_ffn_hidden 0 or ffn_hidden")
        return {**common, "num_local_experts": cfg.moe_experts, "router_jitter_noise": 0.0}
    return {**common, "num_experts": cfg.moe_experts, "moe_intermediate_size": cfg.expert_hidden,
            "norm_topk_prob": cfg.moe_norm_topk}


def hf_config_dict(cfg: ModelConfig, max_position_embeddings: int, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json of a raydist model as its family's Hugging Face model (transformers 4 and 5 keys)."""
    family = family_of(cfg)
    dtype_name = str(dtype).removeprefix("torch.")
    return {**_moe_config(cfg, family), "architectures": [family.hf_architecture], "model_type": family.hf_model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_hidden,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "hidden_act": "silu",
            "head_dim": cfg.head_size,
            "max_position_embeddings": max_position_embeddings, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "attention_dropout": 0.0, "tie_word_embeddings": cfg.tie_embeddings,
            "initializer_range": cfg.init_std, "use_cache": True, "torch_dtype": dtype_name, "dtype": dtype_name,
            **family.hf_config_extra}


def save_hf(state_dict_iter_or_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
            cfg: ModelConfig, out_dir: str | os.PathLike, max_shard_bytes: float = 5e9,
            dtype: torch.dtype | None = None, *, max_position_embeddings: int = 2048,
            tokenizer_json: str | os.PathLike | None = None) -> list[str]:
    """Write a raydist model (unsharded raydist names and layout) as a Hugging Face checkpoint of its family.

    Tensors are consumed one at a time and written a shard (<= max_shard_bytes) at a time: one
    `model.safetensors`, or `model-0000i-of-0000N.safetensors` plus `model.safetensors.index.json`. Files
    are written under temporary names and os.replace'd once every tensor is in; model files of an earlier
    export in out_dir that this one does not write are then removed. A tied `output.weight` is not written
    (it must equal the embedding). dtype casts floating tensors (default: as given). Returns the file names.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    items = state_dict_iter_or_dict
    items = items.items() if isinstance(items, Mapping) else items
    expected = set(expected_shapes(cfg))
    shards: list[tuple[Path, list[str]]] = []  # (temporary file, Hugging Face names in it)
    current: dict[str, torch.Tensor] = {}  # the shard being filled
    current_bytes, total, seen, tied_pair, file_dtype = 0, 0, set(), {}, dtype

    def flush() -> None:
        nonlocal current, current_bytes
        if current:
            shards.append((out / f".model-{len(shards) + 1:05d}.safetensors.tmp-{os.getpid()}", sorted(current)))
            save_file(current, str(shards[-1][0]), metadata={"format": "pt"})
        current, current_bytes = {}, 0

    try:
        for name, tensor in items:
            if name not in expected:
                raise ConfigError(f"save_hf: unexpected tensor {name!r} for a {cfg.num_layers}-layer model")
            seen.add(name)
            if cfg.tie_embeddings and name in ("tok_embeddings.weight", "output.weight"):
                tied_pair[name] = tensor
                if name == "output.weight":
                    continue
            t = tensor.detach()
            t = t.to(dtype) if dtype is not None and t.is_floating_point() else t
            file_dtype = file_dtype or t.dtype
            t = to_hf(name, t, cfg).to("cpu")
            # an expert stack is written as one tensor per expert, as Hugging Face stores them
            for hf_name, part in zip(hf_names(name, cfg), t.unbind(0) if is_expert_stack(name) else [t]):
                part = part.contiguous()
                if part.untyped_storage().nbytes() != part.numel() * part.element_size():
                    part = part.clone()  # a view into a larger (e.g. flat-parameter) storage: safetensors refuses it
                nbytes = part.numel() * part.element_size()
                if current and current_bytes + nbytes > max_shard_bytes:
                    flush()
                current[hf_name] = part
                current_bytes, total = current_bytes + nbytes, total + nbytes
        flush()
        missing = sorted(expected - seen - ({"output.weight"} if cfg.tie_embeddings else set()))
        if missing:
            raise ConfigError(f"save_hf: missing tensors {missing[:5]}")
        if len(tied_pair) == 2 and not torch.equal(*(t.detach().cpu() for t in tied_pair.values())):
            raise ConfigError("save_hf: tie_embeddings is true but output.weight differs from tok_embeddings.weight")
    except BaseException:
        for tmp, _ in shards:
            tmp.unlink(missing_ok=True)
        raise

    n = len(shards)
    written = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for (tmp, _), final in zip(shards, written):
        os.replace(tmp, out / final)
    if n > 1:
        weight_map = dict(sorted((k, final) for (_, keys), final in zip(shards, written) for k in keys))
        index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        _replace_into(out / INDEX_FILE, lambda p: p.write_text(index))
        written.append(INDEX_FILE)
    for stale in [*out.glob("model*.safetensors"), out / INDEX_FILE]:
        if stale.name not in written and stale.exists():
            stale.unlink()
    config = json.dumps(hf_config_dict(cfg, max_position_embeddings, file_dtype or torch.float32), indent=2)
    _replace_into(out / "config.json", lambda p: p.write_text(config))
    written.append("config.json")
    if tokenizer_json is not None:
        _replace_into(out / "tokenizer.json", lambda p: shutil.copyfile(tokenizer_json, p))
        written.append("tokenizer.json")
    return written
