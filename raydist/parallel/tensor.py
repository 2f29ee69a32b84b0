"""Megatron tensor parallelism (+ sequence parallelism) for the decoder, on the mesh's `tp` axis.

Shoeybi et al.'s split ("Megatron-LM", 2019), per block (tp ranks, B batch, T sequence, D d_model, H/K
query/kv heads, F ffn):

    attention:  q, k, v projections column-parallel (each rank holds H/tp query heads and K/tp kv heads)
                o projection row-parallel: partial sums (B, T, D) that are all-reduced ("g" in Shoeybi et al.)
    MLP:        gate and up column-parallel: silu(x Wgate_r^T) * (x Wup_r^T) needs no communication
                down row-parallel: partial sums, all-reduced
    embedding:  vocabulary-parallel (rows V/tp per rank; a token outside a rank's rows contributes zero,
                the partial embeddings are all-reduced; `VocabParallelEmbedding`)
    head:       column-parallel over the vocabulary: logits stay sharded (B, T, V/tp) and the loss is
                `vocab_loss.vocab_parallel_cross_entropy`, which never gathers them; or the head computes
                the loss itself, vocabulary-parallel, a chunk of tokens at a time (the fused loss,
                models.loss.linear_cross_entropy), and never holds the logits at all

The residual stream between these regions is a plain local tensor:
- without SP it is the whole (B, T, D) on every rank; the input of attention and of the MLP is marked
  Replicate, so backward all-reduces its gradient ("f"): 2 all-reduces forward + 2 backward per block;
- with SP (Korthikanti et al. 2022) it is this rank's (B, T/tp, D) slice of the sequence; norms run on the
  slice, the input of attention and of the MLP is all-gathered over T, and o/down reduce-scatter their
  partial sums back to slices instead of all-reducing: the same bytes (an all-reduce is a
  reduce-scatter plus an all-gather), a tp-th of the norm/residual activations and their compute.

Grouped-query attention with K < tp kv heads: tp must be a multiple of K; the kv projections are then
replicated and each rank computes the kv head its query heads use (rank * K // tp), and their gradients
(partial sums over the ranks sharing a head) are summed across tp. Any other split is rejected by
`raydist.parallel.layout.validate` before workers start.

Parameters become DTensors on the tp mesh (column: Shard(0), row: Shard(1), embedding and head: Shard(0),
norms and replicated kv: Replicate), so FSDP2 shards them further over dp (a 2-D dp_shard x tp layout) and
checkpoints keep the unsharded names and shapes. A tied head shares the embedding's Shard(0) matrix.

`parallelize()` calls `loss_fn = apply_tensor_parallel(model, mesh, sequence_parallel)` first when tp > 1 and hands
`loss_fn` to the Trainer (`ParallelModel.loss_fn`). Measured bytes per block: benchmarks/comm_volume.py.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               parallelize_module)

from raydist.models.loss import cross_entropy
from raydist.models.peft import lora_tensor_parallel_style
from raydist.parallel.mesh import Mesh
from raydist.parallel.vocab_loss import vocab_parallel_cross_entropy


class NormParallel(ParallelStyle):
    """A norm on the residual stream's layout: weights Replicate over tp, input a local tensor in `layout`
    (Replicate: the whole sequence; Shard(1): this rank's tokens), output a local tensor in that layout.

    Under SP each rank's weight gradient covers its tokens only (a Partial sum); FSDP2 sums it over tp
    before its reduce-scatter, and without FSDP `gradient_in_parameter_layout` does."""

    def __init__(self, layout: Placement):
        super().__init__()
        self.layout = layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layout = self.layout

        def to_layout(mod, inputs, mesh):
            x, *rest = inputs
            x = DTensor.from_local(x, mesh, (layout,), run_check=False) if not isinstance(x, DTensor) else x
            return (x.redistribute(placements=(layout,)) if x.placements != (layout,) else x, *rest)

        # partition_fn None: distribute_module replicates every parameter (a broadcast from tp rank 0)
        return distribute_module(module, device_mesh, None, to_layout, lambda mod, out, mesh: out.to_local())


class ReplicatedKVHeads(ParallelStyle):
    """A kv projection (K * E outputs) when K < tp: weight Replicate; the rank computes all K heads from
    the replicated input and keeps head `rank * K // tp` (the one its H/tp query heads read).

    The local result's gradient is non-zero only in that head's columns and only for this rank's query
    heads, so it is declared Partial: summed over tp it is the full gradient (of the weight and, joined
    with the column-parallel q projection's Partial gradient, of the input)."""

    def __init__(self, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        head = rank * self.num_kv_heads // tp
        cols = slice(head * self.head_dim, (head + 1) * self.head_dim)

        def replicated(mod, inputs, mesh):
            x, *rest = inputs
            return (x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, (Replicate(),), run_check=False),
                    *rest)

        def own_head(mod, out, mesh):  # out: Replicate (B, T, K * E) -> local (B, T, E)
            return out.to_local(grad_placements=(Partial(),))[..., cols]

        return distribute_module(module, device_mesh, None, replicated, own_head)


class VocabParallelEmbedding(ParallelStyle):
    """nn.Embedding with its rows split over tp (Shard(0): rank r holds ids [r V/tp, (r+1) V/tp)).

    Each rank looks the tokens up in its own rows and zeroes the others, and the partial embeddings are
    summed straight into the residual layout (an all-reduce; a reduce-scatter under SP). Backward gives
    each rank the gradient of its rows only. (torch's RowwiseParallel on an embedding computes the same
    forward but builds the whole (V, D) weight gradient on every rank, then keeps V/tp rows of it.)"""

    def __init__(self, layout: Placement):
        super().__init__()
        self.layout = layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding) or module.padding_idx is not None or module.max_norm is not None:
            raise ValueError(f"VocabParallelEmbedding supports a plain nn.Embedding, got {module}")
        module.register_parameter("weight", nn.Parameter(distribute_tensor(module.weight.detach(), device_mesh,
                                                                           (Shard(0),)),
                                                         requires_grad=module.weight.requires_grad))  # peft
        layout = self.layout

        def forward(tokens: torch.Tensor) -> torch.Tensor:  # tokens (B, T), the same on every tp rank
            weight = module.weight  # looked up per call: FSDP swaps in the gathered parameter
            rows = weight.to_local()  # (V/tp, D); its gradient comes back as Shard(0)
            local_ids = tokens - weight.device_mesh.get_local_rank() * rows.shape[0]
            outside = (local_ids < 0) | (local_ids >= rows.shape[0])
            partial = F.embedding(local_ids.masked_fill(outside, 0), rows).masked_fill(outside[..., None], 0.0)
            summed = DTensor.from_local(partial, weight.device_mesh, (Partial(),), run_check=False)
            return summed.redistribute(placements=(layout,)).to_local()  # (B, T, D) or (B, T/tp, D)

        module.forward = forward
        return module


class MixtureOfExpertsParallel(ParallelStyle):
    """A mixture of experts' feed-forward: the router replicated, every expert's MLP split Megatron's way
    (gate and up by hidden unit, down by its inputs), the partial outputs reduced into the residual layout
    (raydist.models.moe.MoEFeedForward.shard_tensor_parallel, which owns the module's names)."""

    def __init__(self, layout: Placement):
        super().__init__()
        self.layout = layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.shard_tensor_parallel(device_mesh, self.layout)
        return module


def _block_style(role: str, cfg, tp: int, layout: Placement) -> ParallelStyle:
    """The style of a block module of `role` (raydist.models.gpt.block_roles says which module has which)."""
    if role == "column":
        return ColwiseParallel()
    if role == "row":  # partial sums reduced into the residual stream's layout
        return RowwiseParallel(output_layouts=layout)
    if role == "kv":
        return ColwiseParallel() if cfg.num_kv_heads % tp == 0 else ReplicatedKVHeads(cfg.num_kv_heads, cfg.head_size)
    if role == "norm":
        return NormParallel(layout)
    if role == "moe":
        return MixtureOfExpertsParallel(layout)
    if role == "head_norm":
        # (B, T, heads, E) with this rank's heads: Shard(2), so each rank's weight gradient covers its heads
        # (with replicated kv heads, its query heads' share of them) and the sum over tp is the whole
        # gradient (torchtitan's Qwen3 plan does the same)
        return NormParallel(Shard(2))
    if role in ("attention_input", "mlp_input"):
        # the input becomes one Replicate DTensor shared by the projections under it, so their input
        # gradients add up as Partial sums and are reduced once, at this boundary; attention(x, cos, sin)
        # passes its RoPE tables through
        rest = (None, None) if role == "attention_input" else ()
        return PrepareModuleInput(input_layouts=(layout, *rest), desired_input_layouts=(Replicate(), *rest))
    raise ValueError(f"no tensor-parallel style for a block module of role {role!r}")


def block_plan(roles: dict[str, str], cfg, tp: int, layout: Placement) -> dict[str, ParallelStyle]:
    """The plan for one block: {module name inside the block: style} from the model's {name: role}."""
    return {name: _block_style(role, cfg, tp, layout) for name, role in roles.items()}


class VocabParallelHead(ColwiseParallel):
    """The head split over the vocabulary (column-parallel): its logits stay Shard(-1), and its loss, where the
    model asks the head for it (`forward(x, targets)`: the fused, vocabulary-parallel loss of
    models.loss.linear_cross_entropy), passes out as it is: a plain scalar, the same on every tp rank."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if not isinstance(outputs, DTensor):
            return outputs
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


def root_plan(roles: dict[str, str], layout: Placement) -> dict[str, ParallelStyle]:
    """The root's plan (embedding, final norm and head, each absent on some pipeline stages) from its roles."""
    styles = {"vocab_embedding": lambda: VocabParallelEmbedding(layout), "norm": lambda: NormParallel(layout),
              # logits (B, T, V) stay Shard(-1): a DTensor, so the loss finds the mesh and its vocabulary slice
              "vocab_head": lambda: VocabParallelHead(input_layouts=layout, output_layouts=Shard(-1),
                                                      use_local_output=False)}
    return {name: styles[role]() for name, role in roles.items()}


def _fill_positions(tp: int, first_stage: bool):
    """Under SP the model's input is T/tp tokens per rank on stages after the first (and its embedding
    output is), but RoPE must index the whole gathered sequence that attention sees: pass positions
    0..T-1 when the caller gave none (context parallelism gives its own)."""

    def hook(module, args, kwargs):
        tokens = args[0] if args else kwargs["tokens"]
        if (args[1] if len(args) > 1 else kwargs.get("positions")) is not None:
            return None
        length = tokens.shape[1] if first_stage else tokens.shape[1] * tp
        rest = {k: v for k, v in kwargs.items() if k not in ("tokens", "positions")}  # targets, cache
        return (tokens, torch.arange(length, device=tokens.device)), rest

    return hook


def gradient_in_parameter_layout(param: torch.Tensor) -> None:
    """Post-accumulate hook (TP without FSDP): lay the gradient out as its parameter, once per backward.

    The norm weights under SP and the replicated kv heads get Partial gradients (each rank's covers its
    own tokens or query heads): one all-reduce over tp here. Left Partial, DTensor all-reduces them again
    in every clipping and AdamW op that reads them (4 times per step, counted on TP 2 + SP)."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(placements=param.placements)


def refresh_parameters(module: nn.Module) -> None:
    """Give every DTensor parameter of `module` a fresh Parameter object over the same storage (shared ones
    stay shared). `to_empty` moves DTensor parameters with `swap_tensors`, after which their gradient
    accumulator no longer runs post-accumulate hooks (seen with torch 2.13 on CPU): the hooks of
    `register_gradient_layout` must go on fresh parameters, before the optimizer sees them."""
    fresh: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        for name, param in list(mod._parameters.items()):
            if isinstance(param, DTensor):
                if id(param) not in fresh:
                    fresh[id(param)] = nn.Parameter(param.detach(), requires_grad=param.requires_grad)
                mod._parameters[name] = fresh[id(param)]


def register_gradient_layout(module: nn.Module) -> None:
    """Install `gradient_in_parameter_layout` on every DTensor parameter of `module` (FSDP2 replaces the
    parameters and redistributes their gradients itself before its reduce-scatter)."""
    for param in module.parameters():
        if isinstance(param, DTensor) and param.requires_grad:  # frozen (peft) weights get no gradient
            param.register_post_accumulate_grad_hook(gradient_in_parameter_layout)


def apply_tensor_parallel(model: nn.Module, mesh: Mesh, sequence_parallel: bool = False) -> Callable:
    """Shard `model` (a raydist GPT, before FSDP) over `mesh["tp"]`; returns the loss function for its
    logits (vocabulary-parallel where this rank holds the head).

    Move the model to its device before (or let FSDP move it after): `Module.to()` replaces DTensor
    parameters with new objects (`swap_tensors`), which drops the gradient hooks installed here."""
    tp_mesh = mesh["tp"]
    tp = tp_mesh.size()
    layout: Placement = Shard(1) if sequence_parallel else Replicate()
    blocks, roots = model.tensor_parallel_roles()
    for block in model.layers.values():
        plan = {key: lora_tensor_parallel_style(block.get_submodule(key), style)  # LoRA: A/B follow W's split
                for key, style in block_plan(blocks, model.cfg, tp, layout).items()}
        parallelize_module(block, tp_mesh, plan)
    tied = model.tied
    parallelize_module(model, tp_mesh, root_plan(roots, layout))
    if tied:  # both Shard(0) over the vocabulary: share the embedding's matrix again
        model.tie_head()
    if sequence_parallel:
        model.register_forward_pre_hook(_fill_positions(tp, "vocab_embedding" in roots.values()), with_kwargs=True)
    register_gradient_layout(model)
    return vocab_parallel_cross_entropy if "vocab_head" in roots.values() else cross_entropy

