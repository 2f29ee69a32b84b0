"""The one resolved layout of a run: how the model and the batch are spread over the workers.

A `Layout` is decided once per worker-group start (`raydist.planner.policy.plan_layout`, on the driver to
fail fast and by rank 0 of each worker group, which broadcasts it) and then only read: by the mesh, the
parallel plans, the step runners, the planner's cost model and the run record. The user's `Config` stays
what the user wrote; everything derived from it and the live world size lives here. (TorchTitan's
`ParallelDims` is the model: one validated object that every part asks.)

    degrees      pp x dp_replicate x dp_shard x cp x tp = world_size (tp innermost, pp outermost)
    batch        global_batch = dp x micro_batch x num_microbatches, dp = dp_replicate x dp_shard
    pipeline     pp_schedule, virtual_stages (chunks per rank: V interleaved, 2 for zbv, else 1),
                 stage_layers (blocks per virtual stage, balanced by parameters)
    algorithms   activation_checkpoint(_k), sequence_parallel, cp_impl, FSDP resharding and prefetch

`validate(layout, model, seq_len)` lists every reason the layout cannot run the model; the planner uses
it to filter candidates and the runtime to refuse, so the two accept the same layouts.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from raydist.errors import ConfigError
from raydist.parallel.mesh import DIMS, MeshSpec
from raydist.schedule.actions import stages_of_rank
from raydist.schedule.batch import divisors
from raydist.schedule.registry import DEFAULT_KIND, KINDS, SCHEDULE_KINDS, chunks_per_rank, placement_of

if TYPE_CHECKING:  # the model's shape; attribute access only, so leaf code need not import the config
    from raydist.config import ModelConfig

CP_IMPLEMENTATIONS = ("ring", "ulysses")
RECOMPUTE_POLICIES = ("none", "full", "every_k", "selective")


class DataParallelKind(str, enum.Enum):
    """How gradients of the ranks that see different data are combined (raydist.parallel.data_parallel)."""

    NONE = "none"  # one data-parallel rank: nothing to combine
    DDP = "ddp"  # full replicas, gradients all-reduced
    FSDP = "fsdp"  # parameters, gradients and optimizer state sharded (ZeRO-3)
    HSDP = "hsdp"  # sharded within a replica group, all-reduced across replica groups


@dataclass(frozen=True)
class Layout:
    spec: MeshSpec = MeshSpec()
    """The mesh's degrees (pp x dp_replicate x dp_shard x cp x tp), resolved: `layout.tp` and the others
    read them from here."""
    micro_batch: int = 1
    """Samples per forward/backward on one rank."""
    num_microbatches: int = 1
    """Micro-batches per optimizer step on one rank: gradient-accumulation steps without a pipeline, the
    schedule's M with one."""
    activation_checkpoint: str = "none"
    activation_checkpoint_k: int = 0
    sequence_parallel: bool = False
    cp_impl: str = "ring"
    pp_schedule: str = DEFAULT_KIND
    virtual_stages: int = 1
    """Chunks per pipeline rank (normalised: 1 unless the schedule interleaves)."""
    stage_layers: tuple[int, ...] = ()
    """Blocks of each virtual stage in model order (pp x virtual_stages entries; empty without a pipeline)."""
    fsdp_reshard_after_forward: bool = True
    fsdp_forward_prefetch: bool = True
    reason: str = field(default="", compare=False)
    """Why this layout (the policy's or the planner's one-line explanation)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "virtual_stages", chunks_per_rank(self.pp_schedule, self.virtual_stages))
        object.__setattr__(self, "stage_layers", tuple(self.stage_layers))

    @classmethod
    def of(cls, **settings: Any) -> "Layout":
        """A Layout from flat settings, the degrees among them (`Layout.of(pp=4, tp=2, micro_batch=1)`);
        degrees left out are 1."""
        degrees = {name: settings.pop(name) for name in (*DIMS, "ep") if name in settings}
        return cls(MeshSpec(**degrees), **settings)

    # ---- sizes: the mesh's ---------------------------------------------------------------------------
    pp = property(lambda self: self.spec.pp)
    dp_replicate = property(lambda self: self.spec.dp_replicate)
    dp_shard = property(lambda self: self.spec.dp_shard)
    cp = property(lambda self: self.spec.cp)
    tp = property(lambda self: self.spec.tp)
    ep = property(lambda self: self.spec.ep)

    def degrees(self) -> dict[str, int]:
        return self.spec.degrees()

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def dp(self) -> int:
        """Data-parallel width: how many different batches are computed at once."""
        return self.spec.dp

    @property
    def fsdp_size(self) -> int:
        """Ranks one parameter is sharded over: dp_shard x cp (context-parallel ranks share weights)."""
        return self.dp_shard * self.cp

    @property
    def per_rank_batch(self) -> int:
        return self.micro_batch * self.num_microbatches

    @property
    def global_batch(self) -> int:
        return self.dp * self.per_rank_batch

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def stages_of(self, pp_rank: int) -> list[int]:
        """The virtual stages pipeline rank `pp_rank` holds, by chunk index (the schedule's placement:
        c x pp + pp_rank, or pp_rank and 2 pp - 1 - pp_rank for zbv's V)."""
        return stages_of_rank(placement_of(self.pp_schedule), self.pp, self.virtual_stages, pp_rank)

    @property
    def data_parallel_kind(self) -> DataParallelKind:
        """FSDP whenever parameters are split across data ranks (dp_shard or cp > 1), or tensor parallel
        with replicas (FSDP2 then keeps the TP DTensors); HSDP when replicas also exist; else DDP or none."""
        if self.fsdp_size > 1 or (self.tp > 1 and self.dp_replicate > 1):
            return DataParallelKind.HSDP if self.dp_replicate > 1 else DataParallelKind.FSDP
        return DataParallelKind.DDP if self.dp_replicate > 1 else DataParallelKind.NONE

    # ---- text and data -----------------------------------------------------------------------------
    def mesh(self) -> dict[str, int]:
        """The degrees, with ep where experts are split (records and estimates print this)."""
        return {**self.degrees(), "ep": self.ep} if self.ep > 1 else self.degrees()

    def describe(self) -> str:
        parts = [f"{k}{v}" for k, v in self.degrees().items() if v > 1] or ["single"]
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts.append(f"mb{self.micro_batch}")
        if self.activation_checkpoint != "none":
            parts.append(f"ac:{self.activation_checkpoint}")
        if self.tp > 1 and self.sequence_parallel:
            parts.append("sp")
        if self.cp > 1:
            parts.append(self.cp_impl)
        if self.pp > 1:
            parts.append(self.pp_schedule + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.fsdp_size > 1 and not self.fsdp_reshard_after_forward:
            parts.append("no-reshard")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """Flat: the degrees beside the other settings (what travels to workers and estimates print)."""
        out = {**self.degrees(), "ep": self.ep,
               **{f.name: getattr(self, f.name) for f in fields(self) if f.name != "spec"}}
        out["stage_layers"] = list(self.stage_layers)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Layout":
        known = {f.name for f in fields(cls)} | set(DIMS) | {"ep"}
        return cls.of(**{k: (tuple(v) if k == "stage_layers" else v) for k, v in data.items() if k in known})

    def replace(self, **changes) -> "Layout":
        """A copy with `changes`, degrees among them (they go to the mesh spec)."""
        degrees = {name: changes.pop(name) for name in (*DIMS, "ep") if name in changes}
        if degrees:
            changes["spec"] = dataclasses.replace(self.spec, **degrees)
        return dataclasses.replace(self, **changes)


# ---- stage partition ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def stage_partition(model: "ModelConfig", num_stages: int, balance: str = "params",
                    seq_len: int = 0) -> tuple[int, ...]:
    """Blocks per virtual stage, contiguous and at least one each, minimising the costliest stage (ties:
    the smaller sum of squared costs):

        cost(stage) = blocks x block + [first stage] embedding + [last stage] (final norm + head)

    balance="params": parameter counts (memory; the last stage holds a head even when tied, its own copy
    once the embedding sits on another stage); "flops": training FLOPs per token (6 N per matmul weight
    plus attention's 12 T D per block; the embedding lookup is free)."""
    from raydist.models.gpt import param_counts

    n = model.num_layers
    if n < num_stages:
        raise ConfigError(f"model.num_layers={n} is less than pp x virtual_stages={num_stages}: every pipeline "
                          "stage needs at least one block; use fewer stages or more layers")
    counts = param_counts(model)
    head = model.vocab_size * model.d_model
    if balance == "params":
        block, embed, last = float(counts["per_block"]), float(counts["embedding"]), float(head + model.d_model)
    elif balance == "flops":
        block, embed, last = 6.0 * counts["block_matmul"] + 12.0 * model.d_model * seq_len, 0.0, 6.0 * head
    else:
        raise ConfigError(f"pipeline balance={balance!r} is not one of params, flops")

    def cost(stage: int, blocks: int) -> float:
        return blocks * block + (embed if stage == 0 else 0.0) + (last if stage == num_stages - 1 else 0.0)

    inf = (math.inf, math.inf)
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]  # best[s][i]: first i blocks in s stages
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):  # stage s-1 takes blocks j..i-1
                if best[s - 1][j] == inf:
                    continue
                c = cost(s - 1, i - j)
                candidate = (max(best[s - 1][j][0], c), best[s - 1][j][1] + c * c)
                if candidate < best[s][i]:
                    best[s][i], cut[s][i] = candidate, j
    sizes, i = [], n
    for s in range(num_stages, 0, -1):
        sizes.append(i - cut[s][i])
        i = cut[s][i]
    return tuple(reversed(sizes))


def rank_layers(layout: Layout, pp_rank: int) -> int:
    """Blocks pipeline rank `pp_rank` holds: the blocks of its virtual stages (`Layout.stages_of`)."""
    if layout.pp == 1:
        return sum(layout.stage_layers) if layout.stage_layers else 0
    return sum(layout.stage_layers[s] for s in layout.stages_of(pp_rank))


# ---- validation --------------------------------------------------------------------------------------


def smallest_tp_rows(model: "ModelConfig", tp: int) -> int:
    """The smallest first dimension of a parameter after tensor parallelism (what FSDP then shards)."""
    head_dim = model.head_size
    kv_heads = model.num_kv_heads // tp if model.num_kv_heads % tp == 0 else model.num_kv_heads  # replicated
    # (a mixture of experts' stacks are split along their second dimension when FSDP has more shards than
    # experts: raydist.parallel.fsdp.expert_placement)
    return min(model.d_model, model.num_heads * head_dim // tp, kv_heads * head_dim, model.ffn_hidden // tp,
               model.vocab_size // tp, *((model.expert_hidden,) if model.moe_experts else ()))


def validate(layout: Layout, model: "ModelConfig", seq_len: int) -> list[str]:
    """Every reason `layout` cannot train `model` on sequences of `seq_len` tokens (empty: it can). Each
    reason names the value and the fix."""
    lay, m = layout, model
    problems: list[str] = []
    for name, value in lay.degrees().items():
        if value < 1:
            problems.append(f"parallel.{name}={value} must be a positive degree")
    if problems:
        return problems
    if lay.micro_batch < 1 or lay.num_microbatches < 1:
        problems.append(f"micro_batch={lay.micro_batch} x num_microbatches={lay.num_microbatches} must both be "
                        ">= 1; raise train.global_batch or lower the data-parallel degree")
    problems += mesh_problems(lay, m, seq_len)
    if lay.pp > 1:
        problems += _pipeline(lay, m)
    if lay.activation_checkpoint not in RECOMPUTE_POLICIES:
        problems.append(f"train.activation_checkpoint={lay.activation_checkpoint!r} is not one of "
                        f"{', '.join(RECOMPUTE_POLICIES)}")
    return problems


def mesh_problems(layout: Layout, model: "ModelConfig", seq_len: int) -> list[str]:
    """validate's reasons that come from the mesh's degrees alone (tensor, FSDP, context parallelism): no
    micro-batch size or count, recompute policy or schedule lifts them (the planner drops such a mesh once
    instead of validating each of its candidates)."""
    return (_tensor_parallel(layout, model, seq_len) + _fsdp(layout, model) + _context_parallel(layout, model, seq_len)
            + _mixture_of_experts(layout, model))


def _mixture_of_experts(lay: Layout, m: "ModelConfig") -> list[str]:
    """What a mixture of experts needs of the layout: ep dividing the experts and dp_shard, FSDP's split of
    an ep rank's experts even, tp dividing every expert's hidden units."""
    out = []
    if lay.ep > 1 and not m.moe_experts:
        out.append(f"parallel.ep={lay.ep} needs a mixture of experts (model.moe_experts); set parallel.ep = 1")
    if lay.ep > 1 and m.moe_experts % lay.ep:
        out.append(f"parallel.ep={lay.ep} does not divide model.moe_experts={m.moe_experts}; pick ep from "
                   f"{divisors(m.moe_experts)}")
    if lay.dp_shard % lay.ep:
        out.append(f"parallel.ep={lay.ep} does not divide parallel.dp_shard={lay.dp_shard}: the expert-parallel "
                   "ranks are FSDP ranks; make dp_shard a multiple of ep")
    outer = lay.dp_shard // lay.ep * lay.cp if lay.dp_shard % lay.ep == 0 else 1
    if lay.ep > 1 and m.moe_experts and (m.expert_hidden % outer or m.d_model % outer):
        out.append(f"parallel.ep={lay.ep}: FSDP splits each expert's rows over dp_shard / ep x cp = {outer} ranks, "
                   f"which must divide model.moe_ffn_hidden={m.expert_hidden} and model.d_model={m.d_model}; "
                   "raise ep or lower dp_shard")
    hidden = {"model.moe_ffn_hidden": m.expert_hidden, "model.moe_shared_ffn_hidden": m.moe_shared_ffn_hidden}
    for key, value in hidden.items():
        if m.moe_experts and lay.tp > 1 and value % lay.tp:
            out.append(f"parallel.tp={lay.tp} does not divide {key}={value}: tensor parallelism splits each expert's "
                       f"hidden units; pick tp from {divisors(value)}")
    return out


def _fsdp(lay: Layout, m: "ModelConfig") -> list[str]:
    if lay.fsdp_size <= smallest_tp_rows(m, lay.tp):
        return []
    return [f"parallel.dp_shard={lay.dp_shard} x cp={lay.cp} = {lay.fsdp_size} FSDP shards exceeds the smallest "
            f"parameter's first dimension ({smallest_tp_rows(m, lay.tp)}): some ranks would hold empty shards; "
            "lower parallel.dp_shard (use dp_replicate for the rest: HSDP)"]


def _tensor_parallel(lay: Layout, m: "ModelConfig", seq_len: int) -> list[str]:
    """Every dimension tensor parallelism splits must split evenly over tp; kv heads may also be fewer
    than tp when tp is a multiple of them (each group of tp/K ranks then shares a replicated kv head)."""
    tp, out = lay.tp, []
    if lay.sequence_parallel and tp == 1:
        out.append("parallel.sequence_parallel=true needs parallel.tp > 1; set tp or turn sequence_parallel off")
    if tp == 1:
        return out
    for key, value in (("num_heads", m.num_heads), ("ffn_hidden", m.ffn_hidden), ("vocab_size", m.vocab_size)):
        if value % tp:
            out.append(f"parallel.tp={tp} does not divide model.{key}={value}; pick tp from "
                       f"{[d for d in divisors(value) if d > 1]} or change model.{key}")
    kv = m.num_kv_heads
    if kv % tp and tp % kv:
        choices = sorted(set(divisors(kv)) | {kv * d for d in divisors(m.num_heads // kv)})
        out.append(f"parallel.tp={tp} and model.num_kv_heads={kv}: tensor parallelism splits kv heads evenly "
                   f"(tp divides num_kv_heads) or replicates them (num_kv_heads divides tp); pick tp from {choices}")
    if lay.sequence_parallel:
        local = seq_len // lay.cp if seq_len % lay.cp == 0 else seq_len
        where = f"data.seq_len={seq_len}" + (f" / cp={lay.cp} = {local}" if lay.cp > 1 else "")
        if local % tp:
            out.append(f"parallel.sequence_parallel=true splits the sequence over tp={tp}, which does not divide "
                       f"{where}; change data.seq_len or tp, or turn sequence_parallel off")
    return out


def _context_parallel(lay: Layout, m: "ModelConfig", seq_len: int) -> list[str]:
    """Ring (causal, zig-zag) needs seq_len divisible by 2 cp; Ulysses needs seq_len divisible by cp and
    the per-rank query heads (num_heads / tp) divisible by cp (kv heads that cp does not divide are
    repeated to lcm(kv, cp))."""
    cp = lay.cp
    if lay.cp_impl not in CP_IMPLEMENTATIONS:
        return [f"parallel.cp_impl={lay.cp_impl!r} is not one of {', '.join(CP_IMPLEMENTATIONS)}"]
    if cp == 1:
        return []
    if lay.cp_impl == "ring":
        if seq_len % (2 * cp):
            return [f"data.seq_len={seq_len} is not divisible by 2 x parallel.cp = {2 * cp}: ring attention splits "
                    f"each sequence into 2*cp equal zig-zag chunks; make seq_len a multiple of {2 * cp} or change cp"]
        return []
    out = []
    if seq_len % cp:
        out.append(f"data.seq_len={seq_len} is not divisible by parallel.cp={cp} (Ulysses splits each sequence "
                   f"into cp shards); make seq_len a multiple of {cp} or change cp")
    heads = m.num_heads // lay.tp
    if heads % cp:
        out.append(f"parallel.cp={cp} does not divide the query heads per rank (model.num_heads={m.num_heads} / "
                   f"tp={lay.tp} = {heads}): Ulysses gives each cp rank whole heads; use a cp that divides "
                   f"{heads}, or parallel.cp_impl=ring")
    return out


def _pipeline(lay: Layout, m: "ModelConfig") -> list[str]:
    out = []
    if lay.pp_schedule not in SCHEDULE_KINDS:
        return [f"parallel.pp_schedule={lay.pp_schedule!r} is not one of {', '.join(KINDS)}"]
    kind = SCHEDULE_KINDS[lay.pp_schedule]
    if lay.virtual_stages < kind.min_virtual_stages:
        out.append(f"parallel.pp_schedule={kind.name!r} needs parallel.virtual_stages >= {kind.min_virtual_stages}")
    if m.num_layers < lay.num_stages:
        out.append(f"model.num_layers={m.num_layers} is less than pp x virtual_stages = {lay.num_stages}: every "
                   "pipeline stage needs a block; lower parallel.pp or add layers")
    elif len(lay.stage_layers) != lay.num_stages or sum(lay.stage_layers) != m.num_layers or \
            min(lay.stage_layers) < 1:
        out.append(f"stage partition {list(lay.stage_layers)} does not split model.num_layers={m.num_layers} into "
                   f"{lay.num_stages} non-empty stages")
    if problem := kind.microbatch_problem(kind.name, lay.pp, lay.num_microbatches, True):
        out.append(problem)
    if kind.split_backward and lay.activation_checkpoint == "selective":
        out.append(f"parallel.pp_schedule={lay.pp_schedule!r} splits the backward in two passes (B, then W) and "
                   "train.activation_checkpoint='selective' keeps its cached tensors for one pass only; use "
                   "activation_checkpoint 'full' or 'every_k', or pp_schedule='1f1b'")
    return out
