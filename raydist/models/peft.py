"""Parameter-efficient fine-tuning: LoRA adapters and layer freezing, applied before parallelization.

LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021): an adapted projection
W (out x in) computes

    y = x W^T + (alpha / r) (x A^T) B^T,      A (r x in), B (out x r)

with W frozen, B zero-initialised (the model starts exactly as loaded) and A drawn from a keyed init
(uniform +-1/sqrt(in), seeded by train.seed and the parameter's name, so every layout draws the same A).
A and B are parameters of the projection itself (`<proj>.lora_a`, `<proj>.lora_b`), so checkpoints,
optimizer state and gradient checks see them by name like any other parameter.

How the adapters follow the parallel layouts:
- tensor parallel: a column-parallel W (Shard(0): output rows split) splits B the same way and replicates
  A; a row-parallel W (Shard(1): input columns split) splits A's columns and replicates B. x A^T is then
  Partial under the row split and DTensor sums it with x W^T's Partial at the same all-reduce;
- FSDP shards A, B and the frozen W like any parameter (frozen ones get no gradient and no reduce-scatter);
  DDP and the optimizer skip parameters with requires_grad False, so frozen weights hold no optimizer state.

`freeze` trains the last `trainable_last_layers` blocks and the final norm (the head too when untied).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raydist.config import ModelConfig
from raydist.errors import ConfigError
from raydist.models.gpt import block_roles
from raydist.models.init import LORA_A, LORA_B, full_value

PROJECTIONS = ("column", "kv", "row")  # the tensor-parallel roles of a block's Linear layers
GROUPS = {"attention_input": "attention", "mlp_input": "mlp"}  # a parent's role: its projections' group


def lora_targets(cfg: ModelConfig, which: str) -> tuple[str, ...]:
    """The block's modules LoRA adapts under peft.lora_targets = `which` ("attention", "mlp" or "all"),
    read from the family's tensor-parallel roles (`block_roles`), not from module names: every Linear
    (role column, kv or row) under the attention (role attention_input) or the MLP (role mlp_input)."""
    roles = block_roles(cfg)
    group = {name: GROUPS[role] for name, role in roles.items() if role in GROUPS}
    return tuple(name for name, role in roles.items()
                 if role in PROJECTIONS and which in ("all", group.get(name.rpartition(".")[0])))


class LoRALinear(nn.Linear):
    """nn.Linear (its bias too, where the family has one: Qwen2's q/k/v) plus a rank-r update; made from an
    existing Linear by `add_lora` (in place)."""

    lora_a: nn.Parameter
    lora_b: nn.Parameter
    lora_scale: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(x, self.lora_a), self.lora_b)  # (..., r) -> (..., out)
        return F.linear(x, self.weight, self.bias) + self.lora_scale * update

    def merged_weight(self) -> torch.Tensor:
        """W + (alpha/r) B A: the plain projection this one computes."""
        return self.weight + self.lora_scale * (self.lora_b @ self.lora_a)


def is_adapter(name: str) -> bool:
    return name.endswith((".lora_a", ".lora_b"))


def add_lora(linear: nn.Linear, rank: int, alpha: float, seed: int, name: str) -> LoRALinear:
    """Turn `linear` into a LoRALinear in place (its weight object unchanged, now frozen)."""
    out_features, in_features = linear.weight.shape
    linear.__class__ = LoRALinear
    device = linear.weight.device
    if device.type == "meta":  # the Trainer's construction: raydist.models.init gives the values per shard
        linear.lora_a = nn.Parameter(torch.empty(rank, in_features, device=device))
        linear.lora_b = nn.Parameter(torch.empty(out_features, rank, device=device))
    else:  # the same values the keyed init gives (A uniform, B zero)
        linear.lora_a = nn.Parameter(full_value(f"{name}{LORA_A}", (rank, in_features), None, seed).to(device))
        linear.lora_b = nn.Parameter(full_value(f"{name}{LORA_B}", (out_features, rank), None, seed).to(device))
    linear.lora_scale = alpha / rank
    linear.weight.requires_grad_(False)
    return linear


def apply_peft(model: nn.Module, peft, seed: int) -> None:
    """Apply `peft` (a PeftConfig) to an unparallelized GPT: adapters added and base weights frozen."""
    if peft.method == "none":
        return
    if peft.method == "lora":
        for p in model.parameters():
            p.requires_grad_(False)
        for key, block in model.layers.items():
            for target in lora_targets(model.cfg, peft.lora_targets):
                add_lora(block.get_submodule(target), peft.lora_rank, peft.lora_alpha, seed,
                         f"layers.{key}.{target}")
        return
    if peft.method == "freeze":
        keys = list(model.layers.keys())
        trainable = set(keys[len(keys) - peft.trainable_last_layers:])
        for key, block in model.layers.items():
            block.requires_grad_(key in trainable)
        model.tok_embeddings.requires_grad_(False)
        if not model.tied:
            model.output.requires_grad_(True)
        model.norm.requires_grad_(True)
        return
    raise ValueError(f"peft.method={peft.method!r}")


def check_pipeline_stages(method: str, trainable_last_layers: int, layout) -> None:
    """`freeze` trains the last blocks and the final norm, which live on the last pipeline stages: a pipeline
    rank holding only frozen blocks (and the frozen embedding) would have nothing to train and no gradient to
    send back, so refuse it, naming the smallest `trainable_last_layers` that gives every rank a block."""
    if method != "freeze" or layout.pp == 1:
        return
    starts = [sum(layout.stage_layers[:s]) for s in range(layout.num_stages)]
    num_layers = sum(layout.stage_layers)
    last_block = {r: max(starts[s] + layout.stage_layers[s] - 1 for s in layout.stages_of(r))
                  for r in range(layout.pp) if layout.num_stages - 1 not in layout.stages_of(r)}
    if not last_block:
        return
    rank = min(last_block, key=last_block.get)
    if last_block[rank] >= num_layers - trainable_last_layers:
        return
    raise ConfigError(f"peft.method='freeze' with peft.trainable_last_layers={trainable_last_layers} and parallel.pp="
                      f"{layout.pp}: pipeline rank {rank} holds only frozen blocks (the last it holds is block "
                      f"{last_block[rank]} of {num_layers}) and would train nothing; set peft.trainable_last_layers >= "
                      f"{num_layers - last_block[rank]} or a smaller parallel.pp")


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """{"trainable_params", "total_params"} of an unsharded model (a tied matrix counted once)."""
    params = list(model.parameters())
    return {"trainable_params": sum(p.numel() for p in params if p.requires_grad),
            "total_params": sum(p.numel() for p in params)}


def lora_tensor_parallel_style(module: nn.Module, style):
    """The tensor-parallel style for `module` given the plain one: LoRA projections get A and B split to
    match W's column or row split (see the module docstring); everything else keeps `style`."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not isinstance(module, LoRALinear) or type(style) not in (ColwiseParallel, RowwiseParallel):
        return style
    rowwise = type(style) is RowwiseParallel
    new = (_LoRARowwise if rowwise else _LoRAColwise).__new__(_LoRARowwise if rowwise else _LoRAColwise)
    new.__dict__.update(style.__dict__)
    return new


def _distribute(module: nn.Module, mesh, placements: dict, src_data_rank) -> None:
    from torch.distributed.tensor import distribute_tensor

    for pname, placement in placements.items():
        p = getattr(module, pname)
        module.register_parameter(pname, nn.Parameter(
            distribute_tensor(p, mesh, [placement], src_data_rank=src_data_rank), requires_grad=p.requires_grad))


def _styles():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    class LoRAColwise(ColwiseParallel):
        """W, B and the bias split by output rows (Shard(0)); A replicated."""

        def _partition_linear_fn(self, name, module, device_mesh):
            bias = {"bias": Shard(0)} if module.bias is not None else {}  # (Qwen2's q/k/v)
            _distribute(module, device_mesh, {"weight": Shard(0), "lora_a": Replicate(), "lora_b": Shard(0), **bias},
                        self.src_data_rank)

    class LoRARowwise(RowwiseParallel):
        """W and A split by input columns (Shard(1)); B replicated."""

        def _partition_linear_fn(self, name, module, device_mesh):
            bias = {"bias": Replicate()} if module.bias is not None else {}
            _distribute(module, device_mesh, {"weight": Shard(1), "lora_a": Shard(1), "lora_b": Replicate(), **bias},
                        self.src_data_rank)

    return LoRAColwise, LoRARowwise


_LoRAColwise, _LoRARowwise = _styles()
