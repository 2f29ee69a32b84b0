"""Mesh layouts against the single-process run: DDP 4, FSDP 4, HSDP 2x2, FSDP x each checkpoint policy
(4 gloo ranks, fp32, 10 steps, losses within 1e-4 relative, gradients close), and clipping by the true
global norm under FSDP."""


import pytest

from raydist.testing import assert_equivalent, run_layout, tiny_config

MODEL = {"num_layers": 4}


@pytest.mark.parametrize("layout", [
    {"dp_replicate": 4, "dp_shard": 1},
    {"dp_replicate": 1, "dp_shard": 4},
    {"dp_replicate": 2, "dp_shard": 2},
], ids=["ddp4", "fsdp4", "hsdp2x2"])
def test_layout_equals_single_process(tiny_data, single_4_layers, layout):
    for rank in run_layout(tiny_config(tiny_data, model=MODEL, parallel=layout), 4):
        assert_equivalent(single_4_layers, rank)


@pytest.mark.parametrize("policy", ["full", "every_k", "selective"])
def test_fsdp_with_activation_checkpointing_equals_single_process(tiny_data, single_4_layers, policy):
    raw = tiny_config(tiny_data, model=MODEL, parallel={"dp_shard": 4}, train={"activation_checkpoint": policy})
    for rank in run_layout(raw, 4):
        assert_equivalent(single_4_layers, rank)


def test_fsdp_clips_by_the_global_norm(tiny_data):
    clip = {"grad_clip": 0.05}
    [ref] = run_layout(tiny_config(tiny_data, model=MODEL, train=clip), 1, steps=3)
    fsdp = run_layout(tiny_config(tiny_data, model=MODEL, train=clip, parallel={"dp_shard": 4}), 4, steps=3)
    assert min(ref.grad_norms) > 0.05  # clipping was active on every step
    for rank in fsdp:
        for a, b in zip(ref.grad_norms, rank.grad_norms):
            assert abs(a - b) / a < 1e-4
        assert all(abs(clipped - 0.05) < 1e-5 for clipped in rank.clipped_norms), rank.clipped_norms
        assert_equivalent(ref, rank)


@pytest.mark.parametrize("layout, world", [({"dp_shard": 2}, 2), ({"pp": 2, "dp_shard": 2}, 4)],
                         ids=["fsdp2", "pp2xfsdp2"])
def test_untied_embedding_and_head_units_equal_single_process(tiny_data, layout, world):
    """An untied embedding and output head are FSDP units of their own (raydist.parallel.fsdp)."""
    model = {**MODEL, "tie_embeddings": False}
    [ref] = run_layout(tiny_config(tiny_data, model=model), 1, steps=4)
    for rank in run_layout(tiny_config(tiny_data, model=model, parallel=layout), world, steps=4):
        assert_equivalent(ref, rank)


def test_fsdp_param_groups_reads_either_torch_layout():
    """FSDP2's private state: a list `_fsdp_param_groups` (torch 2.13, None when empty) or one
    `_fsdp_param_group` (torch 2.11, None when empty); a fresh state of this torch has no group."""
    import types

    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    from raydist.parallel.data_parallel import fsdp_param_groups

    assert fsdp_param_groups(types.SimpleNamespace(_fsdp_param_groups=["a", "b"])) == ["a", "b"]
    assert fsdp_param_groups(types.SimpleNamespace(_fsdp_param_groups=None)) == []
    assert fsdp_param_groups(types.SimpleNamespace(_fsdp_param_group="a")) == ["a"]
    assert fsdp_param_groups(types.SimpleNamespace(_fsdp_param_group=None)) == []
    assert fsdp_param_groups(FSDPState()) == []
