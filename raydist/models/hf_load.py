"""`model.init_from = "hf:DIR"`: a Hugging Face Llama checkpoint streamed into this rank's parameters.

After the model is parallelized, each rank holds, per parameter, one rectangle of the unsharded tensor:
all of it (a replica, a pipeline stage's own blocks), or the block that FSDP's Shard(0) and tensor
parallelism's Shard(0)/Shard(1) leave it (a DTensor's local shard; `compute_local_shape_and_global_offset`
gives the rectangle for any placements). `load_into_shards` reads exactly that rectangle from the
safetensors file (`safe_open(...).get_slice`, which reads only those bytes) and copies it into the local
shard, so no rank materialises a tensor it does not hold. The q/k rotary permutation between the two
conventions (raydist.models.hf) moves rows only within a head, so a row range is widened to whole heads,
permuted, and narrowed back.

`check_checkpoint` validates names and shapes from the files' headers alone (the driver calls it before
any worker starts); adapter parameters (raydist.models.peft) are not in a Hugging Face checkpoint and keep their
own init.
"""

from __future__ import annotations

import os

import torch

from raydist.config import ConfigError, ModelConfig
from raydist.models import hf
from raydist.models.init import local_region


def check_checkpoint(hf_dir: str | os.PathLike, cfg: ModelConfig) -> None:
    """ConfigError unless `hf_dir` holds every tensor of a `cfg` model with its shape (headers only)."""
    hf.check_explicit_keys({k: getattr(cfg, k) for k in hf.HF_CONFIG_KEYS}, hf.model_config_from_hf(hf_dir),
                           source=f"hf:{hf_dir}")
    sources = hf._raydist_sources(hf_dir, cfg)
    shapes = hf.expected_shapes(cfg)
    missing, unexpected = sorted(set(shapes) - set(sources)), sorted(set(sources) - set(shapes))
    if missing or unexpected:
        raise ConfigError(f"hf:{hf_dir}: " + "; ".join(
            f"{what} tensors {[hf.hf_names(n, cfg)[0] if n in shapes else sources[n][0][0] for n in names[:5]]}"
            for what, names in (("missing", missing), ("unexpected", unexpected)) if names)
            + " for the model its config.json describes")
    with hf._Files() as files:
        for name, parts in sources.items():
            # an expert stack (E, out, in) is E tensors of (out, in)
            want = shapes[name][1:] if hf.is_expert_stack(name) else shapes[name]
            for hf_name, f in parts:
                shape = tuple(files(f).get_slice(hf_name).get_shape())
                if shape != want:
                    raise ConfigError(f"hf:{hf_dir}: {hf_name} has shape {shape}, but config.json describes "
                                      f"{want} (raydist's {name}); the directory's files disagree")


def read_block(files, parts: hf.Parts, name: str, offsets, sizes, cfg: ModelConfig) -> torch.Tensor:
    """tensor[offsets : offsets + sizes] of raydist parameter `name`, in raydist layout, reading that block
    (rows widened to whole heads for wq/wk, whose rotary permutation moves rows within a head; an expert
    stack's first dimension picks whole experts)."""
    starts, stops = list(offsets), [o + s for o, s in zip(offsets, sizes)]
    trim = None
    if hf._is_rotary(name) and starts:
        e = cfg.head_size
        row0, row1 = starts[0] // e * e, -(-stops[0] // e) * e
        trim = (starts[0] - row0, sizes[0])
        starts[0], stops[0] = row0, row1
    block = hf.read_parts(files, name, parts, cfg, tuple(slice(a, b) for a, b in zip(starts, stops)))
    return block.narrow(0, *trim) if trim is not None else block


def load_into_shards(model: torch.nn.Module, hf_dir: str | os.PathLike, aliases: dict[str, str] | None = None,
                     skip=lambda name: False) -> list[str]:
    """Copy `hf_dir` into this rank's parameters of `model` (a parallelized GPT or its pipeline stage view,
    with the unsharded names), each reading only its local block; returns the names loaded. `skip(name)`
    leaves a parameter alone (adapters); `aliases` maps a name to the one the checkpoint knows it by."""
    cfg: ModelConfig = model.cfg
    sources = hf._raydist_sources(hf_dir, cfg)
    loaded = []
    with hf._Files() as files, torch.no_grad():
        for name, param in model.named_parameters():
            if skip(name):
                continue
            key = (aliases or {}).get(name, name)
            if key not in sources:
                raise ConfigError(f"hf:{hf_dir}: missing tensor {hf.hf_names(key, cfg)[0]} (raydist's {key})")
            local = param.to_local() if hasattr(param, "to_local") else param
            offsets, sizes = local_region(param)
            if local.numel() == 0:
                continue
            block = read_block(files, sources[key], key, offsets, sizes, cfg)
            if tuple(block.shape) != tuple(local.shape):
                raise ConfigError(f"hf:{hf_dir}: {sources[key][0][0]} block {tuple(block.shape)} does not fit "
                                  f"raydist's {name} local shard {tuple(local.shape)}; the checkpoint's shapes "
                                  "disagree with its config")
            local.copy_(block)
            loaded.append(name)
    return loaded
