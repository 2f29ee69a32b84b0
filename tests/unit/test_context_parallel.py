"""Context-parallel layouts against the single-process run (gloo, fp32, 4 steps, losses within 1e-4 relative,
full gradients close): ring cp 2 and 4 (causal, zig-zag), Ulysses cp 2, cp 2 x FSDP 2, cp 2 x TP 2; and the
layout errors for sequences or heads that do not split."""

import pytest

from raydist.config import Config, ConfigError
from raydist.kernels import runtime
from raydist.parallel.mesh import MeshSpec
from raydist.parallel.runtime import spawn
from raydist.planner.policy import resolve_layout
from raydist.testing import TWO_MICROBATCHES, assert_equivalent, run_layout, tiny_config


@pytest.fixture(scope="module")
def single(tiny_data):
    [ref] = run_layout(tiny_config(tiny_data), 1)
    return ref


@pytest.mark.parametrize("world,parallel", [
    (2, {"cp": 2, "cp_impl": "ring"}),
    (4, {"cp": 4, "cp_impl": "ring"}),
    (2, {"cp": 2, "cp_impl": "ulysses"}),
    (4, {"cp": 2, "dp_shard": 2, "cp_impl": "ring"}),
], ids=["ring-cp2", "ring-cp4", "ulysses-cp2", "ring-cp2-x-fsdp2"])
def test_context_parallel_equals_single_process(tiny_data, single, world, parallel):
    train = TWO_MICROBATCHES if world == parallel["cp"] else {}  # (no data parallelism: see TWO_MICROBATCHES)
    for rank in run_layout(tiny_config(tiny_data, parallel=parallel, train=train), world):
        assert_equivalent(single, rank)


def test_ring_with_selective_checkpointing_equals_single_process(tiny_data, single):
    # the recompute re-runs the ring (communication included) with some block outputs served from the cache
    raw = tiny_config(tiny_data, parallel={"cp": 2}, train={"activation_checkpoint": "selective", **TWO_MICROBATCHES})
    for rank in run_layout(raw, 2):
        assert_equivalent(single, rank)


def _run_counting_kernels(raw: dict, steps: int):
    from raydist.kernels import kernel_calls
    from raydist.testing import _run

    return _run(raw, steps, False, True), kernel_calls()


@pytest.mark.skipif(runtime.triton_import_error() is not None, reason="triton is not importable here")
def test_ring_on_triton_blocks_equals_single_process(tiny_data, monkeypatch):
    # kernels.attention=triton (interpreted on CPU): the ring runs Triton flash-attention blocks
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    small = {"global_batch": 4, "micro_batch": 4}
    kernels = {"attention": "triton", "matmul": "torch"}
    [(ref, _)] = spawn(_run_counting_kernels, 1, tiny_config(tiny_data, kernels=kernels, train=small), 2)
    raw = tiny_config(tiny_data, kernels=kernels, train=small, parallel={"cp": 2})
    for rank, calls in spawn(_run_counting_kernels, 2, raw, 2):
        assert_equivalent(ref, rank)
        # forward blocks (the backward's are not counted): 2 steps x 2 layers x 2 ring steps
        assert calls.get("attention.triton") == 2 * 2 * 2, calls


def test_ring_on_aten_blocks_at_head_dim_80_equals_single_process(tiny_data):
    # kernels.attention = sdpa (auto's choice) and a head dim the Triton kernel lacks: the ring runs torch's
    # fused blocks that return the log-sum-exp (the CPU's flash attention here; attention_blocks.py), and
    # equals one process
    small = {"global_batch": 4, "micro_batch": 4}
    model = {"d_model": 160, "num_heads": 2, "num_kv_heads": 1, "ffn_hidden": 256}
    kernels = {"attention": "sdpa", "matmul": "torch"}
    [(ref, _)] = spawn(_run_counting_kernels, 1, tiny_config(tiny_data, kernels=kernels, train=small, model=model), 2)
    raw = tiny_config(tiny_data, kernels=kernels, train=small, model=model, parallel={"cp": 2})
    for rank, calls in spawn(_run_counting_kernels, 2, raw, 2):
        assert_equivalent(ref, rank)
        assert calls.get("attention.aten") == 2 * 2 * 2, calls  # steps x layers x ring steps (forward)


def test_the_ring_keeps_flash_blocks_on_cuda_whatever_the_models_attention():
    # `kernels.attention = auto` is SDPA on CUDA, whose public call returns no log-sum-exp: the ring must still
    # run fused blocks there that return it: the Triton kernel where it takes the head dim, else torch's own
    # (memory-efficient attention; the CPU's flash attention). Looks at names only: no GPU.
    from raydist.kernels.attention import triton_causal_attention
    from raydist.models.gpt import sdpa_attention
    from raydist.parallel.context import ring_backend_for

    assert ring_backend_for(sdpa_attention, "cuda", 128) == "triton"
    assert ring_backend_for(sdpa_attention, "cuda", 80) == "aten"  # a head dim the kernel lacks
    assert ring_backend_for(sdpa_attention, "cpu", 64) == "aten"
    assert ring_backend_for(triton_causal_attention, "cpu", 64) == "triton"  # asked for, interpreted


@pytest.mark.parametrize("impl,sequence_parallel", [("ring", False), ("ulysses", False), ("ring", True)],
                         ids=["ring", "ulysses", "ring-sp"])
def test_context_parallel_with_tensor_parallel_equals_single_process(tiny_data, single, impl, sequence_parallel):
    # tp=2 leaves 2 query heads and 1 kv head per rank: Ulysses splits the 2 query heads over cp=2 and repeats
    # the kv head; ring attention passes the local kv head around the ring. With SP the T/cp local tokens
    # are split once more over tp outside attention.
    raw = tiny_config(tiny_data, parallel={"cp": 2, "tp": 2, "cp_impl": impl, "sequence_parallel": sequence_parallel},
                      train=TWO_MICROBATCHES)
    for rank in run_layout(raw, 4):
        assert_equivalent(single, rank)


def _config(tiny_data, seq_len=32, **parallel):
    raw = tiny_config(tiny_data, seq_len=seq_len, parallel=parallel)
    return Config.from_dict(raw)


def test_ring_rejects_a_sequence_not_divisible_by_twice_cp(tiny_data):
    cfg = _config(tiny_data, seq_len=36, cp=4, cp_impl="ring")
    with pytest.raises(ConfigError, match=r"data\.seq_len=36 is not divisible by 2 x parallel\.cp = 8.*multiple of 8"):
        resolve_layout(cfg, MeshSpec(cp=4))
    resolve_layout(_config(tiny_data, seq_len=36, cp=2, cp_impl="ring"), MeshSpec(cp=2))  # 36 = 9 x (2 x 2)


def test_ulysses_rejects_heads_not_divisible_by_cp(tiny_data):
    cfg = _config(tiny_data, cp=8, cp_impl="ulysses")  # 4 query heads
    with pytest.raises(ConfigError, match=r"parallel\.cp=8 does not divide the query heads per rank "
                                          r"\(model\.num_heads=4 / tp=1 = 4\)"):
        resolve_layout(cfg, MeshSpec(cp=8))
    cfg = _config(tiny_data, seq_len=30, cp=4, cp_impl="ulysses")
    with pytest.raises(ConfigError, match=r"data\.seq_len=30 is not divisible by parallel\.cp=4"):
        resolve_layout(cfg, MeshSpec(cp=4))
    # 2 kv heads over cp=4 are repeated (to 4), not an error; ring needs no head split at all
    resolve_layout(_config(tiny_data, cp=4, cp_impl="ulysses"), MeshSpec(cp=4))
    resolve_layout(_config(tiny_data, cp=8, cp_impl="ring"), MeshSpec(cp=8))


def test_launcher_reports_the_layout_error_before_any_worker_starts(tiny_data):
    from raydist.driver.launcher import plan

    raw = tiny_config(tiny_data, parallel={"cp": 3, "cp_impl": "ring"}, ray={"num_workers": 3})
    with pytest.raises(ConfigError, match=r"data\.seq_len=32 is not divisible by 2 x parallel\.cp = 6"):
        plan(Config.from_dict(raw), log=lambda *_: None)
