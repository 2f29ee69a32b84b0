"""Bytes sent per step, counted at the collectives, against the ring-algorithm figures (2 gloo ranks)."""

import torch

from raydist.config import Config
from raydist.metrics.comm import CommCounter
from raydist.models.gpt import param_counts
from raydist.parallel.runtime import spawn
from raydist.testing import tiny_config


def _count(raw):
    from raydist.training.trainer import Trainer

    trainer = Trainer(Config.from_dict(raw), torch.device("cpu"))
    counter = CommCounter()
    if trainer.pm.kind == "ddp":
        trainer.pm.module.register_comm_hook(None, counter.ddp_hook())
    trainer.train_step()
    batch = trainer.next_batch()
    with counter.patch():
        trainer.train_step(batch)
    trainer.close()
    return dict(counter.bytes)


def test_ddp_and_fsdp_volumes(tiny_data):
    raw = tiny_config(tiny_data, train={"micro_batch": 4})  # one micro-batch per rank and step
    cfg = Config.from_dict(raw)
    counts = param_counts(cfg.model)
    total = 4 * counts["total"]
    root = 4 * (counts["embedding"] + cfg.model.d_model)  # embedding (tied head) and final norm
    raw["parallel"] = {"dp_replicate": 2, "dp_shard": 1}
    ddp = spawn(_count, 2, raw)[0]
    # gradients all-reduced once: 2 (p-1)/p x parameter bytes; the loss is not averaged until it is read
    assert abs(ddp["all_reduce"] - total) < 1e-6 * total
    raw["parallel"] = {"dp_replicate": 1, "dp_shard": 2}
    fsdp = spawn(_count, 2, raw)[0]
    # all-gather every unit in forward, the blocks again in backward (the root stays gathered)
    assert fsdp["all_gather"] == 0.5 * (2 * total - root)
    assert fsdp["reduce_scatter"] == 0.5 * total


def test_pipeline_transfers_are_counted(tiny_data):
    """Pipeline stages send through P2POp built on c10d's isend/irecv: a counter wrapping dist's names
    (as `CommCounter.patch` does) neither breaks the step nor misses a send."""
    raw = tiny_config(tiny_data, parallel={"pp": 2, "dp_replicate": 1, "dp_shard": 1})
    cfg = Config.from_dict(raw)
    micro_batches = cfg.train.global_batch // cfg.train.micro_batch
    activation = cfg.train.micro_batch * cfg.data.seq_len * cfg.model.d_model * 4
    tied = 4 * param_counts(cfg.model)["embedding"]  # the tied embedding's gradient, swapped by the two ends
    for sent in spawn(_count, 2, raw):
        # stage 0 sends each micro-batch's activations forward, stage 1 each input gradient back
        assert sent["send"] == micro_batches * activation + tied


def _gathers(raw):
    from torch.distributed.fsdp import FSDPModule

    from raydist.parallel.data_parallel import fsdp_param_groups
    from raydist.training.trainer import Trainer

    trainer = Trainer(Config.from_dict(raw), torch.device("cpu"))
    counter = CommCounter()
    trainer.train_step()
    with counter.patch(functional=False):
        trainer.train_step(trainer.next_batch())
    units = sum(len(fsdp_param_groups(m._get_fsdp_state())) for chunk in trainer.pm.modules
                for m in chunk.modules() if isinstance(m, FSDPModule))  # the units that hold parameters
    out = {"all_gather": counter.calls["all_gather"], "units": units, "layout": trainer.layout.describe()}
    trainer.close()
    return out


def test_fsdp_under_a_pipeline_gathers_each_unit_once_per_step(tiny_data):
    # pp 2 x dp_shard 2, 4 micro-batches of 1F1B: `auto` keeps each rank's FSDP units gathered from their
    # first forward to their last backward; resharding after forward (ZeRO-3) gathers the blocks again
    # for every micro-batch's forward and backward
    raw = tiny_config(tiny_data, train={"global_batch": 8, "micro_batch": 1},
                      parallel={"pp": 2, "dp_replicate": 1, "dp_shard": 2, "pp_schedule": "1f1b"})
    for rank in spawn(_gathers, 4, raw):
        assert rank["units"] >= 2 and rank["all_gather"] == rank["units"], rank
    raw["parallel"]["fsdp_reshard_after_forward"] = "true"
    for rank in spawn(_gathers, 4, raw):
        assert rank["all_gather"] > 4 * rank["units"], rank
