"""Layout checks that need the config and the resolved mesh together, run on the driver before workers
start (launcher.plan) and again in each worker (Trainer). Each failure is a ConfigError naming the value
and the fix."""

from __future__ import annotations

from raydist.config import Config, ConfigError, divisors
from raydist.mesh import MeshSpec


def check_layout(cfg: Config, spec: MeshSpec) -> int:
    """Validates `spec` for `cfg`; returns the gradient-accumulation steps per optimizer step."""
    t = cfg.train
    per_rank = t.global_batch // spec.dp if t.global_batch % spec.dp == 0 else None
    if per_rank is None or per_rank % t.micro_batch:
        raise ConfigError(f"train.global_batch={t.global_batch} must be divisible by dp ({spec.dp}) x "
                          f"train.micro_batch ({t.micro_batch}); change global_batch, micro_batch or the layout")
    check_tensor_parallel(cfg, spec)
    shards = spec.dp_shard * spec.cp
    smallest = smallest_tp_rows(cfg, spec.tp)
    if shards > smallest:
        raise ConfigError(f"parallel.dp_shard={spec.dp_shard} x cp={spec.cp} = {shards} FSDP shards exceeds the smallest "
                          f"parameter's first dimension ({smallest}): some ranks would hold empty shards; lower "
                          "parallel.dp_shard (use dp_replicate for the rest: HSDP)")
    check_context_parallel(cfg, spec)
    accum = per_rank // t.micro_batch
    if spec.pp > 1:
        _check_pipeline(cfg, spec, per_rank, accum)
    return accum


def _check_pipeline(cfg: Config, spec: MeshSpec, per_rank: int, accum: int) -> None:
    p = cfg.parallel
    virtual = p.virtual_stages if p.pp_schedule == "interleaved" else 1
    if cfg.model.num_layers < spec.pp * virtual:
        raise ConfigError(f"model.num_layers={cfg.model.num_layers} is less than pp x virtual_stages = "
                          f"{spec.pp * virtual}: every pipeline stage needs a block; lower parallel.pp or add layers")
    microbatches = p.num_microbatches or accum
    if per_rank % microbatches:
        raise ConfigError(f"parallel.num_microbatches={microbatches} does not divide the per-rank batch {per_rank} "
                          "(train.global_batch / dp); pick a divisor of it")
    if p.pp_schedule == "interleaved" and microbatches % spec.pp:
        raise ConfigError(f"interleaved 1F1B needs the micro-batch count ({microbatches}) to be a multiple of "
                          f"parallel.pp={spec.pp}; set parallel.num_microbatches accordingly")
    if spec.cp > 1:
        raise ConfigError("pipeline parallelism with context parallelism (parallel.cp > 1) is not supported yet; "
                          "use one of them")
    if p.sequence_parallel:
        raise ConfigError("pipeline parallelism with parallel.sequence_parallel=true is not supported yet; "
                          "turn sequence parallelism off when parallel.pp > 1")


def check_context_parallel(cfg: Config, spec: MeshSpec) -> None:
    """Ring (causal, zig-zag) needs seq_len divisible by 2*cp; Ulysses needs the per-rank query heads
    (num_heads / tp) divisible by cp (kv heads that cp does not divide are repeated to lcm(kv, cp))."""
    if spec.cp <= 1:
        return
    cp, impl, m, seq_len = spec.cp, cfg.parallel.cp_impl, cfg.model, cfg.data.seq_len
    if impl == "ring" and seq_len % (2 * cp):
        raise ConfigError(f"data.seq_len={seq_len} is not divisible by 2 x parallel.cp = {2 * cp}: ring attention "
                          f"splits each sequence into 2*cp equal zig-zag chunks; make seq_len a multiple of "
                          f"{2 * cp} or change cp")
    if impl == "ulysses":
        if seq_len % cp:
            raise ConfigError(f"data.seq_len={seq_len} is not divisible by parallel.cp={cp} (Ulysses splits "
                              f"each sequence into cp shards); make seq_len a multiple of {cp} or change cp")
        heads = m.num_heads // spec.tp
        if heads % cp:
            raise ConfigError(f"parallel.cp={cp} does not divide the query heads per rank (model.num_heads="
                              f"{m.num_heads} / tp={spec.tp} = {heads}): Ulysses gives each cp rank whole heads; "
                              f"use a cp that divides {heads}, or parallel.cp_impl=ring")


# ---- tensor parallelism (raydist/parallel/tensor.py) ------------------------------------------------


def check_tensor_parallel(cfg: Config, spec: MeshSpec) -> None:
    """Every dimension tensor parallelism splits must split evenly over tp; kv heads may also be fewer
    than tp when tp is a multiple of them (each group of tp/K ranks then shares a replicated kv head)."""
    tp, m = spec.tp, cfg.model
    if tp == 1:
        return
    for key, value in (("num_heads", m.num_heads), ("ffn_hidden", m.ffn_hidden), ("vocab_size", m.vocab_size)):
        if value % tp:
            raise ConfigError(f"parallel.tp={tp} does not divide model.{key}={value}; pick tp from "
                              f"{[d for d in divisors(value) if d > 1]} or change model.{key}")
    kv = m.num_kv_heads
    if kv % tp and tp % kv:
        raise ConfigError(f"parallel.tp={tp} and model.num_kv_heads={kv}: tensor parallelism splits kv heads "
                          f"evenly (tp divides num_kv_heads) or replicates them (num_kv_heads divides tp); "
                          f"pick tp from {sorted(set(divisors(kv)) | {kv * d for d in divisors(m.num_heads // kv)})}")
    if cfg.parallel.sequence_parallel:
        local = cfg.data.seq_len // spec.cp if cfg.data.seq_len % spec.cp == 0 else cfg.data.seq_len
        where = f"data.seq_len={cfg.data.seq_len}" + (f" / cp={spec.cp} = {local}" if spec.cp > 1 else "")
        if local % tp:
            raise ConfigError(f"parallel.sequence_parallel=true splits the sequence over tp={tp}, which does not "
                              f"divide {where}; change data.seq_len or tp, or turn sequence_parallel off")


def smallest_tp_rows(cfg: Config, tp: int) -> int:
    """The smallest first dimension of a parameter after tensor parallelism (what FSDP then shards)."""
    m = cfg.model
    head_dim = m.d_model // m.num_heads
    kv_heads = m.num_kv_heads // tp if m.num_kv_heads % tp == 0 else m.num_kv_heads  # else replicated
    return min(m.d_model, m.num_heads * head_dim // tp, kv_heads * head_dim, m.ffn_hidden // tp,
               m.vocab_size // tp)
