"""2-worker DDP equals 1 worker on the same global batch (gloo, fp32, `run_layout`'s default steps)."""

import torch

from raydist.config import Config
from raydist.parallel.runtime import spawn
from raydist.testing import assert_equivalent, run_layout, tiny_config


def test_ddp2_equals_single_process(tiny_data):
    raw = tiny_config(tiny_data)
    [single] = run_layout(raw, 1)
    ddp = run_layout(tiny_config(tiny_data, parallel={"dp_replicate": 2}), 2)
    assert single.losses[-1] < single.losses[0]  # it learns
    for rank in ddp:
        assert_equivalent(single, rank)


def _settled_bytes(stream) -> int:
    """The stream's bytes read once its reader has stopped reading ahead (it blocks `prefetch` shards on)."""
    import time

    last = -1
    while stream.bytes_read != last:
        last = stream.bytes_read
        time.sleep(0.5)
    return last


def _rank_reads(raw: dict, steps: int) -> dict:
    import torch.distributed as dist

    from raydist.elastic.session import LocalSession
    from raydist.training.trainer import Trainer, TrainerOptions

    cfg = Config.from_dict(raw)
    trainer = Trainer(cfg, torch.device("cpu"), LocalSession().start(cfg), TrainerOptions(record_samples=True))
    try:
        for _ in range(steps):
            trainer.train_step()
        stream = trainer._stream
        current = next(reversed(stream._loaded.values()))  # the shard being consumed
        return {"plan": stream.plan, "bytes": _settled_bytes(stream), "rank": dist.get_rank(),
                "held": 1.0 if current.rows is None else len(current.rows) / stream.split.shards[current.index]["rows"],
                "ids": [ids.tolist() for ids in trainer.sample_log]}
    finally:
        trainer.close()


def test_each_dp_rank_reads_only_its_row_groups(tiny_data):
    """Under DDP 2 each batch leader's stream has its rank's plan, takes the rank's slices of the order and
    reads less than a whole-shard reader of the same steps would (tiny_data: row groups of 8 rows, each
    rank's slice 8 rows)."""
    from raydist.data.position import RankPlan, SampleOrder, rank_slice
    from raydist.data.prepare import read_manifest
    from raydist.data.readers import ArrowReader
    from raydist.data.stream import SampleStream, Split

    raw = tiny_config(tiny_data, train={"global_batch": 16, "micro_batch": 8}, parallel={"dp_replicate": 2})
    steps = 6
    results = spawn(_rank_reads, 2, raw, steps)
    split = Split.open(tiny_data, "train")
    order = SampleOrder(split.shard_rows, 0, block=read_manifest(tiny_data)["row_group_rows"])
    for r in results:
        assert r["plan"] == RankPlan(16, r["rank"], 2)
        assert r["held"] <= 0.6  # the shard in use holds only the row groups with this rank's rows
        slices = [rank_slice(s * 16, 16, r["rank"], 2) for s in range(steps)]
        assert r["ids"] == [order.sample_ids(start, stop - start).tolist() for start, stop in slices]
        whole = SampleStream(split, order, ArrowReader(prefetch=2), rank_slice(0, 16, r["rank"], 2)[0])
        try:
            for s in range(steps):
                whole.take(*rank_slice(s * 16, 16, r["rank"], 2))
            # the same shards read (the one in use and the read-ahead) either way, a rank's own row groups
            # of them against all of them
            assert 0 < r["bytes"] < 0.8 * _settled_bytes(whole)
        finally:
            whole.close()


def test_apply_ddp_turns_buffer_sync_off_under_either_torch_name(monkeypatch):
    """torch 2.13's DDP takes `forward_sync_buffers` (`broadcast_buffers` deprecated); 2.11's only
    `broadcast_buffers`: apply_ddp asks the signature and turns the forward's buffer sync off either way."""
    import torch.nn.parallel

    from raydist.parallel.data_parallel import apply_ddp

    calls = []

    class Ddp213:
        def __init__(self, module, device_ids=None, broadcast_buffers=None, process_group=None,
                     gradient_as_bucket_view=False, forward_sync_buffers=None):
            calls.append({"broadcast_buffers": broadcast_buffers, "forward_sync_buffers": forward_sync_buffers})

    class Ddp211:
        def __init__(self, module, device_ids=None, broadcast_buffers=True, process_group=None,
                     gradient_as_bucket_view=False):
            calls.append({"broadcast_buffers": broadcast_buffers})

    for fake in (Ddp213, Ddp211):
        monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", fake)
        apply_ddp(torch.nn.Linear(2, 2), None, torch.device("cpu"))
    assert calls == [{"broadcast_buffers": None, "forward_sync_buffers": False}, {"broadcast_buffers": False}]
