"""The layout policy: (the user's config, the live worker count) -> one `Layout`, global batch fixed.

`plan_layout(cfg, world_size)` is the only place a layout is decided. The driver calls it before any
worker starts (bad input fails there), and at every worker-group start rank 0 calls it and broadcasts the
result (`raydist.elastic.session`), so all workers run the same layout even when the planner's choice
depends on a live measurement.

- A fixed-size run (no [elastic] range) uses every worker exactly as configured.
- An elastic run keeps the configured tensor, pipeline and context degrees (a model's split does not
  change with the cluster); the data-parallel degree absorbs the change. Among the dp sizes that fit the
  live workers, the largest one that divides the global batch wins; the micro-batch is then the largest
  divisor of the per-rank batch not above train.micro_batch, so

      global_batch = dp x micro_batch x num_microbatches

  holds at every size and the loss curve is the same function of the step. Workers that fit no layout
  (e.g. the 5th worker when tp = 2) stay idle and are reported.
- `parallel.auto`: the planner's best layout for the live worker count.

A micro-batch left unset (train.micro_batch = 0) is derived by the batch plan (raydist.schedule.batch): the
largest divisor of the per-rank batch not above `AUTO_MICRO_BATCH_LIMIT` (with a pipeline: one that also
gives at least pp micro-batches).
"""

from __future__ import annotations

from raydist.config import Config
from raydist.errors import ConfigError
from raydist.parallel.layout import Layout, stage_partition, validate
from raydist.parallel.mesh import MeshSpec
from raydist.schedule.batch import AUTO_MICRO_BATCH_LIMIT, BatchPlan, plan_batch
from raydist.schedule.registry import chunks_per_rank


def resolve_layout(cfg: Config, spec: MeshSpec, *, micro_batch_limit: int | None = None,
                   batch: BatchPlan | None = None, reason: str = "") -> Layout:
    """The Layout of `cfg` on the resolved degrees `spec`, or a ConfigError naming the value and the fix.

    The micro-batch is the batch plan's (raydist.schedule.batch.plan_batch): with a pipeline and
    parallel.num_microbatches set, per-rank batch / M; else train.micro_batch, which must divide the per-rank
    batch; unset (0) or under `micro_batch_limit` (elastic runs), the largest fitting divisor up to the limit."""
    p, t = cfg.parallel, cfg.train
    batch = batch or plan_batch(t.global_batch, spec.dp, micro_batch=t.micro_batch, limit=micro_batch_limit,
                                pp=spec.pp, schedule=p.pp_schedule, num_microbatches=p.num_microbatches)
    stages = spec.pp * chunks_per_rank(p.pp_schedule, p.virtual_stages)
    layout = Layout(
        spec, micro_batch=batch.micro_batch, num_microbatches=batch.num_microbatches,
        activation_checkpoint=t.activation_checkpoint, activation_checkpoint_k=t.activation_checkpoint_k,
        sequence_parallel=p.sequence_parallel, cp_impl=p.cp_impl, pp_schedule=p.pp_schedule,
        virtual_stages=p.virtual_stages,
        stage_layers=stage_partition(cfg.model, stages) if 1 < spec.pp and stages <= cfg.model.num_layers else (),
        fsdp_reshard_after_forward=reshard_after_forward(p.fsdp_reshard_after_forward, spec.pp),
        fsdp_forward_prefetch=p.fsdp_forward_prefetch,
        reason=reason)
    problems = validate(layout, cfg.model, cfg.data.seq_len)
    if problems:
        raise ConfigError(problems[0])
    return layout


def plan_layout(cfg: Config, world_size: int) -> Layout:
    """The layout this config trains with on `world_size` live workers (ranks beyond its world_size idle)."""
    p, t = cfg.parallel, cfg.train
    if p.auto:
        return _planned(cfg, world_size)
    if not cfg.elastic_enabled:
        return resolve_layout(cfg, MeshSpec.from_config(p).resolve(world_size),
                              reason="fixed-size run: the configured layout")
    for name in ("pp", "cp", "tp"):
        if getattr(p, name) == -1:
            raise ConfigError(f"parallel.{name}=-1 is not allowed in an elastic run: set it; the data-parallel "
                              "degrees absorb changes of the worker count")
    model_parallel = p.pp * p.cp * p.tp
    # Which data-parallel degree grows: the one set to -1; with both fixed, replicas if there are several
    # (HSDP keeps its shard group), else the FSDP shard degree.
    if p.dp_replicate == -1 or (p.dp_shard != -1 and p.dp_replicate > 1):
        grow, unit = "dp_replicate", max(p.dp_shard, 1)
    else:
        grow, unit = "dp_shard", max(p.dp_replicate, 1)
    for count in range(world_size // (model_parallel * unit), 0, -1):
        dp = count * unit
        replicate, shard = (count, unit) if grow == "dp_replicate" else (unit, count)
        if t.global_batch % dp == 0 and shard % p.ep == 0:  # (the expert-parallel ranks are FSDP ranks)
            spec = MeshSpec(p.pp, replicate, shard, p.cp, p.tp, p.ep)
            break
    else:
        experts = f" and dp_shard a multiple of ep={p.ep}" if p.ep > 1 else ""
        raise ConfigError(f"no layout of {world_size} worker(s) keeps train.global_batch={t.global_batch} with "
                          f"tp={p.tp} x pp={p.pp} x cp={p.cp}{experts}; raise elastic.min_workers or pick a global "
                          "batch with more divisors")
    layout = resolve_layout(cfg, spec, micro_batch_limit=t.micro_batch or AUTO_MICRO_BATCH_LIMIT)
    idle = world_size - layout.world_size
    reason = (f"{world_size} workers -> {spec.describe()} ({spec.world_size} active"
              + (f", {idle} idle: no valid layout uses them" if idle else "") + f"), micro_batch "
              f"{layout.micro_batch} x {layout.num_microbatches} micro-batches x dp {layout.dp} = global batch "
              f"{t.global_batch}")
    return layout.replace(reason=reason)


def replica_layout(cfg: Config) -> Layout:
    """The layout one live-recovery replica trains in its own world of dp_shard x cp x tp x pp workers
    (raydist.elastic.live): the configured layout with dp_replicate 1, the whole global batch on the replica.

    Without a pipeline a live step picks each step's micro-batch from the rows it got, up to this layout's
    (the batch plan's `largest_divisor` of them), and the whole run's layout need not exist (3 replicas may
    share a global batch of 8). A pipeline runs whole micro-batches of the whole run's size: the replica runs
    the whole run's micro-batch, M x dp_replicate of them, so that a step gives each rank the whole run's
    micro-batches when every replica is in the quorum and more of the same size when fewer are; the whole
    run's layout must then be valid (a ConfigError otherwise). Planned once, on the driver; the user's
    config is not rewritten."""
    p = cfg.parallel
    spec = MeshSpec(p.pp, 1, p.dp_shard, p.cp, p.tp, p.ep)
    reason = f"live recovery: one of {p.dp_replicate} replicas, {spec.describe()} over {spec.world_size} worker(s)"
    if p.pp == 1:
        return resolve_layout(cfg, spec, reason=reason)
    whole = plan_layout(cfg, p.dp_replicate * spec.world_size)
    return resolve_layout(cfg, spec, batch=BatchPlan(cfg.train.global_batch, spec.dp, whole.micro_batch),
                          reason=reason)


def _planned(cfg: Config, world_size: int) -> Layout:
    """parallel.auto: the planner's best layout for this many workers (elastic runs ask at each start)."""
    from raydist.planner import choose_layout

    layout, estimate = choose_layout(cfg, world_size)
    reason = (f"planner: {layout.spec.describe()} on {world_size} workers, micro_batch {layout.micro_batch}, "
              f"recompute {layout.activation_checkpoint}; estimated step {estimate.get('step_time_s', '?')} s, "
              f"MFU {estimate.get('mfu', '?')}")
    return layout.replace(reason=reason)


def reshard_after_forward(setting: str, pp: int) -> bool:
    """`parallel.fsdp_reshard_after_forward` resolved: `auto` keeps a pipeline's gathered parameters from
    forward to backward (as torchtitan does under PP: the M micro-batches would re-gather every chunk twice
    each) and frees them after forward otherwise (ZeRO-3)."""
    return {"true": True, "false": False}.get(setting, pp == 1)
