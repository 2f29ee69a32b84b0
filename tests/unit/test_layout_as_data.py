"""The driver's layout travels to the workers as data: a worker group of the size the driver planned for takes
it and plans nothing; another size (an elastic run that started larger, or resized) plans its own."""

from __future__ import annotations

import dataclasses

from raydist.config import Config
from raydist.parallel.layout import Layout
from raydist.parallel.runtime import spawn
from raydist.testing import tiny_config


def _share(raw: dict, given: dict | None) -> tuple[dict, list[int]]:
    import torch.distributed as dist

    from raydist.elastic import session

    planned: list[int] = []
    plan = session.plan_layout

    def counting(cfg, world):
        planned.append(world)
        return plan(cfg, world)

    session.plan_layout = counting
    store = dist.distributed_c10d._get_default_store()
    layout = session.layout_through_store(Config.from_dict(raw), store, given=given)
    # rank 0 hosts the store: it must not exit (a worker trains on) before every rank has read the layout
    dist.barrier()
    return layout.to_dict(), planned


def _driver(raw: dict, tmp_path, *overrides: str):
    from raydist.driver.launcher import plan

    cfg = Config.from_dict({**raw, "checkpoint": {"storage": str(tmp_path)}}, list(overrides))
    return plan(cfg, log=lambda *_: None)


def test_a_group_of_the_planned_size_takes_the_drivers_layout_and_another_size_plans(tiny_data, tmp_path):
    raw = tiny_config(tiny_data)
    raw = {**raw, "parallel": {**raw.get("parallel", {}), "dp_replicate": -1}, "ray": {"num_workers": 2}}
    lp = _driver(raw, tmp_path)
    given = lp.layout_for_workers()
    assert given["world_size"] == lp.planned_for == 2 and Layout.from_dict(given["layout"]) == lp.layout
    # a layout no worker would plan (the policy picks micro-batches of 2 here): received as sent
    sent = dataclasses.replace(lp.layout, micro_batch=1, num_microbatches=lp.layout.per_rank_batch,
                               reason="the driver's")
    assert sent != lp.layout and sent.global_batch == lp.layout.global_batch
    results = spawn(_share, 2, raw, {"world_size": 2, "layout": sent.to_dict()})
    assert [Layout.from_dict(layout) for layout, _ in results] == [sent, sent]
    assert [planned for _, planned in results] == [[], []]  # nobody planned
    # the world is not the one the driver planned for: rank 0 plans it once, every rank receives that
    results = spawn(_share, 2, raw, {"world_size": 3, "layout": sent.to_dict()})
    assert [Layout.from_dict(layout) for layout, _ in results] == [lp.layout, lp.layout]
    assert [planned for _, planned in results] == [[2], []]


def test_the_driver_sends_no_layout_where_the_worker_must_plan(tiny_data, tmp_path):
    raw = {**tiny_config(tiny_data), "ray": {"num_workers": 2}}
    elastic = _driver(raw, tmp_path, "elastic.min_workers=1", "elastic.max_workers=4")
    assert elastic.layout_for_workers()["world_size"] == 1  # planned for the smallest group that has a layout
    auto = _driver(raw, tmp_path, "parallel.auto=true")  # the planner prices the device it runs on
    assert auto.layout_for_workers() is None


def test_under_live_recovery_the_driver_sends_every_replica_its_layout(tiny_data, tmp_path):
    raw = {**tiny_config(tiny_data), "ray": {"num_workers": 4}}
    lp = _driver(raw, tmp_path, "parallel.dp_replicate=2", "parallel.dp_shard=2", "elastic.live_recovery=true")
    given = lp.layout_for_workers()
    layout = Layout.from_dict(given["layout"])
    assert given["world_size"] == 2 and layout == lp.layout  # a replica's workers: they plan nothing
    assert (layout.dp_replicate, layout.dp_shard, layout.global_batch) == (1, 2, lp.cfg.train.global_batch)
    assert lp.cfg.parallel.dp_replicate == 2  # the config stays the user's
