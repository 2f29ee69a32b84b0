"""Split the decoder into pipeline stages, and the cross-stage gradient bookkeeping that splitting implies.

Stages. With P pipeline ranks and V chunks per rank there are S = P V virtual stages; rank r holds
chunks c = 0..V-1, chunk c being virtual stage c P + r (Megatron's interleaved assignment). Stage 0 owns
the token embedding, stage S - 1 the final norm and output head (and the loss), and the L blocks are cut
into S contiguous runs (at least one block each) minimising the costliest stage:

    cost(stage) = sum of its blocks' cost + [stage 0] embedding + [stage S-1] (norm + head)
    balance="params": parameter counts (memory); balance="flops": training FLOPs per token (time; the
    embedding lookup is free, a block is 6 N_block + 12 T D, the head 6 V D).

Each chunk is the model itself with the blocks it does not own removed: `layers` stays a ModuleDict with
the original keys, so parameter names equal the unsharded model's (checkpoints need no renaming).

Tied embeddings (Megatron's approach). When the embedding and the head are on different ranks, the
last stage gets its own copy of the embedding matrix as `output.weight`, initialised identically. The
true gradient of the shared matrix is the sum of both uses, so after backward `TiedEmbeddingSync`
sums that gradient between the two ranks (a point-to-point swap over the pipeline group); both copies then take identical optimizer steps
and stay equal. Gradient-norm clipping must count the matrix once: `clip_grad_norm_pipeline` skips the copy.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from raydist.config import ConfigError
from raydist.models.gpt import param_counts

BALANCES = ("params", "flops")


def _costs(model: nn.Module, balance: str, seq_len: int) -> tuple[float, float, float]:
    """(per block, embedding, norm + head) cost under `balance`."""
    cfg = model.cfg
    counts = param_counts(cfg)
    head_params = cfg.vocab_size * cfg.d_model  # the last stage holds a head (its own copy if tied)
    if balance == "params":
        return float(counts["per_block"]), float(counts["embedding"]), float(head_params + cfg.d_model)
    if balance == "flops":
        block = 6.0 * counts["block_matmul"] + 12.0 * cfg.d_model * seq_len
        return block, 0.0, 6.0 * head_params
    raise ConfigError(f"pipeline balance={balance!r} is not one of {', '.join(BALANCES)}")


def partition_layers(model: nn.Module, num_stages: int, balance: str = "params",
                     seq_len: int | None = None) -> list[list[str]]:
    """The block keys (ModuleDict keys, in order) of each of the `num_stages` virtual stages."""
    keys = list(model.layers.keys())
    if len(keys) < num_stages:
        raise ConfigError(f"model.num_layers={len(keys)} is less than pp x virtual_stages={num_stages}: every "
                          f"pipeline stage needs at least one block; use fewer stages or more layers")
    block, embed, head = _costs(model, balance, seq_len or model.max_seq_len)
    n = len(keys)

    def cost(stage: int, count: int) -> float:
        return count * block + (embed if stage == 0 else 0.0) + (head if stage == num_stages - 1 else 0.0)

    # best[s][i]: (max stage cost, sum of squared costs) splitting the first i blocks into s stages.
    inf = (math.inf, math.inf)
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):  # stage s-1 takes blocks j..i-1
                prev = best[s - 1][j]
                if prev == inf:
                    continue
                c = cost(s - 1, i - j)
                candidate = (max(prev[0], c), prev[1] + c * c)
                if candidate < best[s][i]:
                    best[s][i], cut[s][i] = candidate, j
    bounds, i = [], n
    for s in range(num_stages, 0, -1):
        bounds.append((cut[s][i], i))
        i = cut[s][i]
    return [keys[a:b] for a, b in reversed(bounds)]


def _chunk_of(model: nn.Module, layer_keys: list[str], first: bool, last: bool) -> nn.Module:
    """A shallow copy of `model` keeping only `layer_keys` (and the embedding / head when first / last).

    The module's own containers (submodules, parameters, buffers, hooks) are copied so that later wrapping
    of one chunk (FSDP hooks, class swap) does not leak into another; parameters are shared with `model`.
    """
    chunk = model.__class__.__new__(model.__class__)
    chunk.__dict__ = {k: v.copy() if isinstance(v, (dict, set)) else v for k, v in model.__dict__.items()}
    chunk.layers = nn.ModuleDict({k: model.layers[k] for k in layer_keys})
    if not first:
        chunk.tok_embeddings = None
    if not last:
        chunk.norm = None
        chunk.output = None
    chunk.tied_role = None  # "embedding" / "output_copy": this chunk holds one half of a split tie
    return chunk


def split_model(model: nn.Module, pp_rank: int, pp_size: int, virtual_stages: int = 1,
                balance: str = "params", seq_len: int | None = None) -> list[nn.Module]:
    """This pipeline rank's chunks of `model` (a GPT), by chunk index: chunk c is virtual stage c*P + r.

    The chunks share parameters with `model` (drop `model` afterwards). With tied embeddings split across
    ranks, the last stage's `output.weight` becomes an identical copy (`chunk.tied_role` is "embedding" on
    the first stage's chunk and "output_copy" on the last's); keep the copies equal with
    `TiedEmbeddingSync` after every backward.
    """
    if not 0 <= pp_rank < pp_size:
        raise ConfigError(f"pp_rank={pp_rank} is outside 0..{pp_size - 1}")
    num_stages = pp_size * virtual_stages
    parts = partition_layers(model, num_stages, balance, seq_len)
    tied = bool(getattr(model, "tied", False))
    chunks = []
    split_tie = tied and pp_size > 1
    for c in range(virtual_stages):
        stage = c * pp_size + pp_rank
        first, last = stage == 0, stage == num_stages - 1
        chunk = _chunk_of(model, parts[stage], first, last)
        if first and split_tie:
            chunk.tied_role = "embedding"
        if last and tied and not first:
            if pp_size == 1:  # embedding and head on this same rank: keep one shared matrix
                chunk.output = nn.Linear(model.cfg.d_model, model.cfg.vocab_size, bias=False)
                chunk.output.weight = model.tok_embeddings.weight
            else:
                weight = model.tok_embeddings.weight
                chunk.output = nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                                         device=weight.device, dtype=weight.dtype)
                with torch.no_grad():
                    chunk.output.weight.copy_(weight)
                chunk.tied_role = "output_copy"
        chunks.append(chunk)
    return chunks


def tied_weights(chunks: Sequence[nn.Module]) -> list[nn.Parameter]:
    """This rank's halves of a tied embedding split across ranks (first stage: the embedding; last
    stage: its output copy); empty when nothing is tied across ranks."""
    roles = {"embedding": lambda c: c.tok_embeddings.weight, "output_copy": lambda c: c.output.weight}
    return [roles[c.tied_role](c) for c in chunks if getattr(c, "tied_role", None) in roles]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class TiedEmbeddingSync:
    """Call after the pipeline step's backwards (and before clipping / the optimizer): sums the tied
    matrix's gradient between the first and the last stage of this pipeline. The two ranks swap their
    gradients point-to-point over the pipeline group (no group of their own, so no collective group
    creation that other ranks, such as idle workers, would have to join) and each adds the other's:
    a + b == b + a exactly, so the two copies stay bitwise equal. Under FSDP / TP both hold the same
    shard of it (same coordinates off the pp axis), so the local shards are swapped."""

    def __init__(self, chunks: Sequence[nn.Module], pp_group: dist.ProcessGroup | None):
        self.params = tied_weights(chunks)
        self.group = pp_group
        if self.params:
            if pp_group is None:
                raise ConfigError("tied embeddings split across pipeline ranks need the pipeline group")
            me, size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
            self.peer = size - 1 if me == 0 else 0

    def __call__(self) -> None:
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            mine = _local(param.grad)
            theirs = torch.empty_like(mine)
            ops = [dist.P2POp(dist.isend, mine.contiguous(), group=self.group, group_peer=self.peer),
                   dist.P2POp(dist.irecv, theirs, group=self.group, group_peer=self.peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            mine.add_(theirs)


def _layout(t: torch.Tensor):
    """Gradients that can share one norm computation: plain tensors, or DTensors of one mesh + placements."""
    return (t.device_mesh, tuple(t.placements)) if hasattr(t, "device_mesh") else None


def clip_grad_norm_pipeline(chunks: Sequence[nn.Module], max_norm: float,
                            pp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Clip by the norm of the whole model's gradient and return that norm (the same on every rank).

    ||g||^2 = sum over pipeline ranks of this rank's ||g_local||^2, tied copies counted once. Gradients
    are grouped by layout (plain, FSDP-sharded, TP-sharded DTensors): each group's norm is a full norm
    (`full_tensor()` reduces a sharded DTensor's over its shards), so mixed TP/FSDP layouts work.
    """
    counted: dict = defaultdict(list)
    clipped: dict = defaultdict(list)
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if param.grad is None:
                continue
            clipped[_layout(param.grad)].append(param)
            if not (name == "output.weight" and getattr(chunk, "tied_role", None) == "output_copy"):
                counted[_layout(param.grad)].append(param.grad)
    squared = torch.zeros((), dtype=torch.float32)
    for grads in counted.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        squared = squared.to(norm.device) + norm.float() ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=pp_group)
    total = squared.sqrt()
    if max_norm > 0:
        for params in clipped.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def stage_view(model: nn.Module, chunks: Sequence[nn.Module]) -> nn.Module:
    """One module over this rank's chunks with the unsharded model's names (`layers.<k>`,
    `tok_embeddings`, `norm`, `output`): what the optimizer, checkpoints and gradient checks see.
    Its parameters are the chunks' own (including a last stage's tied output copy)."""
    view = model.__class__.__new__(model.__class__)
    nn.Module.__init__(view)
    view.cfg, view.max_seq_len, view.run_layers = model.cfg, model.max_seq_len, None
    view.layers = nn.ModuleDict({k: m for c in chunks for k, m in c.layers.items()})
    view.tok_embeddings = next((c.tok_embeddings for c in chunks if c.tok_embeddings is not None), None)
    view.norm = next((c.norm for c in chunks if c.norm is not None), None)
    view.output = next((c.output for c in chunks if c.output is not None), None)
    return view


def tied_aliases(chunks: Sequence[nn.Module]) -> dict[str, str]:
    """{"output.weight": "tok_embeddings.weight"} on a rank holding the tied output copy: the name the
    unsplit model (where the two are one parameter) knows it by, for optimizer state and gradients."""
    if any(getattr(c, "tied_role", None) == "output_copy" for c in chunks):
        return {"output.weight": "tok_embeddings.weight"}
    return {}
