"""The planner and the runtime accept the same layouts: over a grid of model shapes and world sizes 1-16,
every layout in the planner's search space is accepted by the planner exactly when `raydist train`'s
layout planning (`plan_layout` on the user's settings) accepts it."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from raydist.config import Config, ConfigError
from raydist.planner.enumerate import ALL_FEATURES, valid_layouts
from raydist.planner.hardware import DEVICES
from raydist.planner.placement import Workload
from raydist.planner.policy import plan_layout
from raydist.schedule.batch import divisors

SHAPES = {
    "gqa": dict(num_layers=4, d_model=64, num_heads=4, num_kv_heads=2, ffn_hidden=128, vocab_size=320),
    "mqa-odd": dict(num_layers=6, d_model=96, num_heads=6, num_kv_heads=1, ffn_hidden=192, vocab_size=198),
    "mha-deep": dict(num_layers=8, d_model=64, num_heads=8, num_kv_heads=8, ffn_hidden=96, vocab_size=100),
}
GLOBAL_BATCH, SEQ_LEN = 16, 36


def _key(lay) -> tuple:
    return (lay.pp, lay.dp_replicate, lay.dp_shard, lay.cp, lay.tp, lay.cp_impl if lay.cp > 1 else "-",
            lay.pp_schedule if lay.pp > 1 else "-", lay.virtual_stages, lay.micro_batch)


def _factorizations(world: int, dims: int = 5):
    if dims == 1:
        yield (world,)
        return
    for d in divisors(world):
        for rest in _factorizations(world // d, dims - 1):
            yield (d, *rest)


def _runtime_accepts(shape: dict, world: int) -> set[tuple]:
    accepted = set()
    for pp, rep, shard, cp, tp in _factorizations(world):
        dp = rep * shard
        if GLOBAL_BATCH % dp:
            continue
        impls = ("ring", "ulysses") if cp > 1 else ("ring",)
        schedules = [("1f1b", 1)] + ([("interleaved", 2), ("interleaved", 4), ("zbh1", 1), ("zbv", 2)]
                                     if pp > 1 else [])
        for impl, (schedule, v), micro in itertools.product(impls, schedules, divisors(GLOBAL_BATCH // dp)):
            raw = {"model": shape, "data": {"seq_len": SEQ_LEN},
                   "train": {"global_batch": GLOBAL_BATCH, "micro_batch": micro},
                   "parallel": {"pp": pp, "dp_replicate": rep, "dp_shard": shard, "cp": cp, "tp": tp,
                                "cp_impl": impl, "pp_schedule": schedule, "virtual_stages": v,
                                "sequence_parallel": tp > 1}}
            try:
                accepted.add(_key(plan_layout(Config.from_dict(raw), world)))
            except ConfigError:
                pass
    return accepted


@pytest.mark.parametrize("name", SHAPES)
def test_planner_and_runtime_accept_the_same_layouts(name):
    shape = SHAPES[name]
    cfg = Config.from_dict({"model": shape, "data": {"seq_len": SEQ_LEN}, "train": {"global_batch": GLOBAL_BATCH}})
    w = Workload.from_config(cfg, compute_dtype_bytes=2)
    hw = dataclasses.replace(DEVICES["h100"], gpus_per_node=16)  # no node-size preference: the whole space
    total = 0
    for world in range(1, 17):
        planner = {_key(lay) for lay, ok in valid_layouts(w, world, hw, ALL_FEATURES, policies=("none",)) if ok}
        runtime = _runtime_accepts(shape, world)
        assert planner == runtime, (world, sorted(planner ^ runtime)[:10])
        total += len(runtime)
    assert total > 100  # the grid is not trivially empty
