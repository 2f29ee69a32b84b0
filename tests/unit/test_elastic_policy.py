import pytest

from raydist.config import Config, ConfigError
from raydist.parallel.mesh import MeshSpec
from raydist.planner.policy import plan_layout


def elastic(*overrides):
    return Config.load(None, ["elastic.min_workers=1", "elastic.max_workers=8", *overrides])


def test_fixed_size_run_uses_the_configured_layout():
    cfg = Config.load(None, ["parallel.dp_replicate=1", "parallel.dp_shard=-1"])
    d = plan_layout(cfg, 2)
    assert d.spec == MeshSpec(dp_shard=2) and d.world_size == 2 and d.micro_batch == 8
    explicit = Config.load(None, ["parallel.dp_replicate=1", "parallel.dp_shard=-1", "train.micro_batch=8"])
    with pytest.raises(ConfigError, match="must be divisible by dp \\(4\\) x train.micro_batch \\(8\\)"):
        plan_layout(explicit, 4)  # a fixed-size run does not re-derive a micro-batch the user set
    assert plan_layout(cfg, 4).micro_batch == 4  # an unset one is derived: 16 = 4 x 4


@pytest.mark.parametrize("world, replicate, micro, accum, idle", [
    (4, 4, 4, 1, 0),   # 16 = 4 x 4 x 1
    (3, 2, 8, 1, 1),   # 16 is not divisible by 3: dp 2, one worker idle
    (8, 8, 2, 1, 0),
    (1, 1, 8, 2, 0),
])
def test_dp_absorbs_the_worker_count_and_keeps_the_global_batch(world, replicate, micro, accum, idle):
    d = plan_layout(elastic("train.global_batch=16", "train.micro_batch=8"), world)
    assert (d.spec.dp_replicate, d.micro_batch, d.num_microbatches, world - d.world_size) == (replicate, micro, accum,
                                                                                             idle)
    assert d.spec.dp * d.micro_batch * d.num_microbatches == 16 == d.global_batch


def test_model_parallel_degrees_are_kept_and_leftovers_idle():
    d = plan_layout(elastic("parallel.tp=2", "train.global_batch=12", "train.micro_batch=2"), 7)
    assert (d.spec.tp, d.spec.dp_replicate, 7 - d.world_size) == (2, 3, 1)
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
    assert d.spec.world_size == 4 and d.global_batch == 16 and d.num_microbatches * d.micro_batch * d.dp == 16
    assert d.reason.startswith("planner:")
    assert cfg.parallel.auto  # the user's config is not rewritten
    assert d.micro_batch <= 8  # train.micro_batch bounds the planner's choice
    one = plan_layout(Config.from_dict({"parallel": "auto", "train": {"global_batch": 16, "micro_batch": 1}}), 4)
    assert one.micro_batch == 1 and one.num_microbatches * one.dp == 16


# ---- the two validators agree ---------------------------------------------------------------------------------

def _disagreements(validate=Config.validate) -> list[str]:
    """Configs of a grid (fixed-size and elastic, micro-batch unset, dividing or not, pipelines with and without
    parallel.num_microbatches) that `validate` refuses while the layout policy trains them on some world size
    in their range: the config check must never refuse what the policy accepts."""
    import dataclasses

    base = Config.load(None, [])
    found = []
    for global_batch in (8, 12, 16):
        for micro in (0, 3, 4, 6, 8):
            for pp, num_micro in ((1, 0), (2, 0), (2, 2)):
                for workers, (low, high) in ((4, (0, 0)), (0, (1, 4)), (0, (2, 8))):
                    cfg = dataclasses.replace(
                        base, train=dataclasses.replace(base.train, global_batch=global_batch, micro_batch=micro),
                        parallel=dataclasses.replace(base.parallel, pp=pp, num_microbatches=num_micro,
                                                     dp_replicate=-1 if high else 1, dp_shard=1 if high else -1),
                        ray=dataclasses.replace(base.ray, num_workers=workers or base.ray.num_workers),
                        elastic=dataclasses.replace(base.elastic, min_workers=low, max_workers=high))
                    worlds = range(max(low, 1), high + 1) if high else (workers,)
                    trains = []
                    for world in worlds:
                        try:
                            trains.append(plan_layout(cfg, world))
                        except ConfigError:
                            pass
                    try:
                        validate(cfg)
                    except ConfigError as refused:
                        if trains:
                            found.append(f"{refused} but {trains[0].describe()} trains it")
    return found


def test_the_config_check_never_refuses_what_the_layout_policy_trains():
    assert _disagreements() == []
    # global_batch 12 with micro_batch 8 as an upper bound trains micro-batches of 6 (or 4, 3...)
    layout = plan_layout(elastic("train.global_batch=12", "train.micro_batch=8"), 2)
    assert (layout.micro_batch, layout.num_microbatches, layout.dp) == (6, 1, 2)


def test_the_agreement_check_catches_a_config_check_stricter_than_the_policy():
    def old_validate(cfg: Config) -> None:  # what Config.validate did: micro_batch exact in elastic runs too
        Config.validate(cfg)
        if cfg.train.micro_batch and cfg.train.global_batch % cfg.train.micro_batch:
            raise ConfigError(f"train.global_batch={cfg.train.global_batch} is not divisible by "
                              f"train.micro_batch={cfg.train.micro_batch}")

    found = _disagreements(old_validate)
    assert found and any("train.micro_batch=8" in line and "global_batch=12" in line for line in found), found
