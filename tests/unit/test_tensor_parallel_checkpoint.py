"""Checkpoints cross between tensor-parallel and other layouts (keys and shapes are the unsharded model's):
an FSDP 2 checkpoint loads into TP 2 (+ SP) with the single-process logits, and a TP 2 checkpoint loads
into one process with the logits TP 2 computes from it."""

import pytest
import torch

from raydist.parallel.runtime import spawn
from raydist.testing import logits_after_load, run_fit, tiny_config

TOKENS = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(1))
CHECKPOINT = {"every_steps": 0, "async_save": False}


def _saved(tiny_data, tmp_path_factory, name: str, parallel: dict, world: int) -> str:
    run_dir = str(tmp_path_factory.mktemp(name) / "run")
    run_fit(tiny_config(tiny_data, train={"steps": 3}, parallel=parallel, checkpoint=CHECKPOINT), world, run_dir)
    return run_dir


@pytest.fixture(scope="module")
def fsdp2_checkpoint(tiny_data, tmp_path_factory):
    return _saved(tiny_data, tmp_path_factory, "fsdp2", {"dp_replicate": 1, "dp_shard": 2}, 2)


@pytest.fixture(scope="module")
def tp2_checkpoint(tiny_data, tmp_path_factory):
    return _saved(tiny_data, tmp_path_factory, "tp2", {"dp_replicate": 1, "tp": 2, "sequence_parallel": True}, 2)


@pytest.fixture(scope="module")
def fsdp2_single_logits(tiny_data, fsdp2_checkpoint):
    """The FSDP 2 checkpoint loaded into one process; it must differ from the untrained model's output."""
    single = spawn(logits_after_load, 1, tiny_config(tiny_data), fsdp2_checkpoint, TOKENS, 3)[0]
    untrained = spawn(logits_after_load, 1, tiny_config(tiny_data), None, TOKENS)[0]
    assert (single - untrained).abs().max() > 1e-3  # the load changed the weights
    return single


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    # the row-parallel layers add their partial products in another order: fp32 rounding only
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_fsdp_checkpoint_loads_into_tp(tiny_data, fsdp2_checkpoint, fsdp2_single_logits, sequence_parallel):
    parallel = {"dp_replicate": 1, "tp": 2, "sequence_parallel": sequence_parallel}
    for rank_logits in spawn(logits_after_load, 2, tiny_config(tiny_data, parallel=parallel), fsdp2_checkpoint,
                             TOKENS, 3):
        _close(rank_logits, fsdp2_single_logits)


def test_tp_checkpoint_loads_into_one_process(tiny_data, tp2_checkpoint, fsdp2_single_logits):
    parallel = {"dp_replicate": 1, "tp": 2, "sequence_parallel": True}
    tp = spawn(logits_after_load, 2, tiny_config(tiny_data, parallel=parallel), tp2_checkpoint, TOKENS, 3)
    single = spawn(logits_after_load, 1, tiny_config(tiny_data), tp2_checkpoint, TOKENS, 3)[0]
    for rank_logits in tp:
        _close(rank_logits, single)
    # the same 3 steps trained as FSDP 2: the TP checkpoint holds the same model, not a permuted one
    torch.testing.assert_close(single, fsdp2_single_logits, rtol=1e-3, atol=1e-3)
