"""Split the decoder into pipeline stages, and the cross-stage gradient bookkeeping that splitting implies.

Stages. With P pipeline ranks and V chunks per rank there are S = P V virtual stages; rank r holds
chunks c = 0..V-1, chunk c being virtual stage c P + r (Megatron's interleaved assignment), or, under the
ZB-V schedule's "v" placement (V = 2), stages r and 2P - 1 - r, so rank 0 holds the first and the last
stage (`raydist.schedule.actions.stages_of_rank`). Stage 0 owns
the token embedding, stage S - 1 the final norm and output head (and the loss), and the L blocks are cut
into S contiguous runs (at least one block each) minimising the costliest stage:

    cost(stage) = sum of its blocks' cost + [stage 0] embedding + [stage S-1] (norm + head)
    balance="params": parameter counts (memory); balance="flops": training FLOPs per token (time; the
    embedding lookup is free, a block is 6 N_block + 12 T D, the head 6 V D).

Each chunk is the model itself with the blocks it does not own removed: `layers` stays a ModuleDict with
the original keys, so parameter names equal the unsharded model's (checkpoints need no renaming).

Tied embeddings (Megatron's approach). When the embedding and the head are in different chunks of a
pipeline, the last stage gets its own copy of the embedding matrix as `output.weight`, initialised
identically. The true gradient of the shared matrix is the sum of both uses, so after backward
`TiedEmbeddingSync` sums that gradient between the two ranks (a point-to-point swap over the pipeline
group), or in memory when both chunks sit on one rank (ZB-V's rank 0: each chunk is wrapped by the
data-parallel strategy on its own, which cannot share a parameter); both copies then take identical
optimizer steps and stay equal. Gradient-norm clipping must count the matrix once: `clip_grad_norm_pipeline` skips the copy.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch import nn

from raydist.errors import ConfigError
from raydist.parallel.clip import clip_grad_norm
from raydist.parallel.layout import stage_partition
from raydist.schedule.actions import stages_of_rank


def partition_layers(model: nn.Module, num_stages: int, balance: str = "params",
                     seq_len: int | None = None) -> list[list[str]]:
    """The block keys (ModuleDict keys, in order) of each of the `num_stages` virtual stages, partitioned
    by `raydist.parallel.layout.stage_partition` (the planner prices the same split)."""
    keys = list(model.layers.keys())
    if len(keys) < num_stages:
        raise ConfigError(f"model.num_layers={len(keys)} is less than pp x virtual_stages={num_stages}: every "
                          f"pipeline stage needs at least one block; use fewer stages or more layers")
    return _cut(keys, stage_partition(model.cfg, num_stages, balance, seq_len or model.max_seq_len))


def _cut(keys: list[str], sizes: Sequence[int]) -> list[list[str]]:
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return [keys[a:b] for a, b in zip(bounds, bounds[1:])]


def _chunk_of(model: nn.Module, layer_keys: list[str], first: bool, last: bool) -> nn.Module:
    """The model's stage holding `layer_keys` (`GPT.stage`), not yet holding half of a split tie."""
    chunk = model.stage(layer_keys, first, last)
    chunk.tied_role = None  # "embedding" / "output_copy": this chunk holds one half of a split tie
    return chunk


def split_model(model: nn.Module, pp_rank: int, pp_size: int, virtual_stages: int = 1,
                balance: str = "params", seq_len: int | None = None,
                stage_layers: Sequence[int] = (), placement: str = "loop") -> list[nn.Module]:
    """This pipeline rank's chunks of `model` (a GPT), by chunk index: chunk c is virtual stage c*P + r
    (placement "loop"), or stages r and 2P - 1 - r (placement "v", the ZB-V schedule's).

    The chunks share parameters with `model` (drop `model` afterwards). With tied embeddings split across
    ranks, the last stage's `output.weight` becomes an identical copy (`chunk.tied_role` is "embedding" on
    the first stage's chunk and "output_copy" on the last's); keep the copies equal with
    `TiedEmbeddingSync` after every backward.
    """
    if not 0 <= pp_rank < pp_size:
        raise ConfigError(f"pp_rank={pp_rank} is outside 0..{pp_size - 1}")
    num_stages = pp_size * virtual_stages
    if stage_layers:  # the layout's partition
        if len(stage_layers) != num_stages or sum(stage_layers) != len(model.layers):
            raise ConfigError(f"stage partition {list(stage_layers)} does not split {len(model.layers)} blocks "
                              f"into {num_stages} stages")
        parts = _cut(list(model.layers.keys()), stage_layers)
    else:
        parts = partition_layers(model, num_stages, balance, seq_len)
    tied = bool(getattr(model, "tied", False))
    chunks = []
    split_tie = tied and pp_size > 1
    for stage in stages_of_rank(placement, pp_size, virtual_stages, pp_rank):
        first, last = stage == 0, stage == num_stages - 1
        chunk = _chunk_of(model, parts[stage], first, last)
        if first and split_tie:
            chunk.tied_role = "embedding"
        if last and tied and not first:
            # pp 1 (virtual stages on one rank): one shared matrix; else a copy TiedEmbeddingSync keeps equal
            chunk.give_head(model.embedding.weight, copy=pp_size > 1)
            if pp_size > 1:
                chunk.tied_role = "output_copy"
        chunks.append(chunk)
    return chunks


def tied_weights(chunks: Sequence[nn.Module]) -> list[nn.Parameter]:
    """This rank's halves of a tied embedding split across ranks (first stage: the embedding; last
    stage: its output copy); empty when nothing is tied across ranks or the tied matrix is frozen (peft)."""
    roles = {"embedding": lambda c: c.embedding.weight, "output_copy": lambda c: c.head.weight}
    halves = [roles[c.tied_role](c) for c in chunks if getattr(c, "tied_role", None) in roles]
    return [p for p in halves if p.requires_grad]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class TiedEmbeddingSync:
    """Call after the pipeline step's backwards (and before clipping / the optimizer): sums the tied
    matrix's gradient between the first and the last stage of this pipeline. The two ranks swap their
    gradients point-to-point over the pipeline group (no group of their own, so no collective group
    creation that other ranks, such as idle workers, would have to join) and each adds the other's:
    a + b == b + a exactly, so the two copies stay bitwise equal. Under FSDP / TP both hold the same
    shard of it (same coordinates off the pp axis), so the local shards are swapped. When one rank holds
    both halves (the V placement) it adds them in memory."""

    def __init__(self, chunks: Sequence[nn.Module], pp_group: dist.ProcessGroup | None):
        self.params = tied_weights(chunks)
        self.group = pp_group
        self.local = len(self.params) == 2  # both halves on this rank (the V placement's rank 0)
        if self.params and not self.local:
            if pp_group is None:
                raise ConfigError("tied embeddings split across pipeline ranks need the pipeline group")
            me, size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
            self.peer = size - 1 if me == 0 else 0

    def __call__(self) -> None:
        if self.local:
            for param in self.params:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            embedding, copy = (_local(p.grad) for p in self.params)
            total = embedding + copy
            embedding.copy_(total)
            copy.copy_(total)
            return
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            mine = _local(param.grad)
            theirs = torch.empty_like(mine)
            ops = [dist.P2POp(c10d.isend, mine.contiguous(), group=self.group, group_peer=self.peer),
                   dist.P2POp(c10d.irecv, theirs, group=self.group, group_peer=self.peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            mine.add_(theirs)


def clip_grad_norm_pipeline(chunks: Sequence[nn.Module], max_norm: float,
                            pp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Clip this rank's chunks by the whole model's gradient norm across the pipeline (`clip.py`), the tied
    output copy counted once (on the first stage, as the embedding)."""
    params = [p for chunk in chunks for p in chunk.parameters()]
    copies = [c.head.weight for c in chunks if getattr(c, "tied_role", None) == "output_copy"]
    return clip_grad_norm(params, max_norm, uncounted=copies, pp_group=pp_group)


def stage_view(model: nn.Module, chunks: Sequence[nn.Module]) -> nn.Module:
    """One module over this rank's chunks with the unsharded model's names (`GPT.view_of`): what the
    optimizer, checkpoints and gradient checks see. Its parameters are the chunks' own (including a last
    stage's tied output copy)."""
    return model.view_of(list(chunks))


def tied_aliases(chunks: Sequence[nn.Module]) -> dict[str, str]:
    """{head weight: embedding weight} (`GPT.tied_aliases`) on a rank holding the tied output copy: the name
    the unsplit model (where the two are one parameter) knows it by, for optimizer state and gradients."""
    if any(getattr(c, "tied_role", None) == "output_copy" for c in chunks):
        return chunks[0].tied_aliases()
    return {}
