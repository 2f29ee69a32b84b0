"""Per-rank memory of a layout: model state (exact, from parameter shapes) + activations + transients.

Model state. Adam in fp32 holds 16N bytes per replica (4 weights + 4 gradients + 4 + 4 moments), the same 16N
that Rajbhandari et al. 2020 (ZeRO) count for mixed-precision Adam (2 + 2 bytes of fp16 weights and gradients,
12 of fp32 master weights and moments), and 16N/p fully sharded over p ranks (ZeRO stage 3); a 12N
mixed-precision variant (4 + 2 + 2 + 4) keeps gradients and the first moment in bf16. raydist keeps fp32
master weights, fp32 gradients (FSDP reduces in fp32) and fp32 AdamW moments under bf16 too, so the state here
is 16 bytes per locally held element in every precision; what bf16 adds is transient (gathered bf16
parameters, autocast weight copies). Locally held elements are counted per parameter tensor the way the
layouts shard them:
- tensor parallel (Megatron/TorchTitan plan): the q, k, v, gate and up projections and the vocab rows of
  the embedding and output are split on dim 0 (column-parallel), o and down on dim 1 (row-parallel), norms
  replicated;
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
    SwiGLU:    gate x, silu(gate x), up x, their product (4 a F)
i.e. 10h + 4F elements in fp32 (Korthikanti et al.'s 34 s b h for GPT-3 counts the same way for a GeLU
MLP with dropout masks). Tensor parallel divides the attention and MLP tensors by tp; sequence parallel
also divides the norms' inputs, but the gathered matmul input stays whole (torch's SP saves the gathered
tensor). Context parallel divides the sequence by cp.

Recompute policies (raydist.parallel.checkpointing): `full` keeps each block's input; `every_k` keeps one
input per k-block segment; `selective` keeps the block input and the outputs of matmuls and attention
(q, k, v, o, gate, up, down outputs and the attention output + LSE); all three re-materialise one region's
full activations during its backward. Pipelines keep several micro-batches in flight on a stage: 1F1B
min(m, p) on the first stage, GPipe all m, interleaved 1F1B Megatron's warm-up count per chunk.

Parameter-efficient fine-tuning (the workload's [peft]; raydist.models.peft). Frozen weights are held as
above (fp32, split by tensor parallelism, sharded by FSDP); gradients and AdamW moments exist for the
trained elements only, so a rank holds
    4 N_held + (4 + 8) N_trained   bytes,
N_held counting LoRA's adapters: for each adapted Linear W (out x in), A (r x in) and B (out x r), B split
by rows and A replicated under a column-parallel W, A split by columns and B replicated under a row-parallel
one (peft.py's tensor-parallel styles), each chunked by rows by FSDP like any tensor. N_trained is every
element under none, the adapters under lora, and under freeze the last k blocks, the final norm and an
untied head. Activations (measured as above, with the adapters applied):
    lora:   a frozen norm saves no normalised x (a h / sp less, each); a norm whose projections are all
            unadapted saves no matmul input either (a h less), nor does the SwiGLU product stay for an
            unadapted down projection (a F / tp less); each adapted projection saves x A^T (a r).
            `selective` caches every matmul output, the adapters' too: a r + the projection's own output size
            per adapted projection.
            The head saves its norm's normalised x and its own input only where they train.
    freeze: only the trained blocks keep activations (the frozen ones before them build no graph).
Not modelled (an upper bound by it): the first block in the graph saves less again, since nothing before
it needs a gradient: its first norm's input under LoRA, and its whole attention when only the MLP is adapted.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from raydist.models.gpt import TransformerBlock, block_roles
from raydist.models.loss import chunk_rows
from raydist.models.peft import GROUPS, lora_targets
from raydist.planner.placement import (Layout, Workload, every_k_segment, holders, holds_stage, rank_layer_counts,
                                       trained_layer_counts)
from raydist.schedule.registry import SCHEDULE_KINDS

STATE_BYTES_PER_ELEMENT = {"params": 4, "grads": 4, "optimizer": 8}


@dataclass(frozen=True)
class Tensor2D:
    rows: int  # dim 0
    cols: int  # the product of the other dims
    tp_dim: int | None  # 0: column-parallel (rows split), 1: row-parallel (cols split), None: replicated
    dim1: int = 0  # a 3-D tensor's second dim (a mixture of experts' stack): FSDP splits it when rows < shards


def block_tensors(w: Workload) -> tuple[Tensor2D, ...]:
    """One block's parameters, LoRA's adapters too."""
    if w.peft.method != "lora":
        return _block_tensors(w.model)
    return _block_tensors(w.model) + _adapter_tensors(w.model, w.peft.lora_rank, w.peft.lora_targets)


@functools.lru_cache(maxsize=64)
def _block_tensors(m) -> tuple[Tensor2D, ...]:
    """One block's parameters as the model builds them (on the meta device: no storage, any size), each with
    the dim tensor parallelism splits, from its module's role (raydist.models.gpt.block_roles): column and
    kv projections by rows (their biases too), row projections by columns, norms (head norms too) and
    row-parallel biases replicated. The family's extra tensors (Qwen2's biases, Qwen3's head norms) count."""
    with torch.device("meta"):
        block = TransformerBlock(m)
    roles = block_roles(m)
    own = {f"{prefix}.{name}": split for prefix, module in block.named_modules()  # modules that split themselves
           if hasattr(module, "tensor_parallel_splits") for name, split in module.tensor_parallel_splits().items()}
    out = []
    for name, p in block.named_parameters():
        module, kind = name.rsplit(".", 1)
        split = own[name] if name in own else {"column": 0, "kv": 0, "row": 1 if kind == "weight" else None}.get(
            roles.get(module))
        out.append(Tensor2D(p.shape[0], math.prod(p.shape[1:]), split, p.shape[1] if p.dim() == 3 else 0))
    return tuple(out)


@dataclass(frozen=True)
class Adapted:
    """A Linear of the block that LoRA adapts: its tensor-parallel role, its group and W's shape."""

    role: str  # column, kv or row
    group: str  # attention or mlp (the role of its parent: raydist.models.peft.GROUPS)
    out_features: int
    in_features: int


@functools.lru_cache(maxsize=64)
def _adapted(m, which: str) -> tuple[Adapted, ...]:
    """The block's Linears that `peft.lora_targets = which` adapts (raydist.models.peft.lora_targets)."""
    with torch.device("meta"):
        block = TransformerBlock(m)
    roles = block_roles(m)
    return tuple(Adapted(roles[name], GROUPS[roles[name.rpartition(".")[0]]], *block.get_submodule(name).weight.shape)
                 for name in lora_targets(m, which))


@functools.lru_cache(maxsize=64)
def _adapter_tensors(m, rank: int, which: str) -> tuple[Tensor2D, ...]:
    """LoRA's A (r x in) and B (out x r) for each adapted Linear, split as W is: under a column-parallel W
    (column, kv) B by rows and A replicated, under a row-parallel W A by columns and B replicated."""
    out = []
    for p in _adapted(m, which):
        row = p.role == "row"
        out += [Tensor2D(rank, p.in_features, 1 if row else None), Tensor2D(p.out_features, rank, None if row else 0)]
    return tuple(out)


def root_tensors(w: Workload, lay: Layout, rank: int) -> list[Tensor2D]:
    """Embedding / final norm / output head held by pipeline rank `rank` (FSDP's root unit); a tied head
    is a copy of its own whenever there is a pipeline (zbv's rank 0 holds both, in two chunks)."""
    return _root_tensors(w.model, holds_stage(lay, rank, "first"), holds_stage(lay, rank, "last"), lay.pp == 1)


def _root_tensors(m, first: bool, last: bool, no_pipeline: bool) -> list[Tensor2D]:
    return [t for _, t in _root_parts(m, first, last, no_pipeline)]


def _root_parts(m, first: bool, last: bool, no_pipeline: bool) -> list[tuple[str, Tensor2D]]:
    out = []
    if first:
        out.append(("embedding", Tensor2D(m.vocab_size, m.d_model, 0)))
    if last:
        out.append(("norm", Tensor2D(m.d_model, 1, None)))
        if not (m.tie_embeddings and no_pipeline):
            out.append(("head", Tensor2D(m.vocab_size, m.d_model, 0)))
    return out


def trained_root_parts(m, method: str) -> frozenset[str]:
    """Which of the root's embedding, final norm and head train (raydist.models.peft.apply_peft): all under
    none; none of them under lora; the norm and an untied head under freeze (a tied head is the frozen
    embedding, and so is its copy on a pipeline's last stage)."""
    if method == "none":
        return frozenset({"embedding", "norm", "head"})
    if method == "freeze":
        return frozenset({"norm"} | (set() if m.tie_embeddings else {"head"}))
    return frozenset()


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
    if fsdp_size > rows and t.dim1:  # fewer experts than shards: split dim 1 (raydist.parallel.fsdp.expert_placement)
        chunk = _ceil_div(t.dim1, fsdp_size)
        inner = chunk if fsdp_index is None else max(0, min(chunk, t.dim1 - fsdp_index * chunk))
        return rows * inner * (cols // t.dim1)
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
    """(blocks on the stage, elements of one block (its LoRA adapters too), elements of the root unit) held
    by one rank."""
    layers = rank_layer_counts(w, lay)[stage]
    fsdp = lay.fsdp_size if sharded else 1
    block = _block_elements(w.model, lay.tp, fsdp, fsdp_index) + _adapter_elements(w.model, w.peft, lay.tp, fsdp,
                                                                                    fsdp_index)
    root = _root_elements(w.model, holds_stage(lay, stage, "first"), holds_stage(lay, stage, "last"), lay.pp == 1,
                          lay.tp, fsdp, fsdp_index)
    return layers, block, root


def trained_unit_elements(w: Workload, lay: Layout, stage: int, fsdp_index: int | None = None,
                          sharded: bool = True) -> tuple[int, int, int]:
    """`unit_elements` for what trains: (trained blocks on the stage, trained elements of one, trained
    elements of the root unit); equal to unit_elements under peft.method none."""
    trained = trained_layer_counts(w, lay)[stage]
    fsdp = lay.fsdp_size if sharded else 1
    block = _trained_block_elements(w.model, w.peft, lay.tp, fsdp, fsdp_index)
    root = _trained_root_elements(w.model, w.peft.method, holds_stage(lay, stage, "first"),
                                  holds_stage(lay, stage, "last"), lay.pp == 1, lay.tp, fsdp, fsdp_index)
    return trained, block, root


# The planner asks for the same few sums for every candidate layout (hundreds of thousands of them, times
# their stages): they depend on the model and a handful of degrees only, so each is computed once.
@functools.lru_cache(maxsize=1 << 14)
def _block_elements(m, tp: int, fsdp: int, fsdp_index: int | None) -> int:
    return sum(local_elements(t, tp, fsdp, fsdp_index) for t in _block_tensors(m))


@functools.lru_cache(maxsize=1 << 14)
def _root_elements(m, first: bool, last: bool, no_pipeline: bool, tp: int, fsdp: int,
                   fsdp_index: int | None) -> int:
    return sum(local_elements(t, tp, fsdp, fsdp_index) for t in _root_tensors(m, first, last, no_pipeline))


@functools.lru_cache(maxsize=1 << 14)
def _adapter_elements(m, peft, tp: int, fsdp: int, fsdp_index: int | None) -> int:
    """Elements of one block's LoRA adapters on a rank (0 unless peft.method is lora)."""
    if peft.method != "lora":
        return 0
    return sum(local_elements(t, tp, fsdp, fsdp_index) for t in _adapter_tensors(m, peft.lora_rank, peft.lora_targets))


def adapter_elements(w: Workload, tp: int) -> int:
    """Elements of one block's LoRA adapters on a tensor-parallel rank, before FSDP sharding (0 unless lora)."""
    return _adapter_elements(w.model, w.peft, tp, 1, None)


def _trained_block_elements(m, peft, tp: int, fsdp: int, fsdp_index: int | None) -> int:
    """Trained elements of a block that trains: its adapters under lora, all of it otherwise."""
    if peft.method == "lora":
        return _adapter_elements(m, peft, tp, fsdp, fsdp_index)
    return _block_elements(m, tp, fsdp, fsdp_index)


@functools.lru_cache(maxsize=1 << 14)
def _trained_root_elements(m, method: str, first: bool, last: bool, no_pipeline: bool, tp: int, fsdp: int,
                           fsdp_index: int | None) -> int:
    trains = trained_root_parts(m, method)
    return sum(local_elements(t, tp, fsdp, fsdp_index) for name, t in _root_parts(m, first, last, no_pipeline)
               if name in trains)


def stage_elements(w: Workload, lay: Layout, stage: int, fsdp_index: int | None = None,
                   sharded: bool = True) -> int:
    """Elements one rank of pipeline rank `stage` holds (frozen ones too)."""
    layers, block, root = unit_elements(w, lay, stage, fsdp_index, sharded)
    return layers * block + root


def stage_trained_elements(w: Workload, lay: Layout, stage: int, fsdp_index: int | None = None,
                           sharded: bool = True) -> int:
    """Elements one rank of pipeline rank `stage` trains: those with gradients and AdamW moments."""
    trained, block, root = trained_unit_elements(w, lay, stage, fsdp_index, sharded)
    return trained * block + root


def state_bytes_per_rank(w: Workload, lay: Layout, rank: int) -> dict[str, int]:
    """{'params', 'grads', 'optimizer', 'total'} held by global `rank` after a step (the counts
    `raydist.metrics.memory.state_bytes` reports): exact chunk sizes, no padding."""
    coords = lay.spec.coordinates(rank)
    fsdp_index = coords["dp_shard"] * lay.cp + coords["cp"] if lay.fsdp_size > 1 else None
    held = stage_elements(w, lay, coords["pp"], fsdp_index)
    trained = stage_trained_elements(w, lay, coords["pp"], fsdp_index)
    out = {k: v * (held if k == "params" else trained) for k, v in STATE_BYTES_PER_ELEMENT.items()}
    out["total"] = sum(out.values())
    return out


# ---- activations -------------------------------------------------------------------------------------


def mlp_hidden(m) -> int:
    """Hidden units one token's MLP computes: ffn_hidden, or under a mixture of experts its k routed experts'
    (raydist.models.moe) and the shared expert's."""
    return m.moe_top_k * m.expert_hidden + m.moe_shared_ffn_hidden if m.moe_experts else m.ffn_hidden


def expert_elements(m) -> int:
    """One block's routed-expert weights (three (E, F, D) stacks); 0 for a dense model."""
    return 3 * m.moe_experts * m.expert_hidden * m.d_model if m.moe_experts else 0


def expert_parallel_saving(m, peft, ep: int) -> tuple[int, int]:
    """Elements of one gathered block that expert parallelism leaves out (an ep rank gathers only its E / ep
    experts), held and trained (LoRA freezes the experts)."""
    if ep <= 1:
        return 0, 0
    held = expert_elements(m) * (ep - 1) // ep
    return held, (0 if peft.method == "lora" else held)


def moe_dispatch_bytes(w: Workload) -> float:
    """Per token, what a mixture of experts saves besides its experts' hidden units: the k gathered copies of
    the token and the k expert outputs before the weighted sum, and the router's fp32 probabilities."""
    m, a = w.model, w.compute_dtype_bytes
    return 2 * a * m.moe_top_k * m.d_model + 4 * m.moe_experts if m.moe_experts else 0.0


def block_activation_bytes(w: Workload, lay: Layout, micro_batch: int | None = None) -> float:
    """Bytes one block saves for backward for one micro-batch, no recompute (see the module doc)."""
    m, a = w.model, w.compute_dtype_bytes
    tokens = (micro_batch or lay.micro_batch) * w.seq_len / lay.cp
    h, f, tp = m.d_model, mlp_hidden(m), lay.tp
    sp = tp if (lay.sequence_parallel and tp > 1) else 1
    norm = (4 + a) * h / sp + a * h  # fp32 input + normalised (sharded under SP) + gathered matmul input
    attention = 4 * a * h / tp + 4 * m.num_heads / tp  # q, k, v (repeated to H heads), output; LSE fp32
    mlp = 4 * a * f / tp + moe_dispatch_bytes(w)
    small = 2 * 4  # two fp32 rsqrt per token
    return tokens * (2 * norm + attention + mlp + small + lora_activation_bytes(w, lay)[0])


def block_selective_bytes(w: Workload, lay: Layout) -> float:
    """`selective`: the block input plus the matmul and attention outputs."""
    m, a = w.model, w.compute_dtype_bytes
    tokens = lay.micro_batch * w.seq_len / lay.cp
    h, f, tp = m.d_model, mlp_hidden(m), lay.tp
    sp = tp if (lay.sequence_parallel and tp > 1) else 1
    kv = m.num_kv_heads * w.head_dim
    matmuls = a * (h + 2 * kv) / tp + a * h + 2 * a * f / tp + a * h  # q, k, v | o | gate, up | down (pre-reduce)
    matmuls += moe_dispatch_bytes(w)
    attention = a * h / tp + 4 * m.num_heads / tp
    return tokens * (a * h / sp + matmuls + attention + lora_activation_bytes(w, lay)[1])


def lora_activation_bytes(w: Workload, lay: Layout) -> tuple[float, float]:
    """Per token and block, what LoRA changes in the bytes saved for backward: (without recompute,
    under `selective`); (0, 0) for other methods. See the module doc: frozen norms keep no normalised x,
    unadapted projections keep no input, each adapter keeps x A^T, selective caches the adapters' outputs."""
    if w.peft.method != "lora":
        return 0, 0
    m, a, r = w.model, w.compute_dtype_bytes, w.peft.lora_rank
    h, f, tp = m.d_model, m.ffn_hidden, lay.tp
    sp = tp if (lay.sequence_parallel and tp > 1) else 1
    adapted = _adapted(m, w.peft.lora_targets)
    inputs = {(p.group, p.role != "row") for p in adapted}  # (group, an input projection) with an adapter
    saved = (-2 * a * h / sp  # the normalised x of both norms
             - a * h * ((("attention", True) not in inputs) + (("mlp", True) not in inputs))  # norms' matmul input
             - a * f / tp * (("mlp", False) not in inputs)  # the SwiGLU product (down's input)
             + a * r * len(adapted))  # x A^T
    outputs = sum(p.out_features if p.role == "row" else p.out_features / tp for p in adapted)  # (row: pre-reduce)
    return saved, a * (r * len(adapted) + outputs)


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
        k = max(1, min(layers, every_k_segment(layers, lay.activation_checkpoint_k)))
        return {"saved": block_input_bytes(w, lay) * math.ceil(layers / k) * flight, "recompute": full * k}
    if policy == "selective":
        return {"saved": block_selective_bytes(w, lay) * layers * flight, "recompute": full}
    raise ValueError(f"unknown activation_checkpoint {policy!r}")


def head_bytes(w: Workload, lay: Layout) -> dict:
    """Final norm + loss on the last stage: 3 norm tensors (the fp32 input; the normalised x where the norm
    trains and the head's input where the head does), the fp32 log-softmax output saved by the loss
    (logits split over tp by a vocab-parallel head), and its gradient plus the logits' during backward.
    The fused loss (`Workload.fused_loss`) saves each token's log-sum-exp instead of the log-softmax and
    holds about three chunks of fp32 logits at a time (models.loss.chunk_rows of the V / tp columns a rank
    holds; benchmarks/fused_loss.py)."""
    tokens = lay.micro_batch * w.seq_len / lay.cp
    logits = tokens * w.model.vocab_size / lay.tp
    trains = trained_root_parts(w.model, w.peft.method)
    norm = tokens * w.model.d_model * (4 + (("norm" in trains) + ("head" in trains)) * w.compute_dtype_bytes)
    if w.fused_loss:
        columns = w.model.vocab_size / lay.tp
        chunk = min(chunk_rows(int(columns)), tokens) * columns
        return {"saved": norm + 4 * tokens + 16 * tokens, "transient": 3 * 4 * chunk}
    return {"saved": norm + 4 * logits + 16 * tokens, "transient": (4 + w.compute_dtype_bytes) * logits}


# ---- the whole rank ----------------------------------------------------------------------------------


def _candidate_stages(lay: Layout, counts: list[int], trained: list[int]) -> tuple[int, ...]:
    """The pipeline ranks that can hold the peak: the first rank of each (layers, trained layers, holds
    first, holds last). Everything rank_memory adds up depends on those four and on the micro-batches in
    flight, which never grow with the rank (`in_flight_microbatches`), and the total only grows with them; so
    a later rank with the same four never holds more, and the earliest rank with the peak is among these."""
    return _first_of_each_kind(tuple(zip(counts, trained)), holders(lay, "first"), holders(lay, "last"))


@functools.lru_cache(maxsize=4096)
def _first_of_each_kind(blocks: tuple[tuple[int, int], ...], first: frozenset[int],
                        last: frozenset[int]) -> tuple[int, ...]:
    seen: dict[tuple, int] = {}
    for stage, layers_trained in enumerate(blocks):
        seen.setdefault((layers_trained, stage in first, stage in last), stage)
    return tuple(sorted(seen.values()))


def rank_memory(w: Workload, lay: Layout, num_microbatches: int) -> dict[str, float]:
    """Peak bytes on the worst pipeline stage, by term; 'total' is the estimate that must fit."""
    a = w.compute_dtype_bytes
    worst: dict[str, float] = {}
    counts, trained_counts = rank_layer_counts(w, lay), trained_layer_counts(w, lay)
    m, peft, tp, fsdp = w.model, w.peft, lay.tp, lay.fsdp_size
    # held (frozen too, LoRA's adapters too) and trained elements of one block, sharded and gathered
    block_local = _block_elements(m, tp, fsdp, None) + _adapter_elements(m, peft, tp, fsdp, None)
    block_full = _block_elements(m, tp, 1, None) + _adapter_elements(m, peft, tp, 1, None)
    block_trained_local = _trained_block_elements(m, peft, tp, fsdp, None)
    block_trained_full = _trained_block_elements(m, peft, tp, 1, None)
    held_saving, trained_saving = expert_parallel_saving(m, peft, lay.ep)
    block_full, block_trained_full = block_full - held_saving, block_trained_full - trained_saving
    for stage in _candidate_stages(lay, counts, trained_counts):
        layers, trained = counts[stage], trained_counts[stage]
        first, last = holds_stage(lay, stage, "first"), holds_stage(lay, stage, "last")
        root_local = _root_elements(m, first, last, lay.pp == 1, tp, fsdp, None) if first or last else 0
        root_full = _root_elements(m, first, last, lay.pp == 1, tp, 1, None) if first or last else 0
        root_trained_local = _trained_root_elements(m, peft.method, first, last, lay.pp == 1, tp, fsdp, None)
        root_trained_full = _trained_root_elements(m, peft.method, first, last, lay.pp == 1, tp, 1, None)
        n_local = layers * block_local + root_local
        g_local = trained * block_trained_local + root_trained_local  # with gradients and AdamW moments
        terms = {"params": 4.0 * n_local, "grads": 4.0 * g_local, "optimizer": 8.0 * g_local}
        acts = activation_bytes(w, lay, trained, num_microbatches, stage)  # (blocks in the autograd graph)
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
            # of the largest unit that trains (compute dtype + fp32 reduce copy).
            emb = own_embedding_elements(w, lay, stage)
            unit = max(block_full, emb)
            kept = layers * block_full + emb if not lay.fsdp_reshard_after_forward else 2 * unit
            trained_emb = emb if "embedding" in trained_root_parts(m, peft.method) else 0
            grad_unit = max(block_trained_full if trained else 0, trained_emb)
            gathered = a * (root_full - emb + kept) + (a + 4) * grad_unit
            if num_microbatches > 1 and lay.pp == 1:
                # no-sync accumulation keeps unsharded fp32 gradients
                gathered += 4.0 * (trained * block_trained_full + root_trained_full)
        elif a < 4:
            # autocast's bf16 weight copies, kept for backward by the blocks in the graph
            gathered = a * (trained * block_full + root_full)
        terms["transient"] = transient + gathered
        # The optimizer step runs after activations are freed: foreach AdamW's temporaries (~1 fp32 copy).
        optimizer_peak = terms["params"] + terms["grads"] + terms["optimizer"] + 4.0 * g_local
        terms["total"] = max(sum(terms.values()), optimizer_peak)
        if not worst or terms["total"] > worst["total"]:
            worst = terms
    return worst
