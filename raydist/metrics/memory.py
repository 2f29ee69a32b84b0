"""Bytes a rank actually holds: parameters, gradients and optimizer state, counted from local tensors.

Sharded parameters are DTensors; only their local shard lives on this rank (`to_local()`), so the
counts below are what FSDP/TP really save, to compare with the seed's model (16N bytes per replica in
fp32 with Adam: 4 weights + 4 gradients + 8 moments; 16N/p fully sharded over p ranks).
"""

from __future__ import annotations

import torch


def local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """{'params', 'grads', 'optimizer', 'total'} in bytes on this rank (tied parameters counted once)."""
    params = list({id(p): p for p in model.parameters()}.values())
    out = {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params),
        "optimizer": 0,
    }
    if optimizer is not None:
        for state in optimizer.state.values():
            out["optimizer"] += sum(local_bytes(v) for v in state.values()
                                    if isinstance(v, torch.Tensor) and v.ndim > 0)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out
