"""Activation checkpointing (recompute) policies for the decoder's blocks.

- `none`: keep every activation for backward.
- `full`: each block is a checkpoint region; only block inputs are saved, the block is re-run in backward.
- `every_k`: segments of k consecutive blocks are checkpoint regions (Chen et al., "Training Deep Nets with
  Sublinear Memory Cost", 2016: the sqrt(n) rule, k = round(sqrt(L)) by default, keeps L/k segment inputs plus
  one segment's activations during its recompute: O(sqrt(L)) memory for one extra forward).
- `selective`: each block is a region, but outputs of matrix multiplies and attention are saved; only the
  cheap elementwise ops (norms, RoPE, SiLU, products) are recomputed (Korthikanti et al., "Reducing
  Activation Recomputation in Large Transformer Models", 2022). The policy sees operators at torch's
  dispatcher, so it keeps the outputs of the kernels that actually run: aten's mm and fused attention on
  the torch path, and raydist's Triton kernels, which are registered as custom operators
  (`raydist::matmul`, `raydist::swiglu`, `raydist::flash_attention`; raydist.kernels) for that reason.
  An autograd.Function would be invisible here: its ops would all be recomputed and `selective` would
  silently equal `full`.

The policy is installed as `model.run_layers`, which the model's forward calls with its blocks, so
parameter names (and so checkpoints) do not change with the policy.
"""

from __future__ import annotations

import functools
import math

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from raydist.errors import ConfigError

_ops = torch.ops.aten
# Ops whose outputs `selective` keeps (expensive to recompute); everything else is recomputed.
# raydist's own kernels are named rather than imported, so this module does not load raydist.kernels (and
# with it the model and config modules); the names are those of raydist/kernels/attention.py and matmul.py.
SAVE_CUSTOM_OPS = frozenset({"raydist::matmul", "raydist::swiglu", "raydist::flash_attention"})
SAVE_OPS = {
    _ops.mm.default,
    _ops.addmm.default,
    _ops.bmm.default,
    _ops._scaled_dot_product_flash_attention.default,
    _ops._scaled_dot_product_efficient_attention.default,
    _ops._scaled_dot_product_flash_attention_for_cpu.default,
    _ops._scaled_dot_product_cudnn_attention.default,
}


def keeps(op) -> bool:
    """Whether `selective` keeps the output of operator `op` (an OpOverload) rather than recompute it."""
    if op in SAVE_OPS:
        return True
    schema = getattr(op, "_schema", None)
    return schema is not None and schema.name in SAVE_CUSTOM_OPS


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if keeps(op) else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def segment_size(policy: str, num_layers: int, k: int = 0) -> int:
    if policy == "every_k":
        return k or max(1, round(math.sqrt(num_layers)))
    return 1


def _run_segment(layers, h, cos, sin):
    for layer in layers:
        h = layer(h, cos, sin)
    return h


def make_run_layers(policy: str, num_layers: int, k: int = 0):
    """A `run_layers(layers, h, cos, sin)` for the policy, or None for `none`."""
    if policy == "none":
        return None
    if policy not in ("full", "every_k", "selective"):
        raise ConfigError(f"train.activation_checkpoint={policy!r} is not one of none, full, every_k, selective")
    size = segment_size(policy, num_layers, k)
    extra = {"context_fn": _selective_context} if policy == "selective" else {}

    def run_layers(layers, h, cos, sin):
        if not torch.is_grad_enabled():
            return _run_segment(layers, h, cos, sin)
        for start in range(0, len(layers), size):
            segment = layers[start:start + size]
            h = checkpoint(functools.partial(_run_segment, segment), h, cos, sin,
                           use_reentrant=False, preserve_rng_state=False, **extra)
        return h

    run_layers.policy = policy
    run_layers.segment = size
    return run_layers


def apply_activation_checkpointing(model, policy: str, k: int = 0) -> None:
    model.run_layers = make_run_layers(policy, len(model.layers), k)
