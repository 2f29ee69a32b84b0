"""`parallelize(model, mesh, layout, device)`: apply the parallel dimensions to a model in a fixed order.

    [pipeline: split into this rank's chunks, then for each chunk:]
    tensor parallel (+ sequence parallel)  ->  context parallel  ->  expert parallel  ->  activation
    checkpointing  ->  the data-parallel strategy's wrap (FSDP / HSDP, DDP, or nothing)

TP comes first because FSDP shards the TP-local DTensors (a 2-D dp_shard x tp layout); checkpointing
comes before FSDP so that recompute re-runs FSDP's unshard hooks inside the region. Context parallelism
replaces each block's attention function (on the TP-local heads); which tokens a cp rank holds is the
data's business (raydist.data.peers gives each rank only its own).
Everything is read from the `Layout`; model dimensions come from the model itself.

A model on the meta device (the Trainer builds it there) is parallelized without storage and given it by
`materialize(module)` (raydist.models.init: `to_empty` + buffers + keyed init) at the last point before
anything needs real values: after FSDP's wrap, so that `to_empty` allocates only this rank's shards, and
before DDP's, which broadcasts rank 0's parameters when it wraps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from raydist.models.loss import cross_entropy
from raydist.models.init import is_meta
from raydist.parallel.checkpointing import apply_activation_checkpointing
from raydist.parallel.data_parallel import NoDataParallel, make_data_parallel
from raydist.parallel.layout import Layout
from raydist.parallel.mesh import Mesh
from raydist.schedule.registry import placement_of


@dataclass
class ParallelModel:
    """The model as training sees it.

    `model` is the decoder with the unsharded parameter names (a view over this rank's chunks under a
    pipeline): what the optimizer, checkpoints and gradient checks see. `modules` are what forward is
    called on: the wrapped model, or this pipeline rank's wrapped chunks by chunk index."""

    model: nn.Module
    modules: list[nn.Module]
    data_parallel: NoDataParallel
    # How logits become the mean loss over this rank's tokens (tensor.py swaps in a vocabulary-parallel one)
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
    # Pipeline parallelism: this rank's unwrapped chunks (they carry the tied-embedding roles), and names
    # of parameters the unsplit model knows by another name (a tied output copy)
    chunks: list[nn.Module] | None = None
    aliases: dict[str, str] = field(default_factory=dict)
    # The head computes the loss with its matmul, chunk by chunk of tokens (`loss`; vocabulary-parallel
    # under TP), where kernels.loss allows it and the head can (models.loss.linear_cross_entropy)
    fused_loss: bool = False

    def loss(self, inputs: torch.Tensor, positions: torch.Tensor | None, targets: torch.Tensor,
             module: nn.Module | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
        """The mean loss over this rank's tokens of one micro-batch (`loss_fn`'s value) through `module`
        (default `self.module`; under a pipeline the chunk holding the last stage): without the logits
        where `fused_loss`, else `loss_fn` of the logits; times `scale` where given (masked data's
        raydist.training.runners.MaskScale). (A mixture of experts' balance loss enters backward inside its
        blocks: raydist.models.moe.)"""
        module = self.module if module is None else module
        if self.fused_loss:
            loss = module(inputs, positions, targets=targets)
        else:
            loss = self.loss_fn(module(inputs, positions), targets)
        return loss * scale if scale is not None else loss

    def set_micro_batches(self, micro_batches: int) -> None:
        """The step runs `micro_batches` micro-batches on this rank: a mixture of experts' blocks weigh their
        balance loss accordingly (raydist.models.moe.set_balance_weight)."""
        cfg = getattr(self.model, "cfg", None)
        if getattr(cfg, "moe_experts", 0):
            from raydist.models.moe import set_balance_weight

            set_balance_weight(self.model, cfg.moe_aux_coef, cfg.num_layers, micro_batches)

    @property
    def module(self) -> nn.Module:
        """The (first) module forward is called on."""
        return self.modules[0]

    @property
    def kind(self) -> str:
        return self.data_parallel.kind


Materialize = Callable[[nn.Module], object]  # gives a meta-device module storage and initial values


def _parallelize_module(model: nn.Module, mesh: Mesh, layout: Layout, data_parallel: NoDataParallel,
                        device: torch.device, materialize: Materialize | None = None
                        ) -> tuple[nn.Module, Callable]:
    """TP -> CP -> activation checkpointing -> the data-parallel wrap, on one module (the model, or a
    pipeline chunk). Returns (the module forward is called on, the loss function)."""
    on_meta = is_meta(model)
    if on_meta and materialize is None:
        raise ValueError("a model on the meta device needs `materialize` to give it storage")
    if not data_parallel.moves_model and not on_meta:
        model.to(device)  # before TP: Module.to() swaps DTensor parameters, dropping their gradient hooks
    loss_fn = cross_entropy
    if layout.tp > 1:
        from raydist.parallel.tensor import apply_tensor_parallel

        loss_fn = apply_tensor_parallel(model, mesh, layout.sequence_parallel)  # vocab-parallel on the head
    if layout.cp > 1:
        from raydist.parallel.context import apply_context_parallel

        apply_context_parallel(model, mesh, layout.cp_impl)
    if layout.ep > 1:  # experts split over ep before FSDP shards each over the rest (raydist.parallel.fsdp)
        from raydist.models.moe import moe_blocks
        from raydist.parallel.fsdp import shard_experts

        for moe in moe_blocks(model):
            shard_experts(moe.experts, mesh.ep, mesh.ep_tp)
    apply_activation_checkpointing(model, layout.activation_checkpoint, layout.activation_checkpoint_k)
    if on_meta and not data_parallel.moves_model:
        materialize(model)  # the whole (TP-local) model: DDP and single replicas hold all of it
        if layout.tp > 1:  # to_empty swapped the DTensor parameters, dropping TP's gradient-layout hooks
            from raydist.parallel.tensor import refresh_parameters, register_gradient_layout

            refresh_parameters(model)
            register_gradient_layout(model)
    wrapped = data_parallel.wrap(model)
    if on_meta and data_parallel.moves_model:
        materialize(model)  # FSDP: to_empty allocates this rank's shards only
    return wrapped, loss_fn


def parallelize(model: nn.Module, mesh: Mesh, layout: Layout, device: torch.device,
                compute_dtype: torch.dtype = torch.float32, materialize: Materialize | None = None,
                fused_loss: bool = False) -> ParallelModel:
    """`materialize(module)`: required when `model` is on the meta device (see the module docstring).
    `fused_loss`: the head computes the loss with its matmul where the layout allows (`ParallelModel`)."""
    data_parallel = make_data_parallel(layout.data_parallel_kind, mesh, device, compute_dtype,
                                       reshard_after_forward=layout.fsdp_reshard_after_forward,
                                       forward_prefetch=layout.fsdp_forward_prefetch)
    head = model.head
    fused = fused_loss and getattr(head, "fuses_loss", False) and getattr(head, "bias", None) is None
    if layout.pp == 1:
        module, loss_fn = _parallelize_module(model, mesh, layout, data_parallel, device, materialize)
        return ParallelModel(model, [module], data_parallel, loss_fn, fused_loss=fused)
    return _parallelize_pipeline(model, mesh, layout, data_parallel, device, materialize, fused)


def _parallelize_pipeline(model: nn.Module, mesh: Mesh, layout: Layout, data_parallel: NoDataParallel,
                          device: torch.device, materialize: Materialize | None = None,
                          fused_loss: bool = False) -> ParallelModel:
    """Split into this pipeline rank's chunks (pp is the outer mesh axis; the schedule's placement), then
    parallelize each chunk on the rest of the mesh; `model` becomes a view over the chunks with the
    unsharded names. The loss function is the last stage's (vocabulary-parallel under TP)."""
    from raydist.parallel.pipeline import split_model, stage_view, tied_aliases

    chunks = split_model(model, mesh.local_rank("pp"), layout.pp, layout.virtual_stages,
                         stage_layers=layout.stage_layers, placement=placement_of(layout.pp_schedule))
    wrapped, loss_fn = [], cross_entropy
    for chunk in chunks:
        module, chunk_loss = _parallelize_module(chunk, mesh, layout, data_parallel, device, materialize)
        wrapped.append(module)
        if chunk.head is not None:
            loss_fn = chunk_loss
    return ParallelModel(stage_view(model, chunks), wrapped, data_parallel, loss_fn, chunks=chunks,
                         aliases=tied_aliases(chunks), fused_loss=fused_loss)
