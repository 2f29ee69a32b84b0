"""The pieces of a step that do not depend on the layout: compute precision, the AdamW optimizer and its
LR schedule, unsharded gradients (tests) and peak memory."""

from __future__ import annotations

import math
import resource
from typing import Callable

import torch

from raydist.config import Config


def compute_dtype_for(cfg: Config, device: torch.device) -> torch.dtype:
    if cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def lr_lambda(cfg: Config) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine decay to min_lr_ratio at the last step."""
    t = cfg.train

    def factor(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        span = max(1, t.steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    # An empty group (LoRA trains only matrices) is left out: DCP's flattened optimizer state cannot load one
    groups = [g for g in ({"params": decay, "weight_decay": cfg.train.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    # One fused kernel per parameter group on CUDA (torch.optim.AdamW's `fused`, which takes DTensor
    # parameters too); the multi-tensor `foreach` path elsewhere (CPU results stay what the tests compare).
    params = [p for group in groups for p in group["params"]]
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    kind = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2), eps=1e-8, **kind)


def full_gradients(model: torch.nn.Module, aliases: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """{name: unsharded gradient} on every rank (a collective for sharded parameters); `aliases` renames
    parameters the unsplit model knows by another name (a pipeline's tied output copy)."""
    out = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad
        full = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().float().cpu().clone()
        out[(aliases or {}).get(name, name)] = full
    return out


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
