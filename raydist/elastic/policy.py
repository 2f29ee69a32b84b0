"""The layout policy: live worker count -> a valid mesh, global batch fixed.

An elastic run keeps the configured tensor, pipeline and context degrees (a model's split does not
change with the cluster); the data-parallel degree absorbs the change. Among the dp sizes that fit the
live workers, the largest one that divides the global batch wins; the micro-batch is then the largest
divisor of the per-rank batch not above train.micro_batch, so

    global_batch = dp x micro_batch x accumulation_steps

holds at every size and the loss curve is the same function of the step. Workers that fit no layout
(e.g. the 5th worker when tp = 2) stay idle and are reported.

A fixed-size run (no [elastic] range) must use every worker exactly as configured.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from raydist.config import Config, ConfigError
from raydist.mesh import MeshSpec
from raydist.parallel.validate import check_layout


@dataclass(frozen=True)
class LayoutDecision:
    spec: MeshSpec  # over the active workers (ranks 0 .. spec.world_size - 1)
    micro_batch: int
    accum_steps: int
    idle_workers: int
    reason: str
    config: Config | None = None  # the whole config to train with, when the planner chose it (parallel.auto)

    @property
    def active_workers(self) -> int:
        return self.spec.world_size


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def plan_layout(cfg: Config, world_size: int) -> LayoutDecision:
    p, t = cfg.parallel, cfg.train
    if p.auto:
        return _planned(cfg, world_size)
    if not cfg.elastic_enabled:
        spec = MeshSpec.from_config(p).resolve(world_size)
        accum = check_layout(cfg, spec)
        return LayoutDecision(spec, t.micro_batch, accum, 0, "fixed-size run: the configured layout")
    fixed = {"pp": p.pp, "cp": p.cp, "tp": p.tp}
    for name, value in fixed.items():
        if value == -1:
            raise ConfigError(f"parallel.{name}=-1 is not allowed in an elastic run: set it; the data-parallel "
                              "degrees absorb changes of the worker count")
    model_parallel = p.pp * p.cp * p.tp
    # Which data-parallel degree grows: the one set to -1; with both fixed, replicas if there are several
    # (HSDP keeps its shard group), else the FSDP shard degree.
    if p.dp_replicate == -1 or (p.dp_shard != -1 and p.dp_replicate > 1):
        grow, unit = "dp_replicate", max(p.dp_shard, 1)
    else:
        grow, unit = "dp_shard", max(p.dp_replicate, 1)
    best = None
    for count in range(world_size // (model_parallel * unit), 0, -1):
        dp = count * unit
        if t.global_batch % dp == 0:
            micro = _largest_divisor_at_most(t.global_batch // dp, t.micro_batch)
            replicate, shard = (count, unit) if grow == "dp_replicate" else (unit, count)
            best = (MeshSpec(p.pp, replicate, shard, p.cp, p.tp), micro)
            break
    if best is None:
        raise ConfigError(f"no layout of {world_size} worker(s) keeps train.global_batch={t.global_batch} with "
                          f"tp={p.tp} x pp={p.pp} x cp={p.cp}; raise elastic.min_workers or pick a global batch "
                          "with more divisors")
    spec, micro = best
    accum = check_layout(_with_micro_batch(cfg, micro), spec)
    idle = world_size - spec.world_size
    reason = (f"{world_size} workers -> {spec.describe()} ({spec.world_size} active"
              + (f", {idle} idle: no valid layout uses them" if idle else "") + f"), micro_batch {micro} x "
              f"{accum} accumulation steps x dp {spec.dp} = global batch {t.global_batch}")
    return LayoutDecision(spec, micro, accum, idle, reason)


def _planned(cfg: Config, world_size: int) -> LayoutDecision:
    """parallel.auto: the planner's best layout for this many workers (elastic runs ask at each start)."""
    from raydist.planner import auto_config

    planned, settings = auto_config(cfg, world_size)
    planned = replace(planned, parallel=replace(planned.parallel, auto=False))
    spec = MeshSpec.from_config(planned.parallel).resolve(world_size)
    accum = check_layout(planned, spec)
    estimate = settings.get("estimate", {})
    reason = (f"planner: {spec.describe()} on {world_size} workers, micro_batch {planned.train.micro_batch}, "
              f"recompute {planned.train.activation_checkpoint}; estimated step {estimate.get('step_time_s', '?')} s, "
              f"MFU {estimate.get('mfu', '?')}")
    return LayoutDecision(spec, planned.train.micro_batch, accum, 0, reason, planned)


def _with_micro_batch(cfg: Config, micro_batch: int) -> Config:
    return replace(cfg, train=replace(cfg.train, micro_batch=micro_batch))


def apply_decision(cfg: Config, decision: LayoutDecision) -> Config:
    """The config the active workers train with (micro-batch re-derived; layout degrees resolved)."""
    if decision.config is not None:
        return decision.config
    s = decision.spec
    parallel = replace(cfg.parallel, pp=s.pp, dp_replicate=s.dp_replicate, dp_shard=s.dp_shard, cp=s.cp, tp=s.tp)
    return replace(cfg, parallel=parallel, train=replace(cfg.train, micro_batch=decision.micro_batch))
