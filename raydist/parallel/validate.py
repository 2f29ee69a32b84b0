"""Layout checks that need the config and the resolved mesh together, run on the driver before workers
start (launcher.plan) and again in each worker (Trainer). Each failure is a ConfigError naming the value
and the fix."""

from __future__ import annotations

from raydist.config import Config, ConfigError
from raydist.mesh import MeshSpec


def check_layout(cfg: Config, spec: MeshSpec) -> int:
    """Validates `spec` for `cfg`; returns the gradient-accumulation steps per optimizer step."""
    t, m = cfg.train, cfg.model
    per_rank = t.global_batch // spec.dp if t.global_batch % spec.dp == 0 else None
    if per_rank is None or per_rank % t.micro_batch:
        raise ConfigError(f"train.global_batch={t.global_batch} must be divisible by dp ({spec.dp}) x "
                          f"train.micro_batch ({t.micro_batch}); change global_batch, micro_batch or the layout")
    shards = spec.dp_shard * spec.cp
    smallest = min(m.d_model, m.num_kv_heads * (m.d_model // m.num_heads) // spec.tp)
    if shards > smallest:
        raise ConfigError(f"parallel.dp_shard={spec.dp_shard} x cp={spec.cp} = {shards} FSDP shards exceeds the smallest "
                          f"parameter's first dimension ({smallest}): some ranks would hold empty shards; lower "
                          "parallel.dp_shard (use dp_replicate for the rest: HSDP)")
    return per_rank // t.micro_batch
