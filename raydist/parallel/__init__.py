"""`parallelize(model, mesh, cfg)`: apply the parallel dimensions to a model in a fixed order.

    [pipeline: split into this rank's chunks, then for each chunk:]
    tensor parallel (+ sequence parallel)  ->  context parallel  ->  activation checkpointing
    ->  FSDP / HSDP, or DDP

TP comes first because FSDP shards the TP-local DTensors (a 2-D dp_shard x tp layout); checkpointing
comes before FSDP so that recompute re-runs FSDP's unshard hooks inside the region. Context parallelism
replaces each block's attention function (on the TP-local heads) and returns the sequence-sharding hook.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from raydist.config import Config
from raydist.mesh import Mesh
from raydist.models.gpt import cross_entropy
from raydist.parallel.checkpointing import apply_activation_checkpointing


@dataclass
class ParallelModel:
    """The model as training sees it: `module` is what forward is called on (a DDP wrapper, or the
    FSDP-managed model itself); `model` is the underlying decoder (its state dict has the unsharded
    names); `kind` says which data-parallel wrapper is in use."""

    module: torch.nn.Module
    model: torch.nn.Module
    kind: str  # "none" | "ddp" | "fsdp" | "hsdp"
    compute_dtype: torch.dtype
    # How logits become the mean loss over this rank's tokens (tensor.py swaps in a vocabulary-parallel one)
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
    # (inputs, targets) -> (local inputs, local targets, positions): context.py's sequence sharding
    shard_sequence: Callable | None = None
    # Pipeline parallelism: this rank's chunks (unwrapped, and as forward is called on them), and names
    # of parameters the unsplit model knows by another name (a tied output copy)
    chunks: list[torch.nn.Module] | None = None
    chunk_modules: list[torch.nn.Module] | None = None
    aliases: dict[str, str] = field(default_factory=dict)

    def gradient_sync(self, enabled: bool):
        """Context for one micro-batch: gradient communication only when `enabled` (the last one)."""
        if self.kind == "ddp" and not enabled:
            return self.module.no_sync()
        if self.kind in ("fsdp", "hsdp"):
            self.module.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()

    @property
    def autocast_needed(self) -> bool:
        """FSDP's mixed-precision policy casts parameters itself; other layouts use autocast."""
        return self.compute_dtype != torch.float32 and self.kind not in ("fsdp", "hsdp")


def data_parallel_kind(mesh: Mesh) -> str:
    s = mesh.spec
    if s.dp_shard * s.cp > 1 or (s.tp > 1 and s.dp_replicate > 1):
        return "hsdp" if s.dp_replicate > 1 else "fsdp"
    if s.dp_replicate > 1:
        return "ddp"
    return "none"


def _parallelize_module(model: torch.nn.Module, mesh: Mesh, cfg: Config, device: torch.device,
                        compute_dtype: torch.dtype) -> tuple[torch.nn.Module, str, Callable, Callable | None]:
    """TP -> CP -> activation checkpointing -> FSDP/HSDP or DDP on one module (the model, or a pipeline
    chunk). Returns (the module forward is called on, the data-parallel kind, the loss function, the
    sequence-sharding hook)."""
    kind = data_parallel_kind(mesh)
    if kind not in ("fsdp", "hsdp"):
        # before TP: Module.to() swaps DTensor parameters for new objects, dropping their gradient hooks
        model.to(device)
    loss_fn = cross_entropy
    if mesh.spec.tp > 1:
        from raydist.parallel.tensor import apply_tensor_parallel

        loss_fn = apply_tensor_parallel(model, mesh, cfg)  # vocabulary-parallel where this rank has the head
    shard_sequence = None
    if mesh.spec.cp > 1:
        from raydist.parallel.context import apply_context_parallel

        shard_sequence = apply_context_parallel(model, mesh, cfg)
    apply_activation_checkpointing(model, cfg.train.activation_checkpoint, cfg.train.activation_checkpoint_k)
    if kind in ("fsdp", "hsdp"):
        from raydist.parallel.fsdp import apply_fsdp

        apply_fsdp(model, mesh.fsdp, compute_dtype,
                   reshard_after_forward=cfg.parallel.fsdp_reshard_after_forward,
                   forward_prefetch=cfg.parallel.fsdp_forward_prefetch)
        return model, kind, loss_fn, shard_sequence
    if kind == "ddp":
        from raydist.parallel.ddp import apply_ddp

        return apply_ddp(model, mesh.dp_cp, device), kind, loss_fn, shard_sequence
    return model, kind, loss_fn, shard_sequence


def parallelize(model: torch.nn.Module, mesh: Mesh, cfg: Config, device: torch.device,
                compute_dtype: torch.dtype = torch.float32) -> ParallelModel:
    if mesh.spec.pp > 1:
        return _parallelize_pipeline(model, mesh, cfg, device, compute_dtype)
    module, kind, loss_fn, shard_sequence = _parallelize_module(model, mesh, cfg, device, compute_dtype)
    return ParallelModel(module, model, kind, compute_dtype, loss_fn, shard_sequence)


def _parallelize_pipeline(model: torch.nn.Module, mesh: Mesh, cfg: Config, device: torch.device,
                          compute_dtype: torch.dtype) -> ParallelModel:
    """Split into this pipeline rank's chunks (pp is the outer mesh axis), then parallelize each chunk
    on the rest of the mesh; `model` becomes a view over the chunks with the unsharded names. The loss
    function is the last stage's (vocabulary-parallel under TP)."""
    from raydist.parallel.pipeline import split_model, stage_view, tied_aliases

    p = cfg.parallel
    virtual = p.virtual_stages if p.pp_schedule == "interleaved" else 1
    chunks = split_model(model, mesh.local_rank("pp"), p.pp, virtual, seq_len=cfg.data.seq_len)
    wrapped, kind, loss_fn = [], "none", cross_entropy
    for chunk in chunks:
        module, kind, chunk_loss, _ = _parallelize_module(chunk, mesh, cfg, device, compute_dtype)  # no cp with pp
        wrapped.append(module)
        if chunk.output is not None:
            loss_fn = chunk_loss
    return ParallelModel(wrapped[0], stage_view(model, chunks), kind, compute_dtype, loss_fn, chunks=chunks,
                         chunk_modules=wrapped, aliases=tied_aliases(chunks))
