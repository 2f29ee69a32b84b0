"""Tensor (+ sequence) parallelism against the single-process run: TP 2, TP 2 + SP, TP 2 x FSDP 2 (with SP
and full recompute), TP 4 with fewer kv heads (2) than tp, and (marked slow) HSDP 2 x TP 2 with selective
recompute (gloo, fp32, 4 steps, losses within 1e-4 relative, gradients close, the same global gradient
norm, which clipping uses on every step); bad layouts rejected with the value named."""

import pytest

from raydist.config import Config, ConfigError
from raydist.parallel.mesh import MeshSpec
from raydist.planner.policy import plan_layout, resolve_layout
from raydist.testing import TWO_MICROBATCHES, assert_equivalent, run_layout, tiny_config

TRAIN = {"grad_clip": 1.0}  # below every step's norm: a wrong global norm changes the losses


@pytest.fixture(scope="module")
def single(tiny_data):
    [ref] = run_layout(tiny_config(tiny_data, train=TRAIN), 1)
    assert min(ref.grad_norms) > TRAIN["grad_clip"]  # clipping was active on every step
    return ref


def _assert_matches(single, ranks):
    for rank in ranks:
        assert_equivalent(single, rank)
        for step, (a, b) in enumerate(zip(single.grad_norms, rank.grad_norms)):
            assert abs(a - b) / a < 1e-4, f"step {step + 1}: grad norm {b} vs single-process {a}"
    # every parameter's full gradient came back under its unsharded name
    assert set(ranks[0].grads) == set(single.grads)


@pytest.mark.parametrize("parallel", [
    {"tp": 2, "dp_replicate": 1},
    {"tp": 2, "dp_replicate": 1, "sequence_parallel": True},
], ids=["tp2", "tp2-sp"])
def test_tp2_equals_single_process(tiny_data, single, parallel):
    raw = tiny_config(tiny_data, train={**TRAIN, **TWO_MICROBATCHES}, parallel=parallel)  # (no data parallelism)
    _assert_matches(single, run_layout(raw, 2))


@pytest.mark.parametrize("parallel, train", [
    ({"tp": 2, "dp_shard": 2, "dp_replicate": 1, "sequence_parallel": True}, {"activation_checkpoint": "full"}),
    ({"tp": 4, "dp_replicate": 1}, TWO_MICROBATCHES),
], ids=["tp2xfsdp2-sp-recompute", "tp4-kv2"])
def test_four_rank_layouts_equal_single_process(tiny_data, single, parallel, train):
    """tp4-kv2: the tiny model has 2 kv heads, so each is replicated on 2 of the 4 tp ranks."""
    _assert_matches(single, run_layout(tiny_config(tiny_data, train={**TRAIN, **train}, parallel=parallel), 4))


@pytest.mark.slow  # beyond the list: HSDP (replicas x FSDP2) over TP, the other composition
def test_hsdp_over_tp_equals_single_process(tiny_data, single):
    parallel = {"tp": 2, "dp_shard": 1, "dp_replicate": 2, "sequence_parallel": True}
    raw = tiny_config(tiny_data, train={**TRAIN, "activation_checkpoint": "selective"}, parallel=parallel)
    _assert_matches(single, run_layout(raw, 4))


# ---- bad input ---------------------------------------------------------------------------------------


def _check(model=None, tp=2, sequence_parallel=False, seq_len=32, cp=1, dp_shard=1):
    raw = tiny_config("unused", seq_len=seq_len, model=model or {},
                      parallel={"tp": tp, "cp": cp, "dp_shard": dp_shard, "dp_replicate": 1,
                                "sequence_parallel": sequence_parallel})
    cfg = Config.from_dict(raw)
    return resolve_layout(cfg, MeshSpec.from_config(cfg.parallel).resolve(tp * cp * dp_shard))


@pytest.mark.parametrize("model, tp, message", [
    ({"num_heads": 8, "num_kv_heads": 4, "d_model": 48}, 3, "parallel.tp=3 does not divide model.num_heads=8"),
    ({"ffn_hidden": 130}, 4, "parallel.tp=4 does not divide model.ffn_hidden=130"),
    ({"vocab_size": 321}, 2, "parallel.tp=2 does not divide model.vocab_size=321"),
    ({"num_heads": 12, "num_kv_heads": 4, "d_model": 96, "ffn_hidden": 192, "vocab_size": 324}, 6,
     "parallel.tp=6 and model.num_kv_heads=4"),
], ids=["heads", "ffn", "vocab", "kv-heads"])
def test_indivisible_dimensions_are_rejected(model, tp, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")) as error:
        _check(model, tp=tp)
    assert "pick tp from" in str(error.value) or "change" in str(error.value)


def test_kv_heads_fewer_than_tp_are_replicated_when_tp_is_a_multiple():
    _check({"num_heads": 8, "num_kv_heads": 2}, tp=4)  # accepted: 2 ranks share each kv head
    with pytest.raises(ConfigError, match=r"model\.num_kv_heads=4.*pick tp from \[1, 2, 4, 12\]"):
        _check({"num_heads": 12, "num_kv_heads": 4, "d_model": 96, "ffn_hidden": 192, "vocab_size": 324}, tp=6)


def test_sequence_parallel_needs_seq_len_divisible_by_tp():
    _check(tp=2, sequence_parallel=True, seq_len=30)
    _check(tp=4, sequence_parallel=False, seq_len=30)  # without SP the sequence is not split
    with pytest.raises(ConfigError, match=r"tp=4, which does not divide data\.seq_len=30;"):
        _check(tp=4, sequence_parallel=True, seq_len=30)
    with pytest.raises(ConfigError, match=r"tp=4, which does not divide data\.seq_len=36 / cp=2 = 18;"):
        _check(tp=4, cp=2, sequence_parallel=True, seq_len=36)


def test_driver_rejects_before_workers_start():
    raw = tiny_config("unused", parallel={"tp": 3, "dp_replicate": 1})
    with pytest.raises(ConfigError, match="parallel.tp=3 does not divide model.num_heads=4"):
        plan_layout(Config.from_dict(raw), 3)
