"""Weight initialisation that does not depend on where a parameter lives.

The model is built on the meta device (no storage), parallelized there, and only then given memory:
`to_empty(device=...)` allocates each rank's own shards (raydist.training.trainer; torchtitan builds the same
way). A random init drawn from one generator in module order would then depend on the layout (which
parameters this rank holds, in which order, in which shape), so every value is instead a pure function of
(seed, the parameter's name in the unsharded model, its position in the full tensor):

    full tensor (R, ...) of parameter `name`  =  rows cut into fixed blocks of ROWS(R, ...) rows
    block b  =  normal(0, std(name)) drawn from a generator seeded by sha256(seed, name, b)

The block size depends only on the full shape, so a rank that holds rows [r0, r1) of the tensor (and any
column range) draws just the blocks covering those rows and keeps its box: the single-process model, DDP
replicas, FSDP shards, TP column/row splits, FSDP x TP boxes and pipeline stages all hold the same values
at the same coordinates. A tied output head is named by its embedding (`tok_embeddings.weight`), so a
pipeline's output copy of a tied embedding starts identical to it. Norm weights are ones.

Non-persistent buffers (the RoPE tables) are recomputed after `to_empty`, which leaves them uninitialised;
parameters shared between modules (a tied embedding and head) are tied again after it, since moving a
plain parameter off the meta device makes a new Parameter in each module that held it.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

BLOCK_ELEMENTS = 1 << 20  # about this many elements per generator block (whole rows; at least one row)
RESIDUAL_OUTPUTS = ("wo", "w2")
# LoRA adapters (raydist.models.peft), named under their projection; RESIDUAL_OUTPUTS above are the
# projections into the residual stream: std / sqrt(2 L) (GPT-2's scaling)
LORA_A, LORA_B = ".lora_a", ".lora_b"


def canonical_name(name: str, tied: bool) -> str:
    """The name whose values parameter `name` takes: a tied head is its embedding."""
    return "tok_embeddings.weight" if tied and name == "output.weight" else name


def block_seed(seed: int, name: str, block: int) -> int:
    """A 63-bit generator seed for block `block` of parameter `name` (stable across processes and runs)."""
    digest = hashlib.sha256(f"{seed}\0{name}\0{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def rows_per_block(shape: torch.Size | tuple[int, ...]) -> int:
    return max(1, BLOCK_ELEMENTS // max(1, math.prod(shape[1:])))


def init_std(name: str, cfg) -> float:
    """Normal(0, init_std) weights; residual output projections scaled by 1/sqrt(2 * num_layers)."""
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    if module in RESIDUAL_OUTPUTS:
        return cfg.init_std / math.sqrt(2 * cfg.num_layers)
    return cfg.init_std


def is_norm(name: str) -> bool:
    return name.rsplit(".", 2)[-2].endswith("norm") if "." in name else False


def _draw_block(name: str, shape: tuple[int, ...], block: int, cfg, seed: int) -> torch.Tensor:
    """Block `block` (rows [block * per, ...) of at most rows_per_block rows) of parameter `name`'s initial
    value, fp32 on the CPU."""
    per = rows_per_block(shape)
    rows = min(per, shape[0] - block * per)
    gen = torch.Generator().manual_seed(block_seed(seed, name, block))
    values = torch.empty((rows, *shape[1:]))
    if name.endswith(LORA_A):  # LoRA's A: uniform(+-1/sqrt(in)), as nn.Linear's default (Hu et al., 2021)
        bound = 1 / math.sqrt(shape[1])
        return values.uniform_(-bound, bound, generator=gen)
    return values.normal_(0.0, init_std(name, cfg), generator=gen)


@torch.no_grad()
def write_rows(out: torch.Tensor, name: str, shape: tuple[int, ...], start: int, offsets: tuple[int, ...],
               cfg, seed: int) -> torch.Tensor:
    """Fill `out` with its box of parameter `name`'s initial value (full shape `shape`): rows
    [start, start + len(out)), and in every other dimension d the range [offsets[d - 1], + out.shape[d]).
    Each generator block is drawn, copied into place and dropped, so no more than one block (about
    BLOCK_ELEMENTS) is held beside `out`, however large the parameter. Returns `out`."""
    stop = start + out.shape[0]
    if is_norm(name):
        return out.fill_(1.0)
    if name.endswith(LORA_B) or name.endswith(".bias"):  # LoRA's B (the adapted model starts as the base
        return out.zero_()  # model) and biases (Qwen2's q/k/v, as transformers initialises them) start at zero
    if stop <= start:
        return out
    per = rows_per_block(shape)
    for block in range(start // per, (stop - 1) // per + 1):
        values = _draw_block(name, shape, block, cfg, seed)
        lo, hi = max(start, block * per), min(stop, block * per + values.shape[0])
        piece = values[lo - block * per: hi - block * per]
        for dim, offset in enumerate(offsets, start=1):
            piece = piece.narrow(dim, offset, out.shape[dim])
        out[lo - start: hi - start].copy_(piece)
    return out


def full_rows(name: str, shape: tuple[int, ...], start: int, stop: int, cfg, seed: int) -> torch.Tensor:
    """Rows [start, stop) of parameter `name`'s initial value (full shape `shape`), fp32 on the CPU."""
    out = torch.empty((max(stop - start, 0), *shape[1:]))
    return write_rows(out, name, shape, start, (0,) * (len(shape) - 1), cfg, seed)


def full_value(name: str, shape: tuple[int, ...], cfg, seed: int) -> torch.Tensor:
    """Parameter `name`'s whole initial value (the single-process model's)."""
    return full_rows(name, shape, 0, shape[0], cfg, seed) if shape else torch.ones(())


def local_region(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of the block of the unsharded tensor that this rank's local piece of `param` holds
    (a plain tensor: all of it)."""
    if not hasattr(param, "device_mesh"):
        return (0,) * param.dim(), tuple(param.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(offset), tuple(shape)


def _local_box(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(local shape, global offset) of the piece of `param` this rank holds when that piece is one box of the
    full tensor (a plain tensor: all of it); None for a scalar or a DTensor piece that is not one box."""
    if param.dim() == 0:
        return None
    if not hasattr(param, "device_mesh"):
        return tuple(param.shape), (0,) * param.dim()
    offset, shape = local_region(param)
    return (shape, offset) if shape == tuple(param.to_local().shape) else None


def _write_box(out: torch.Tensor, name: str, shape: tuple[int, ...], box, cfg, seed: int) -> torch.Tensor:
    """`out` filled with the box `box` (from `_local_box`) of parameter `name`'s initial value."""
    local_shape, offset = box
    if 0 not in local_shape:
        write_rows(out, name, shape, offset[0], tuple(offset[1:]), cfg, seed)
    return out


def local_value(name: str, param: torch.Tensor, cfg, seed: int) -> torch.Tensor:
    """The initial value of the piece of `name` that `param` holds on this rank (a plain tensor: all of it;
    a DTensor: its local shard), fp32 on the CPU."""
    shape = tuple(param.shape)
    box = _local_box(param)
    if box is not None:
        return _write_box(torch.empty(box[0]), name, shape, box, cfg, seed)
    if not hasattr(param, "device_mesh"):  # a scalar
        return full_value(name, shape, cfg, seed)
    # a placement whose local piece is not one box: cut the full value as DTensor does
    from torch.distributed.tensor import distribute_tensor

    full = full_value(name, shape, cfg, seed)
    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()


@torch.no_grad()
def init_weights(module: nn.Module, cfg, seed: int) -> None:
    """Initialise every parameter `module` holds (a whole GPT, a pipeline chunk, sharded or not) in place,
    by its name in the unsharded model. Tied parameters are written once (they are one tensor)."""
    tied = bool(cfg.tie_embeddings)
    for name, param in module.named_parameters():
        name = canonical_name(name, tied)
        target = param.to_local() if hasattr(param, "to_local") else param
        box = _local_box(param)
        if box is not None and target.dtype == torch.float32 and target.device.type == "cpu" \
                and target.is_contiguous():  # written block by block, straight into this rank's storage
            _write_box(target, name, tuple(param.shape), box, cfg, seed)
        else:  # another dtype or device, or a piece that is not one box
            target.copy_(local_value(name, param, cfg, seed).to(dtype=target.dtype))


@torch.no_grad()
def init_buffers(module: nn.Module) -> None:
    """Recompute the non-persistent buffers of every GPT in `module` (after `to_empty`)."""
    for sub in module.modules():
        reset = getattr(sub, "reset_buffers", None)
        if reset is not None:
            reset()


def _shared_parameters(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Every parameter registered in more than one place (a tied embedding and head), as its places."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((sub, name))
    return [p for p in places.values() if len(p) > 1]


def materialize(module: nn.Module, device: torch.device, cfg, seed: int, init: bool = True) -> nn.Module:
    """Give a meta-device `module` storage on `device` (each rank only its own shards), recompute its
    buffers and, when `init`, its initial weights (skipped when a checkpoint will overwrite them)."""
    shared = _shared_parameters(module)
    module.to_empty(device=device)
    for places in shared:  # a meta -> device move makes a new Parameter per module: tie them again
        owner, name = places[0]
        param = getattr(owner, name)
        for other, other_name in places[1:]:
            if getattr(other, other_name) is not param:
                other.register_parameter(other_name, param)
    init_buffers(module)
    if init:
        init_weights(module, cfg, seed)
    return module


def is_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters())
