"""Per-rank memory of a layout: model state (exact, from parameter shapes) + activations + transients.

Model state. Adam in fp32 holds 16N bytes per replica (4 weights + 4 gradients + 4 + 4 moments), the same 16N
that Rajbhandari et al. 2020 (ZeRO) count for mixed-precision Adam (2 + 2 bytes of fp16 weights and gradients,
12 of fp32 master weights and moments), and 16N/p fully sharded over p ranks (ZeRO stage 3); a 12N
mixed-precision variant (4 + 2 + 2 + 4) keeps gradients and the first moment in bf16. raydist keeps fp32
master weights, fp32 gradients (FSDP reduces in fp32) and fp32 AdamW moments under bf16 too, so the state here
is 16 bytes per locally held element in every precision; what bf16 adds is transient (gathered bf16
parameters, autocast weight copies). Locally held elements are counted per parameter tensor the way the
layouts shard them:
- tensor parallel (Megatron/TorchTitan plan): wq, wk, wv, w1, w3 and the vocab rows of the embedding and
  output are split on dim 0 (column-parallel), wo and w2 on dim 1 (row-parallel), norms replicated;
- FSDP2 shards dim 0 of each (TP-local) tensor over dp_shard x cp ranks in `torch.chunk` pieces:
  ceil(rows / S) rows on the first ranks, fewer (or none) on the last. FSDP2 allocates the padded
  ceil size on every rank, so the worst rank's estimate is the padded one, and `state_bytes_per_rank`
  gives any rank's exact unpadded count (what `raydist.metrics.memory.state_bytes` reads);
- pipeline stages hold their blocks; the first the embedding, the last the final norm and output head
  (a tied head is a second copy when they are different stages).

Activations (bytes saved for backward per block per micro-batch), measured on this model with
`saved_tensors_hooks` and checked in tests/unit/test_planner_memory.py. Per token, with h = d_model,
F = ffn_hidden, a = bytes of the compute dtype:
    each RMSNorm: its fp32 input (4h), the normalised x (a h), the weighted output the matmul reads (a h)
    attention: q, repeated k, repeated v (GQA repeats to H heads before sdpa), the output (4 a h)
               + log-sum-exp (4 H bytes)
    SwiGLU:    w1 x, silu(w1 x), w3 x, their product (4 a F)
i.e. 10h + 4F elements in fp32 (Korthikanti et al.'s 34 s b h for GPT-3 counts the same way for a GeLU
MLP with dropout masks). Tensor parallel divides the attention and MLP tensors by tp; sequence parallel
also divides the norms' inputs, but the gathered matmul input stays whole (torch's SP saves the gathered
tensor). Context parallel divides the sequence by cp.

Recompute policies (raydist.parallel.checkpointing): `full` keeps each block's input; `every_k` keeps one
input per k-block segment; `selective` keeps the block input and the outputs of matmuls and attention
(q, k, v, wo, w1, w3, w2 outputs and the attention output + LSE); all three re-materialise one region's
full activations during its backward. Pipelines keep several micro-batches in flight on a stage: 1F1B
min(m, p) on the first stage, GPipe all m, interleaved 1F1B Megatron's warm-up count per chunk.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from raydist.models.gpt import TransformerBlock, block_roles
from raydist.planner.placement import Layout, Workload, every_k_segment, holders, holds_stage, rank_layer_counts
from raydist.schedule.registry import SCHEDULE_KINDS

STATE_BYTES_PER_ELEMENT = {"params": 4, "grads": 4, "optimizer": 8}


@dataclass(frozen=True)
class Tensor2D:
    rows: int  # dim 0
    cols: int  # the product of the other dims
    tp_dim: int | None  # 0: column-parallel (rows split), 1: row-parallel (cols split), None: replicated


def block_tensors(w: Workload) -> tuple[Tensor2D, ...]:
    return _block_tensors(w.model)


@functools.lru_cache(maxsize=64)
def _block_tensors(m) -> tuple[Tensor2D, ...]:
    """One block's parameters as the model builds them (on the meta device: no storage, any size), each with
    the dim tensor parallelism splits, from its module's role (raydist.models.gpt.block_roles): column and
    kv projections by rows (their biases too), row projections by columns, norms (head norms too) and
    row-parallel biases replicated. The family's extra tensors (Qwen2's biases, Qwen3's head norms) count."""
    with torch.device("meta"):
        block = TransformerBlock(m)
    roles = block_roles(m)
    out = []
    for name, p in block.named_parameters():
        module, kind = name.rsplit(".", 1)
        split = {"column": 0, "kv": 0, "row": 1 if kind == "weight" else None}.get(roles.get(module))
        out.append(Tensor2D(p.shape[0], math.prod(p.shape[1:]), split))
    return tuple(out)


def root_tensors(w: Workload, lay: Layout, rank: int) -> list[Tensor2D]:
    """Embedding / final norm / output head held by pipeline rank `rank` (FSDP's root unit); a tied head
    is a copy of its own whenever there is a pipeline (zbv's rank 0 holds both, in two chunks)."""
    return _root_tensors(w.model, holds_stage(lay, rank, "first"), holds_stage(lay, rank, "last"), lay.pp == 1)


def _root_tensors(m, first: bool, last: bool, no_pipeline: bool) -> list[Tensor2D]:
    out = []
    if first:
        out.append(Tensor2D(m.vocab_size, m.d_model, 0))
    if last:
        out.append(Tensor2D(m.d_model, 1, None))
        if not (m.tie_embeddings and no_pipeline):
            out.append(Tensor2D(m.vocab_size, m.d_model, 0))
    return out


def own_embedding_elements(w: Workload, lay: Layout, rank: int) -> int:
    """Elements of the input embedding on pipeline rank `rank` when it is an FSDP unit of its own (untied,
    or tied but split from its head by a pipeline); 0 where the root unit holds it or the rank has none."""
    m = w.model
    if not holds_stage(lay, rank, "first") or (m.tie_embeddings and lay.pp == 1):
        return 0
    return _root_elements(m, True, False, lay.pp == 1, lay.tp, 1, None)  # the embedding alone


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def local_elements(t: Tensor2D, tp: int, fsdp_size: int, fsdp_index: int | None = None) -> int:
    """Elements of `t` on one rank. fsdp_index None: the worst (padded) rank."""
    rows, cols = t.rows, t.cols
    if tp > 1 and t.tp_dim == 0:
        rows = _ceil_div(rows, tp)
    elif tp > 1 and t.tp_dim == 1:
        cols = _ceil_div(cols, tp)
    if fsdp_size > 1:
        chunk = _ceil_div(rows, fsdp_size)
        rows = chunk if fsdp_index is None else max(0, min(chunk, rows - fsdp_index * chunk))
    return rows * cols


def stage_units(w: Workload, lay: Layout, stage: int) -> list[list[Tensor2D]]:
    """FSDP units of a stage: one per block, then the root (embedding / norm / head)."""
    layers = rank_layer_counts(w, lay)[stage]
    return [list(block_tensors(w)) for _ in range(layers)] + [root_tensors(w, lay, stage)]


def unit_elements(w: Workload, lay: Layout, stage: int, fsdp_index: int | None = None,
                  sharded: bool = True) -> tuple[int, int, int]:
    """(blocks on the stage, elements of one block, elements of the root unit) held by one rank."""
    layers = rank_layer_counts(w, lay)[stage]
    fsdp = lay.fsdp_size if sharded else 1
    block = _block_elements(w.model, lay.tp, fsdp, fsdp_index)
    root = _root_elements(w.model, holds_stage(lay, stage, "first"), holds_stage(lay, stage, "last"), lay.pp == 1,
                          lay.tp, fsdp, fsdp_index)
    return layers, block, root


# The planner asks for the same few sums for every candidate layout (hundreds of thousands of them, times
# their stages): they depend on the model and a handful of degrees only, so each is computed once.
@functools.lru_cache(maxsize=1 << 14)
def _block_elements(m, tp: int, fsdp: int, fsdp_index: int | None) -> int:
    return sum(local_elements(t, tp, fsdp, fsdp_index) for t in _block_tensors(m))


@functools.lru_cache(maxsize=1 << 14)
def _root_elements(m, first: bool, last: bool, no_pipeline: bool, tp: int, fsdp: int,
                   fsdp_index: int | None) -> int:
    return sum(local_elements(t, tp, fsdp, fsdp_index) for t in _root_tensors(m, first, last, no_pipeline))


def stage_elements(w: Workload, lay: Layout, stage: int, fsdp_index: int | None = None,
                   sharded: bool = True) -> int:
    layers, block, root = unit_elements(w, lay, stage, fsdp_index, sharded)
    return layers * block + root


def state_bytes_per_rank(w: Workload, lay: Layout, rank: int) -> dict[str, int]:
    """{'params', 'grads', 'optimizer', 'total'} held by global `rank` after a step (the counts
    `raydist.metrics.memory.state_bytes` reports): exact chunk sizes, no padding."""
    coords = lay.spec.coordinates(rank)
    fsdp_index = coords["dp_shard"] * lay.cp + coords["cp"] if lay.fsdp_size > 1 else None
    n = stage_elements(w, lay, coords["pp"], fsdp_index)
    out = {k: v * n for k, v in STATE_BYTES_PER_ELEMENT.items()}
    out["total"] = sum(out.values())
    return out


# ---- activations -------------------------------------------------------------------------------------


def block_activation_bytes(w: Workload, lay: Layout, micro_batch: int | None = None) -> float:
    """Bytes one block saves for backward for one micro-batch, no recompute (see the module doc)."""
    m, a = w.model, w.compute_dtype_bytes
    tokens = (micro_batch or lay.micro_batch) * w.seq_len / lay.cp
    h, f, tp = m.d_model, m.ffn_hidden, lay.tp
    sp = tp if (lay.sequence_parallel and tp > 1) else 1
    norm = (4 + a) * h / sp + a * h  # fp32 input + normalised (sharded under SP) + gathered matmul input
    attention = 4 * a * h / tp + 4 * m.num_heads / tp  # q, k, v (repeated to H heads), output; LSE fp32
    mlp = 4 * a * f / tp
    small = 2 * 4  # two fp32 rsqrt per token
    return tokens * (2 * norm + attention + mlp + small)


def block_selective_bytes(w: Workload, lay: Layout) -> float:
    """`selective`: the block input plus the matmul and attention outputs."""
    m, a = w.model, w.compute_dtype_bytes
    tokens = lay.micro_batch * w.seq_len / lay.cp
    h, f, tp = m.d_model, m.ffn_hidden, lay.tp
    sp = tp if (lay.sequence_parallel and tp > 1) else 1
    kv = m.num_kv_heads * w.head_dim
    matmuls = a * (h + 2 * kv) / tp + a * h + 2 * a * f / tp + a * h  # wq, wk, wv | wo | w1, w3 | w2 (pre-reduce)
    attention = a * h / tp + 4 * m.num_heads / tp
    return tokens * (a * h / sp + matmuls + attention)


def block_input_bytes(w: Workload, lay: Layout) -> float:
    sp = lay.tp if (lay.sequence_parallel and lay.tp > 1) else 1
    return lay.micro_batch * w.seq_len / lay.cp * w.model.d_model * w.compute_dtype_bytes / sp


def in_flight_microbatches(lay: Layout, num_microbatches: int, stage: int = 0) -> float:
    """Micro-batches whose activations a stage holds at its peak (in units of the stage's blocks), as
    `raydist.schedule.validate` measures them; zero-bubble schedules hold a micro-batch until its W (each
    kind's `activation_peak` in `raydist.schedule.registry`)."""
    if lay.pp == 1:
        return 1
    return SCHEDULE_KINDS[lay.pp_schedule].activation_peak(lay.pp, num_microbatches, lay.virtual_stages, stage)


def activation_bytes(w: Workload, lay: Layout, layers: int, num_microbatches: int, stage: int = 0) -> dict:
    """{'saved': bytes kept across the stage's in-flight micro-batches, 'recompute': one region's full
    activations re-materialised during its backward}."""
    full = block_activation_bytes(w, lay)
    policy = lay.activation_checkpoint
    flight = in_flight_microbatches(lay, num_microbatches, stage)
    if policy == "none":
        return {"saved": full * layers * flight, "recompute": 0.0}
    if policy == "full":
        return {"saved": block_input_bytes(w, lay) * layers * flight, "recompute": full}
    if policy == "every_k":
        k = min(layers, every_k_segment(layers, lay.activation_checkpoint_k))
        return {"saved": block_input_bytes(w, lay) * math.ceil(layers / k) * flight, "recompute": full * k}
    if policy == "selective":
        return {"saved": block_selective_bytes(w, lay) * layers * flight, "recompute": full}
    raise ValueError(f"unknown activation_checkpoint {policy!r}")


def head_bytes(w: Workload, lay: Layout) -> dict:
    """Final norm + loss on the last stage: 3 norm tensors, the fp32 log-softmax output saved by the loss
    (logits split over tp by a vocab-parallel head), and its gradient plus the logits' during backward."""
    tokens = lay.micro_batch * w.seq_len / lay.cp
    logits = tokens * w.model.vocab_size / lay.tp
    norm = tokens * w.model.d_model * (4 + 2 * w.compute_dtype_bytes)
    return {"saved": norm + 4 * logits + 16 * tokens, "transient": (4 + w.compute_dtype_bytes) * logits}


# ---- the whole rank ----------------------------------------------------------------------------------


def _candidate_stages(lay: Layout, counts: list[int]) -> tuple[int, ...]:
    """The pipeline ranks that can hold the peak: the first rank of each (layers, holds first, holds last).
    Everything rank_memory adds up depends on those three and on the micro-batches in flight, which never
    grow with the rank (`in_flight_microbatches`), and the total only grows with them; so a later rank with
    the same three never holds more, and the earliest rank with the peak is among these."""
    return _first_of_each_kind(tuple(counts), holders(lay, "first"), holders(lay, "last"))


@functools.lru_cache(maxsize=4096)
def _first_of_each_kind(counts: tuple[int, ...], first: frozenset[int], last: frozenset[int]) -> tuple[int, ...]:
    seen: dict[tuple, int] = {}
    for stage, layers in enumerate(counts):
        seen.setdefault((layers, stage in first, stage in last), stage)
    return tuple(sorted(seen.values()))


def rank_memory(w: Workload, lay: Layout, num_microbatches: int) -> dict[str, float]:
    """Peak bytes on the worst pipeline stage, by term; 'total' is the estimate that must fit."""
    a = w.compute_dtype_bytes
    worst: dict[str, float] = {}
    counts = rank_layer_counts(w, lay)
    m, tp, fsdp = w.model, lay.tp, lay.fsdp_size
    block_local, block_full = _block_elements(m, tp, fsdp, None), _block_elements(m, tp, 1, None)
    for stage in _candidate_stages(lay, counts):
        layers = counts[stage]
        first, last = holds_stage(lay, stage, "first"), holds_stage(lay, stage, "last")
        root_local = _root_elements(m, first, last, lay.pp == 1, tp, fsdp, None) if first or last else 0
        root_full = _root_elements(m, first, last, lay.pp == 1, tp, 1, None) if first or last else 0
        n_local = layers * block_local + root_local
        terms = {"params": 4.0 * n_local, "grads": 4.0 * n_local, "optimizer": 8.0 * n_local}
        acts = activation_bytes(w, lay, layers, num_microbatches, stage)
        terms["activations"] = acts["saved"]
        transient = acts["recompute"]
        if last:
            head = head_bytes(w, lay)
            terms["activations"] += head["saved"]
            transient = max(transient, head["transient"])
        gathered = 0.0
        if lay.fsdp_size > 1:
            # FSDP2: the root unit and an untied head (a unit of its own) stay gathered from forward to
            # backward (reshard_after_forward=False in raydist's apply_fsdp);
            # blocks (and an untied input embedding, a unit of its own) are gathered one at a time plus one
            # prefetched, or all kept from forward to backward when not resharding. The unsharded gradient
            # of a unit (compute dtype + fp32 reduce copy).
            emb = own_embedding_elements(w, lay, stage)
            unit = max(block_full, emb)
            kept = layers * block_full + emb if not lay.fsdp_reshard_after_forward else 2 * unit
            gathered = a * (root_full - emb + kept) + (a + 4) * unit
            if num_microbatches > 1 and lay.pp == 1:
                # no-sync accumulation keeps unsharded fp32 gradients
                gathered += 4.0 * (layers * block_full + root_full)
        elif a < 4:
            gathered = a * (layers * block_full + root_full)  # autocast's bf16 weight copies, kept for backward
        terms["transient"] = transient + gathered
        # The optimizer step runs after activations are freed: foreach AdamW's temporaries (~1 fp32 copy).
        optimizer_peak = terms["params"] + terms["grads"] + terms["optimizer"] + 4.0 * n_local
        terms["total"] = max(sum(terms.values()), optimizer_peak)
        if not worst or terms["total"] > worst["total"]:
            worst = terms
    return worst
