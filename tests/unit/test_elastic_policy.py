import pytest

from raydist.config import Config, ConfigError
from raydist.elastic.policy import apply_decision, plan_layout
from raydist.mesh import MeshSpec


def elastic(*overrides):
    return Config.load(None, ["elastic.min_workers=1", "elastic.max_workers=8", *overrides])


def test_fixed_size_run_uses_the_configured_layout():
    cfg = Config.load(None, ["parallel.dp_replicate=1", "parallel.dp_shard=-1"])
    d = plan_layout(cfg, 2)
    assert d.spec == MeshSpec(dp_shard=2) and d.idle_workers == 0 and d.micro_batch == 8
    with pytest.raises(ConfigError, match="must be divisible by dp \\(4\\) x train.micro_batch \\(8\\)"):
        plan_layout(cfg, 4)  # a fixed-size run does not re-derive the micro-batch


@pytest.mark.parametrize("world, replicate, micro, accum, idle", [
    (4, 4, 4, 1, 0),   # 16 = 4 x 4 x 1
    (3, 2, 8, 1, 1),   # 16 is not divisible by 3: dp 2, one worker idle
    (8, 8, 2, 1, 0),
    (1, 1, 8, 2, 0),
])
def test_dp_absorbs_the_worker_count_and_keeps_the_global_batch(world, replicate, micro, accum, idle):
    d = plan_layout(elastic("train.global_batch=16", "train.micro_batch=8"), world)
    assert (d.spec.dp_replicate, d.micro_batch, d.accum_steps, d.idle_workers) == (replicate, micro, accum, idle)
    assert d.spec.dp * d.micro_batch * d.accum_steps == 16
    assert apply_decision(elastic("train.global_batch=16"), d).train.micro_batch == micro


def test_model_parallel_degrees_are_kept_and_leftovers_idle():
    d = plan_layout(elastic("parallel.tp=2", "train.global_batch=12", "train.micro_batch=2"), 7)
    assert (d.spec.tp, d.spec.dp_replicate, d.idle_workers) == (2, 3, 1)
    assert "1 idle" in d.reason


def test_hsdp_keeps_its_shard_group_and_adds_replicas():
    d = plan_layout(elastic("parallel.dp_replicate=-1", "parallel.dp_shard=2", "train.global_batch=12",
                            "train.micro_batch=2"), 6)
    assert (d.spec.dp_replicate, d.spec.dp_shard) == (3, 2)


def test_fsdp_grows_when_shard_is_the_filled_degree():
    d = plan_layout(elastic("parallel.dp_replicate=1", "parallel.dp_shard=-1"), 4)
    assert (d.spec.dp_replicate, d.spec.dp_shard) == (1, 4)


def test_errors():
    with pytest.raises(ConfigError, match="parallel.tp=-1 is not allowed in an elastic run"):
        plan_layout(elastic("parallel.tp=-1", "parallel.dp_replicate=1"), 4)
    with pytest.raises(ConfigError, match="no layout of 1 worker"):
        plan_layout(elastic("parallel.tp=2"), 1)


def test_auto_asks_the_planner():
    cfg = Config.from_dict({"parallel": "auto", "train": {"global_batch": 16, "micro_batch": 8}})
    assert cfg.parallel.auto
    d = plan_layout(cfg, 4)
    assert d.spec.world_size == 4 and d.config is not None and not d.config.parallel.auto
    assert d.reason.startswith("planner:")
    assert apply_decision(cfg, d) is d.config
