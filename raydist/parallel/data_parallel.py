"""Data-parallel strategies: how the gradients of ranks that saw different data are combined, and how the
model computes in mixed precision. One object per run, chosen from the layout's `DataParallelKind`:

    NoDataParallel   one data-parallel rank (other parallelisms may still split the model)
    DDP              full replicas; bucketed gradient all-reduce overlapping backward (Li et al., "PyTorch
                     Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020)
    FSDP             FSDP2 (`fully_shard`, ZeRO-3: Rajbhandari et al., "ZeRO: Memory Optimizations Toward
                     Training Trillion Parameter Models", SC 2020) per block and at the root, over
                     dp_shard x cp; HSDP when the mesh also has replicas (sharded within, all-reduced across)

Each strategy answers the three questions the step runners ask:
- `wrap(module)`: the module forward is called on (after tensor/context parallelism and recompute);
- gradient sync with accumulation: only the last of the step's micro-batches communicates
  (`accumulate(module, is_last)` for the accumulation runner; `pipeline_hooks(chunks, split_backward)`
  for the pipeline, where a chunk's last weight gradient comes at a schedule-defined point: its last B,
  or its last W when a zero-bubble schedule splits the backward);
- mixed precision: FSDP casts parameters itself (bf16 compute, fp32 reduction); the others run under
  autocast (`autocast(device_type)`), so their activations between pipeline stages stay fp32.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
from torch import nn

from raydist.parallel.layout import DataParallelKind
from raydist.parallel.mesh import Mesh

# (chunk index on this pipeline rank, whether this is its last weight-gradient action of the step) -> None
BackwardHook = Callable[[int, bool], None]
BeforeBackward = BackwardHook


class NoDataParallel:
    kind = DataParallelKind.NONE

    def __init__(self, mesh: Mesh, device: torch.device, compute_dtype: torch.dtype = torch.float32):
        self.mesh, self.device, self.compute_dtype = mesh, device, compute_dtype

    @property
    def moves_model(self) -> bool:
        """Whether `wrap` places the parameters on the device itself (else the caller moves the model
        first: before tensor parallelism, since `Module.to` swaps DTensor parameters and drops their hooks)."""
        return False

    def wrap(self, module: nn.Module) -> nn.Module:
        return module

    def accumulate(self, module: nn.Module, is_last: bool):
        """Context for one micro-batch's forward and backward: gradients communicate only when `is_last`."""
        return contextlib.nullcontext()

    def pipeline_hooks(self, chunks: Sequence[nn.Module],
                       split_backward: bool = False) -> tuple[BackwardHook | None, BackwardHook | None]:
        """The pipeline executor's (before_backward, after_backward) for wrapped `chunks`: called around each
        action that accumulates weight gradients (B, or W when `split_backward`), is_last on a chunk's
        final one of the step."""
        return None, None

    def autocast(self, device_type: str):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.compute_dtype)

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of activations between pipeline stages (autocast keeps the residual stream fp32)."""
        return torch.float32


class DDP(NoDataParallel):
    kind = DataParallelKind.DDP

    def wrap(self, module: nn.Module) -> nn.Module:
        return apply_ddp(module, self.mesh.dp_cp.get_group(), self.device)  # cp ranks average gradients too

    def accumulate(self, module: nn.Module, is_last: bool):
        return contextlib.nullcontext() if is_last else module.no_sync()

    def pipeline_hooks(self, chunks: Sequence[nn.Module], split_backward: bool = False):
        return ddp_grad_sync(chunks), None  # W accumulates through AccumulateGrad: DDP's hooks fire there


class FSDP(NoDataParallel):
    """FSDP2 per transformer block (the unit of all-gather in forward and of reduce-scatter in backward)
    plus the root unit (embedding, final norm, head). On a 2-D (dp_replicate, dp_shard x cp) mesh: HSDP."""

    def __init__(self, mesh: Mesh, device: torch.device, compute_dtype: torch.dtype = torch.float32, *,
                 reshard_after_forward: bool = True, forward_prefetch: bool = True):
        super().__init__(mesh, device, compute_dtype)
        self.reshard_after_forward, self.forward_prefetch = reshard_after_forward, forward_prefetch
        self.kind = DataParallelKind.HSDP if mesh.spec.dp_replicate > 1 else DataParallelKind.FSDP

    @property
    def moves_model(self) -> bool:
        return True

    def wrap(self, module: nn.Module) -> nn.Module:
        from raydist.parallel.fsdp import apply_fsdp

        apply_fsdp(module, self.mesh.fsdp, self.compute_dtype, reshard_after_forward=self.reshard_after_forward,
                   forward_prefetch=self.forward_prefetch, expert_mesh=self.mesh.expert_fsdp,
                   dp_size=self.mesh.dp_cp.size())
        return module

    def accumulate(self, module: nn.Module, is_last: bool):
        module.set_requires_gradient_sync(is_last)  # skip reduce-scatter on all but the last micro-batch
        return contextlib.nullcontext()

    def pipeline_hooks(self, chunks: Sequence[nn.Module], split_backward: bool = False):
        if split_backward:
            return None, fsdp_split_grad_sync(chunks)
        return fsdp_grad_sync(chunks, hold=not self.reshard_after_forward), None

    def autocast(self, device_type: str):
        return contextlib.nullcontext()  # the mixed-precision policy casts parameters (fsdp.py)

    @property
    def activation_dtype(self) -> torch.dtype:
        return self.compute_dtype


def make_data_parallel(kind: DataParallelKind, mesh: Mesh, device: torch.device, compute_dtype: torch.dtype,
                       *, reshard_after_forward: bool = True, forward_prefetch: bool = True) -> NoDataParallel:
    if kind in (DataParallelKind.FSDP, DataParallelKind.HSDP):
        return FSDP(mesh, device, compute_dtype, reshard_after_forward=reshard_after_forward,
                    forward_prefetch=forward_prefetch)
    if kind == DataParallelKind.DDP:
        return DDP(mesh, device, compute_dtype)
    return NoDataParallel(mesh, device, compute_dtype)


def apply_ddp(module: nn.Module, group, device: torch.device) -> nn.Module:
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    # No buffer sync in forward: the only buffers are the RoPE tables, identical everywhere. torch 2.13
    # names it `forward_sync_buffers` (and deprecates `broadcast_buffers`); torch 2.11 has only the latter.
    no_sync = ({"forward_sync_buffers": False}
               if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
               else {"broadcast_buffers": False})
    return DistributedDataParallel(
        module,
        process_group=group,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
        **no_sync,
    )


def ddp_grad_sync(chunks: Sequence[nn.Module]) -> BackwardHook:
    """DDP-wrapped pipeline chunks: forwards never arm the all-reduce (`require_backward_grad_sync` off, as
    under `no_sync()`); each chunk's last weight-gradient action (its last B, or its last W under a split
    backward) arms it by hand, so its gradients are all-reduced once, after the M micro-batches
    accumulated locally. (A DDP forward decides sync for the *next* backward, which 1F1B does not run
    next, hence the manual arming, as torch.distributed.pipelining does.) A W accumulates through the
    parameters' AccumulateGrad nodes (`raydist.schedule.split_backward`), where DDP's bucket hooks sit."""
    for chunk in chunks:
        chunk.require_backward_grad_sync = False

    def hook(chunk_index: int, is_last: bool) -> None:
        if is_last:
            chunks[chunk_index].reducer.prepare_for_backward([])

    return hook


def fsdp_grad_sync(chunks: Sequence[nn.Module], hold: bool = False) -> BackwardHook:
    """FSDP2 pipeline chunks: accumulate unsharded gradients locally and reduce-scatter once, during each
    chunk's last backward of the step. `hold` (parameters not resharded after forward): nor after any
    backward but the chunk's last, so a chunk is all-gathered once per step, not again for each micro-batch's
    forward after a backward (torch.distributed.pipelining's stage does the same with
    `set_reshard_after_backward`)."""

    def hook(chunk_index: int, is_last: bool) -> None:
        chunks[chunk_index].set_requires_gradient_sync(is_last)
        if hold:
            chunks[chunk_index].set_reshard_after_backward(is_last)

    return hook


def fsdp_split_grad_sync(chunks: Sequence[nn.Module]) -> BackwardHook:
    """FSDP2 pipeline chunks under a split backward (zbh1, zbv): the `after_backward` hook.

    FSDP2 reduce-scatters in its post-backward hook, which autograd fires when a module's *input*
    gradient is computed: in B, before any weight gradient exists; W's partial backward (from the
    boundary nodes to the parameters) never fires it. So gradient sync stays off in every B and W, each W
    leaves its gradient in FSDP's accumulator (fp32 when the compute dtype is lower, as FSDP's own
    no-sync accumulation does), and after the chunk's last W this runs FSDP's post-backward on every
    parameter group with sync on (the reduce-scatter, HSDP's all-reduce) and its end-of-backward callback
    (waits for the reductions, resets per-step state) - the calls torch.distributed.pipelining's
    `perform_reduce_grad` makes (private FSDP2 state: `_get_fsdp_state`, its parameter groups)."""

    def quiet(chunk: nn.Module) -> None:
        chunk.set_requires_gradient_sync(False)
        chunk.set_is_last_backward(False)

    for chunk in chunks:
        quiet(chunk)

    def hook(chunk_index: int, is_last: bool) -> None:
        chunk = chunks[chunk_index]
        state = chunk._get_fsdp_state()
        groups = [g for s in state._state_ctx.all_states for g in fsdp_param_groups(s)]
        if not is_last:
            for param in (p for g in groups for p in g.fsdp_params):
                param.accumulate_unsharded_grad_if_needed()
                param.to_accumulated_grad_if_needed()
            return
        chunk.set_requires_gradient_sync(True)
        chunk.set_is_last_backward(True)
        for group in reversed(groups):
            group.post_backward()
        state._root_post_backward_final_callback()
        quiet(chunk)

    return hook


def fsdp_param_groups(state) -> list:
    """The parameter groups of one FSDP2 state: `_fsdp_param_groups` (a list, or None) since torch 2.13,
    `_fsdp_param_group` (one, or None) before."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups or [])
    group = state._fsdp_param_group
    return [] if group is None else [group]
