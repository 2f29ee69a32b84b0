"""Qwen3 and Qwen2.5 trained from a `save_pretrained` directory (`model.init_from = "hf:DIR"`) in parallel
layouts equal the single process: losses and gradient norms every step, gradients and parameters after the
last (raydist.testing.assert_equivalent). Qwen3's per-head q/k norms under tensor parallelism (sharded kv
heads at tp 2, replicated ones at tp 4) and Qwen2's q/k/v biases (column-sharded) are the new paths."""

from __future__ import annotations

import pytest

from raydist.testing import TWO_MICROBATCHES, assert_equivalent, run_layout, save_tiny_hf, tiny_config


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """Qwen3 untied with heads of 32 (q is 128 wide on a 64-wide model) and Qwen2 tied."""
    qwen3, qwen2 = tmp_path_factory.mktemp("qwen3"), tmp_path_factory.mktemp("qwen2")
    save_tiny_hf(qwen3, family="qwen3", tied=False, seed=4, head_dim=32)
    save_tiny_hf(qwen2, family="qwen2", tied=True, seed=5)
    return {"qwen3": str(qwen3), "qwen2": str(qwen2)}


_REFERENCES: dict = {}


def config(tiny_data, family_dirs, family: str, **parallel) -> dict:
    # model keys come from config.json; the order-one weights of save_tiny_hf want a gentler step; a layout
    # without data parallelism runs two micro-batches a step (TWO_MICROBATCHES)
    train = {"lr": 1e-3, **(TWO_MICROBATCHES if parallel and not parallel.get("dp_shard") else {})}
    return tiny_config(tiny_data, model={"init_from": f"hf:{family_dirs[family]}"}, train=train,
                       parallel={"dp_replicate": 1, **parallel})


def reference(tiny_data, family_dirs, family: str):
    if family not in _REFERENCES:
        [_REFERENCES[family]] = run_layout(config(tiny_data, family_dirs, family), 1)
    return _REFERENCES[family]


@pytest.mark.parametrize("family, parallel, world", [
    ("qwen3", {"dp_shard": 2}, 2),
    ("qwen3", {"tp": 2, "sequence_parallel": True}, 2),
    ("qwen3", {"tp": 4}, 4),
    ("qwen3", {"pp": 2}, 2),
    ("qwen3", {"cp": 2, "cp_impl": "ring"}, 2),
    ("qwen3", {"cp": 2, "cp_impl": "ulysses"}, 2),
    ("qwen3", {"pp": 2, "tp": 2, "sequence_parallel": True}, 4),
    ("qwen2", {"tp": 2, "sequence_parallel": True}, 2),
    ("qwen2", {"dp_shard": 2}, 2),
], ids=["qwen3-fsdp2", "qwen3-tp2-sp", "qwen3-tp4-replicated-kv", "qwen3-pp2", "qwen3-cp2-ring", "qwen3-cp2-ulysses",
        "qwen3-pp2xtp2-sp", "qwen2-tp2-sp", "qwen2-fsdp2"])
def test_family_layout_equals_single_process(tiny_data, family_dirs, family, parallel, world):
    ref = reference(tiny_data, family_dirs, family)
    extra = {n for n in ref.grads if n.endswith(".bias") or "_norm.weight" in n and ".attention." in n}
    assert extra, "the family's own parameters (q/k norms, biases) are in the model and get gradients"
    held = set()
    for rank in run_layout(config(tiny_data, family_dirs, family, **parallel), world):
        assert_equivalent(ref, rank)
        held |= set(rank.grads)
    assert held == set(ref.grads)
