"""The planner: the published formulas, the search, published layouts, choose_layout, the CLI, calibration."""

from __future__ import annotations

import json
import math

import pytest

from raydist.cli import main
from raydist.config import Config, ConfigError, ModelConfig
from raydist.models.gpt import param_counts
from raydist.planner.cost_model import estimate, layout_problems
from raydist.planner.enumerate import choose_layout, enumerate_estimates
from raydist.planner.hardware import DEVICES, Hardware, Link, get_hardware
from raydist.planner.memory import rank_memory
from raydist.planner.placement import Layout, Workload
from raydist.planner.timing import all_gather_s, all_reduce_s, bubble_fraction, fsdp_gathers_per_step, step_time

GPT_TINY = "workloads/gpt_tiny.toml"


def _workload(**model) -> Workload:
    cfg = dict(num_layers=8, d_model=1024, num_heads=16, num_kv_heads=8, ffn_hidden=2816, vocab_size=32000)
    cfg.update(model)
    return Workload(ModelConfig(**cfg), seq_len=2048, global_batch=64, compute_dtype_bytes=2, loss="plain")


# ---- the published formulas ---------------------------------------------------------------------


def test_fsdp_gathers_per_step_are_the_runtimes():
    # (tests/unit/test_comm_volume.py counts the runtime's: one per unit and step under 1F1B, kept gathered)
    assert fsdp_gathers_per_step(Layout.of(dp_shard=2), 4) == 8  # ZeRO-3: forward and backward, each micro-batch
    assert fsdp_gathers_per_step(Layout.of(dp_shard=2, fsdp_reshard_after_forward=False), 4) == 4
    kept = dict(dp_shard=2, pp=2, fsdp_reshard_after_forward=False)
    assert fsdp_gathers_per_step(Layout.of(**kept, pp_schedule="1f1b"), 4) == 1
    assert fsdp_gathers_per_step(Layout.of(**kept, pp_schedule="zbh1"), 4) == 4  # the split backward reshards


def test_the_h100_estimate_holds_against_the_gpu_suites_measured_run():
    # The GPU check suite trained a Llama-3-8B-shaped stack of 4 blocks on one H100 (bf16, T = 8192, batch
    # 1, flash SDPA and cuBLAS) and measured its step; the planner prices the same run from the measured
    # kernel rates and the memory-bound bytes (planner/hardware.py, timing.py). The datasheet model it
    # replaced (every FLOP at 75% of peak, nothing memory-bound but the optimizer) is kept as the plant.
    import dataclasses
    from pathlib import Path

    from raydist.config import ModelConfig

    suite = json.loads((Path(__file__).parents[2] / "benchmarks/results/gpu_suite_h100.json").read_text())
    [run] = [r for r in suite["benchmarks"]["mfu"]["rows"]
             if (r["kernels_selected"]["attention"], r["kernels_selected"]["matmul"]) == ("sdpa", "torch")]
    model = ModelConfig(num_layers=run["layers"], d_model=run["d_model"], num_heads=run["heads"],
                        num_kv_heads=run["kv_heads"], ffn_hidden=run["ffn"], vocab_size=run["vocab"],
                        tie_embeddings=False)  # (benchmarks/mfu.py: Llama 3's untied head)
    assert param_counts(model)["total"] == run["params"]
    w = Workload(model, seq_len=run["seq_len"], global_batch=run["batch"], compute_dtype_bytes=2)
    lay = Layout(micro_batch=run["batch"], activation_checkpoint="none")
    hw = get_hardware("h100", 1)

    def error(hardware) -> float:
        return abs(estimate(w, lay, hardware).step_time_s - run["step_s"]) / run["step_s"]

    assert error(hw) < 0.1, (estimate(w, lay, hw).step_time_s, run["step_s"])
    datasheet = dataclasses.replace(hw, compute_efficiency=0.75, attention_efficiency=(), elementwise=False)
    assert error(datasheet) > 0.2


def test_eager_elementwise_work_is_priced_kernel_by_kernel(monkeypatch):
    # The same measured run, with the blocks' memory-bound bytes halved (about what one read and one write
    # per fused op counts, the model before eager PyTorch's kernels were counted one by one): 13% fast.
    from raydist.planner import timing

    whole = timing.elementwise_bytes
    monkeypatch.setattr(timing, "elementwise_bytes", lambda w, lay, tokens: (whole(w, lay, tokens)[0] / 2,
                                                                              whole(w, lay, tokens)[1]))
    with pytest.raises(AssertionError, match="0.1"):
        test_the_h100_estimate_holds_against_the_gpu_suites_measured_run()


def test_bubble_fractions_follow_the_published_formulas():
    assert bubble_fraction(Layout.of(pp=4, pp_schedule="1f1b"), 4) == pytest.approx(3 / 7)  # (p-1)/(m+p-1)
    assert bubble_fraction(Layout.of(pp=4, pp_schedule="gpipe"), 12) == pytest.approx(3 / 15)
    assert bubble_fraction(Layout.of(pp=4, pp_schedule="interleaved", virtual_stages=2), 4) == pytest.approx(3 / 11)
    assert bubble_fraction(Layout.of(pp=1), 8) == 0.0


def test_alpha_beta_collectives():
    link = Link(alpha_s=1e-5, beta_bytes_per_s=1e9)
    assert all_reduce_s(1e9, 8, link) == pytest.approx(3e-5 + 2 * 7 / 8)  # alpha log p + 2 (p-1)/p n / beta
    assert all_gather_s(1e9, 8, link) == pytest.approx(3e-5 + 7 / 8)
    assert all_reduce_s(1e9, 1, link) == 0.0


def test_fsdp_moves_three_times_the_parameters_and_ddp_two():
    """Rajbhandari et al. 2020 (ZeRO-3): FSDP all-gathers (fwd, bwd) and reduce-scatters: ~3x parameter bytes
    per step; a ring all-reduce of the gradients is ~2x (Patarasuk & Yuan 2009). In fp32 with one micro-batch
    and no latency, 3/2."""
    hw = Hardware("t", 1e15, 1e12, 1e12, Link(0.0, 1e9), Link(0.0, 1e9), gpus_per_node=8, compute_dtype_bytes=4)
    w = Workload(_workload().model, 2048, global_batch=8, compute_dtype_bytes=4)
    ddp = step_time(w, Layout.of(dp_replicate=8, micro_batch=1), hw, 1)["dp_comm"]
    fsdp = step_time(w, Layout.of(dp_shard=8, micro_batch=1), hw, 1)["dp_comm"]
    assert fsdp / ddp == pytest.approx(1.5, rel=1e-6)


def test_memory_falls_with_sharding_and_recompute():
    w = _workload()
    base = rank_memory(w, Layout.of(dp_replicate=8, micro_batch=4), 2)
    fsdp = rank_memory(w, Layout.of(dp_shard=8, micro_batch=4), 2)
    assert fsdp["optimizer"] == pytest.approx(base["optimizer"] / 8, rel=0.01)  # 16N/p (ZeRO)
    mem = {p: rank_memory(w, Layout.of(dp_replicate=8, micro_batch=4, activation_checkpoint=p), 2)
           for p in ("none", "selective", "every_k", "full")}
    assert mem["none"]["activations"] > mem["selective"]["activations"] > mem["full"]["activations"]
    # sqrt(L) rule (Chen et al. 2016): every_k keeps ceil(8/3) segment inputs instead of 8 block inputs, and
    # re-materialises 3 blocks at a time instead of 1
    assert mem["every_k"]["activations"] < mem["full"]["activations"]
    assert mem["every_k"]["transient"] >= mem["full"]["transient"]
    tp = rank_memory(w, Layout.of(dp_replicate=4, tp=2, micro_batch=4, sequence_parallel=True), 2)
    assert tp["params"] < 0.6 * base["params"]


def test_pipeline_first_stage_holds_p_microbatches():
    w = _workload()
    one = rank_memory(w, Layout.of(pp=4, dp_replicate=2, micro_batch=1), 16)["activations"]
    gpipe = rank_memory(w, Layout.of(pp=4, dp_replicate=2, micro_batch=1, pp_schedule="gpipe"), 16)["activations"]
    assert gpipe > 3 * one  # GPipe keeps all 16 micro-batches, 1F1B at most p = 4


def test_zero_bubble_schedules_are_priced_and_searched():
    """The planner's bubble is the schedule's exact one at F = B = W (3/11 -> 1/9 -> 1/17 at p 4, m 8),
    ZB-H1 keeps 1F1B's first-stage activations on every stage, ZB-V puts the head on rank 0, and the
    search offers zbh1, zbv and pipelines with context parallelism."""
    from raydist.planner.placement import rank_layer_counts
    from raydist.planner.memory import in_flight_microbatches, root_tensors

    shape = dict(pp=4, dp_replicate=2, micro_batch=1)
    bubbles = [bubble_fraction(Layout.of(**shape, pp_schedule=k), 8) for k in ("1f1b", "zbh1", "zbv")]
    assert bubbles == pytest.approx([3 / 11, 1 / 9, 1 / 17])
    w = _workload()
    zbh1, zbv = Layout.of(**shape, pp_schedule="zbh1"), Layout.of(**shape, pp_schedule="zbv")
    assert [in_flight_microbatches(zbh1, 8, r) for r in range(4)] == [4] * 4
    assert [in_flight_microbatches(Layout.of(**shape), 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert rank_layer_counts(w, zbv) == [2] * 4 and zbv.stages_of(0) == [0, 7]
    assert len(root_tensors(w, zbv, 0)) == 3 and root_tensors(w, zbv, 3) == []  # embedding, norm, head copy
    faster = step_time(w, zbh1, DEVICES["h100"], 8)
    assert faster["bubble"] < step_time(w, Layout.of(**shape), DEVICES["h100"], 8)["bubble"]
    fits, _ = enumerate_estimates(w, 16, DEVICES["h100"], policies=("none",))
    seen = {e.layout.pp_schedule for e in fits if e.layout.pp > 1}
    assert {"zbh1", "zbv"} <= seen
    assert any(e.layout.pp > 1 and e.layout.cp > 1 for e in fits)


def first_problem(w: Workload, lay: Layout) -> str | None:
    problems = layout_problems(w, lay)
    return problems[0] if problems else None


def test_check_layout_names_the_problem():
    w = _workload()
    assert "tp=3 does not divide model.num_heads=16" in first_problem(w, Layout.of(tp=3, dp_replicate=1))
    assert first_problem(w, Layout.of(pp=4, dp_replicate=2, micro_batch=8)) is None  # 4 micro-batches
    # fewer micro-batches than stages: a large bubble, but the runtime runs it (and so the planner prices it)
    assert first_problem(w, Layout.of(pp=4, dp_replicate=2, micro_batch=16)) is None
    assert "interleaved 1F1B needs the micro-batch count (2) to be a multiple of parallel.pp=4" in \
        first_problem(w, Layout.of(pp=4, dp_replicate=2, micro_batch=16, pp_schedule="interleaved", virtual_stages=2))
    assert "global_batch=64" in first_problem(w, Layout.of(dp_replicate=3))


# ---- the search ------------------------------------------------------------------------------------


def test_search_returns_valid_fitting_plans_best_first():
    w = _workload()
    hw = DEVICES["h100"]
    fits, counts = enumerate_estimates(w, 16, hw)
    assert fits and counts["fit"] == len(fits)
    assert [e.step_time_s for e in fits] == sorted(e.step_time_s for e in fits)
    for est in fits[:50]:
        assert est.layout.world_size == 16
        assert first_problem(w, est.layout) is None
        assert est.fits and est.memory["total"] <= hw.usable_memory_bytes
        assert 0 < est.mfu < 1
    assert any(e.layout.tp > 1 for e in fits) and any(e.layout.pp > 1 for e in fits)


def test_search_drops_layouts_that_do_not_fit():
    """A 7B-class model cannot hold 16N bytes on one 80 GB device: every plan shards it."""
    w = Workload(ModelConfig(num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, ffn_hidden=14336,
                             vocab_size=128256, tie_embeddings=False), 4096, 64, 2)
    fits, counts = enumerate_estimates(w, 8, DEVICES["h100"], features={"tp", "pp"})
    assert counts["too_big"] > 0 and fits
    assert all(e.layout.data_parallel_kind != "ddp" or e.layout.tp * e.layout.pp > 1 for e in fits)


def test_implemented_only_excludes_missing_parallelisms():
    w = _workload()
    fits, _ = enumerate_estimates(w, 8, DEVICES["h100"], features=frozenset())
    assert fits and all(e.layout.tp == e.layout.pp == e.layout.cp == 1 for e in fits)


# ---- published configurations -----------------------------------------------------------------------


@pytest.mark.parametrize("key", ["llama3-405b", "megatron-1t"])
def test_published_layouts_are_valid_layouts_of_their_world_size(key):
    from raydist.planner.published import PUBLISHED

    pub = PUBLISHED[key]
    assert pub.layout.world_size == pub.world_size
    assert layout_problems(pub.workload, pub.layout) == []


def test_the_published_llama3_405b_layout_fits_and_the_planner_is_at_least_as_good():
    """(megatron-1t's comparison goes through the CLI: test_cli_published_json; one search per published run)"""
    from raydist.planner.published import PUBLISHED, compare, format_comparison

    pub = PUBLISHED["llama3-405b"]
    result = compare(pub, top=3)
    print(format_comparison(pub, result))
    published, best = result["published"], result["best"]
    assert published.fits, published.reasons
    assert best and best[0].fits
    assert best[0].step_time_s <= published.step_time_s
    assert best[0].mfu >= published.mfu


def test_published_parameter_counts():
    from raydist.models.gpt import param_counts
    from raydist.planner.published import LLAMA3_405B, MEGATRON_1T

    assert param_counts(LLAMA3_405B.workload.model)["total"] == pytest.approx(405e9, rel=0.02)
    assert param_counts(MEGATRON_1T.workload.model)["total"] == pytest.approx(1.0e12, rel=0.02)


# ---- choose_layout ---------------------------------------------------------------------------------------


def test_choose_layout_gives_a_config_that_validates(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYDIST_CACHE", str(tmp_path))  # no calibration: datasheet-free CPU guesses
    cfg = Config.load(GPT_TINY)
    layout, estimate = choose_layout(cfg, 4, device="cpu")
    assert layout.world_size == 4
    assert layout.global_batch == cfg.train.global_batch  # micro-batch x micro-batches x dp
    assert layout_problems(Workload.from_config(cfg, 4), layout) == []  # the runtime's validator accepts it
    assert estimate["fits"] and estimate["mesh"] == layout.degrees()
    assert estimate["settings"]["activation_checkpoint"] == layout.activation_checkpoint
    layout_h100, _ = choose_layout(cfg, 8, gpus_per_node=8, device="h100")
    assert layout_h100.world_size == 8


def test_choose_layout_raises_when_nothing_fits():
    cfg = Config.load(GPT_TINY, ["model.num_layers=126", "model.d_model=16384", "model.num_heads=128",
                                 "model.num_kv_heads=8", "model.ffn_hidden=53248", "data.seq_len=8192"])
    with pytest.raises(ConfigError, match="no layout"):
        choose_layout(cfg, 2, device="h100")


# ---- CLI -------------------------------------------------------------------------------------------------


def test_cli_json_best_first(capsys):
    assert main(["plan", GPT_TINY, "--world", "8", "--device", "h100", "--json", "--top", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    plans = out["plans"]
    assert len(plans) == 4
    for p in plans:
        assert set(p["mesh"]) == {"pp", "dp_replicate", "dp_shard", "cp", "tp"}
        assert math.prod(p["mesh"].values()) == 8
        assert p["memory_gb"] > 0 and p["step_time_s"] > 0 and 0 < p["mfu"] < 1
    assert [p["step_time_s"] for p in plans] == sorted(p["step_time_s"] for p in plans)


def test_cli_table_and_errors(capsys):
    assert main(["plan", GPT_TINY, "--world", "4", "--device", "a100", "--top", "2"]) == 0
    text = capsys.readouterr().out
    assert "MFU" in text and ("largest overhead" in text or "compute-bound" in text)
    assert main(["plan", GPT_TINY, "--world", "0"]) == 2
    assert "error: --world=0" in capsys.readouterr().err
    assert main(["plan", GPT_TINY, "--world", "4", "--device", "tpu"]) == 2
    assert "tpu" in capsys.readouterr().err


# ---- calibration -------------------------------------------------------------------------------------------


def test_fit_alpha_beta_recovers_known_link():
    from raydist.planner.calibrate import fit_alpha_beta

    alpha, beta, p = 50e-6, 2e9, 4
    samples = [{"bytes": n, "all_reduce_s": alpha * 2 + 2 * 3 / 4 * n / beta,
                "all_gather_s": alpha * 2 + 3 / 4 * n / beta} for n in (1e3, 1e5, 1e6, 1e7)]
    got_alpha, got_beta = fit_alpha_beta(samples, p)
    assert got_alpha == pytest.approx(alpha, rel=1e-6) and got_beta == pytest.approx(beta, rel=1e-6)


def test_calibrate_stores_and_cpu_plans_use_it(tmp_path, monkeypatch):
    from raydist.planner.calibrate import calibrate

    monkeypatch.setenv("RAYDIST_CACHE", str(tmp_path))
    record = calibrate(2, reps=3)
    assert (tmp_path / "calibration.json").is_file()
    assert record["alpha_s"] > 0 and record["beta_bytes_per_s"] > 0 and record["matmul_peak_flops"] > 1e8
    hw = get_hardware("cpu", 2)
    assert hw.source.startswith("calibrated")
    assert hw.peak_flops == pytest.approx(record["matmul_peak_flops"])
    assert hw.intra.alpha_s == pytest.approx(record["alpha_s"])


def test_a_measured_tensor_parallel_ratio_prices_the_split_on_cpu():
    """`--calibrate` times the model split over tp ranks against one rank's whole model (tp_factors). Where
    that ratio says more than the analytic split plus its collectives (on CPU: DTensor dispatch, the norms
    and loss every rank repeats), a tp layout's step is the measured ratio times the unsplit compute; other
    layouts, and tp layouts without a measured ratio, are priced as before."""
    from dataclasses import replace

    hw = Hardware("cpu", 1e11, 1e10, 1e10, Link(1e-4, 1e9), Link(1e-4, 1e9), gpus_per_node=2, compute_efficiency=0.5,
                  comm_overlap=0.0, compute_dtype_bytes=4, block_overhead_s=1e-3)
    w = Workload(_workload().model, 512, global_batch=8, compute_dtype_bytes=4)
    tp2 = Layout.of(tp=2, micro_batch=4)
    plain = step_time(w, tp2, hw, 2)
    measured = step_time(w, tp2, replace(hw, tp_factors={"2": 3.0}), 2)
    whole = step_time(w, Layout.of(micro_batch=4), hw, 2)  # one rank, the whole model: the ratio's denominator
    assert measured["compute"] == pytest.approx(plain["compute"])
    assert measured["tp_comm"] == pytest.approx(3.0 * whole["compute"] - plain["compute"], rel=1e-9)
    assert measured["total"] > plain["total"]
    # a ratio below the analytic cost never prices the split faster than its collectives
    assert step_time(w, tp2, replace(hw, tp_factors={"2": 0.1}), 2)["tp_comm"] == pytest.approx(plain["tp_comm"])
    # another degree's ratio, and a layout without tp, are left alone
    assert step_time(w, tp2, replace(hw, tp_factors={"4": 3.0}), 2) == plain
    dp2 = Layout.of(dp_replicate=2, micro_batch=4)
    assert step_time(w, dp2, replace(hw, tp_factors={"2": 3.0}), 1) == step_time(w, dp2, hw, 1)


def test_cli_published_json(capsys):
    assert main(["plan", "--published", "megatron-1t", "--json", "--top", "2"]) == 0
    out = json.loads(capsys.readouterr().out)["megatron-1t"]
    assert out["published"]["mesh"] == {"pp": 64, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 8}
    assert out["published"]["fits"]
    assert out["best"][0]["fits"] and out["best"][0]["step_time_s"] <= out["published"]["step_time_s"]
    assert out["best"][0]["mfu"] >= out["published"]["mfu"]  # the planner is at least as good
    assert 60 < out["megatron_accounting_gb"] < 80  # Korthikanti's own count fits an 80 GB A100


# ---- parameter-efficient fine-tuning -----------------------------------------------------------------------

# (memory bytes, step seconds) of full training on H100s, as the planner priced them before it knew PEFT
# (main at f60bbac; the step seconds re-pinned when eager elementwise kernels, NCCL's NVLink rate and FSDP's
# unhidden first gather and last reduction were priced, and tp2_sp_full when every TP rank was charged its
# autocast casts over the whole width): pricing LoRA and freeze must leave
# peft.method = "none" exactly where it was.
FULL_TRAINING = {
    "ddp8": (dict(dp_replicate=8, micro_batch=4), 8069236736.0, 0.05244818404228882),
    "fsdp8_nosync": (dict(dp_shard=8, micro_batch=2), 3836669952.0, 0.049638720743140116),
    "hsdp2x4_selective": (dict(dp_replicate=2, dp_shard=4, micro_batch=2, activation_checkpoint="selective"),
                          3318970368.0, 0.051661956216204424),
    "tp2_sp_full": (dict(dp_replicate=4, tp=2, sequence_parallel=True, micro_batch=4, activation_checkpoint="full"),
                    2589640704.0, 0.07985004556778218),
    "pp4_interleaved": (dict(pp=4, dp_replicate=2, micro_batch=1, pp_schedule="interleaved", virtual_stages=2),
                        2169841664.0, 0.08790477947593822),
    "cp2_ring_every_k": (dict(cp=2, dp_shard=4, micro_batch=1, activation_checkpoint="every_k"),
                         1288843264.0, 0.06304566376621225),
}


@pytest.mark.parametrize("name", sorted(FULL_TRAINING))
def test_full_training_estimates_are_unchanged(name):
    import dataclasses

    from raydist.config import PeftConfig
    from raydist.planner.cost_model import complete

    shape, memory_bytes, step_s = FULL_TRAINING[name]
    w = _workload()
    est = estimate(w, complete(w, Layout.of(**shape)), DEVICES["h100"])
    assert (est.memory["total"], est.step_time_s) == (pytest.approx(memory_bytes, rel=1e-12),
                                                      pytest.approx(step_s, rel=1e-12))
    # the LoRA and freeze keys mean nothing while the method is none
    ignored = dataclasses.replace(w, peft=PeftConfig(lora_rank=64, lora_targets="all", trainable_last_layers=2))
    again = estimate(ignored, complete(w, Layout.of(**shape)), DEVICES["h100"])
    assert (again.memory, again.time) == (est.memory, est.time)


def _adapters_per_block(m: ModelConfig, r: int) -> int:
    """r (in + out) for each of wq, wk, wv, wo, w1, w3, w2 (peft.lora_targets = "all"), from the shape."""
    q, kv, h, f = m.num_heads * m.head_size, m.num_kv_heads * m.head_size, m.d_model, m.ffn_hidden
    return r * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + f) + (f + h))


# fp32, no latency, nothing memory-bound priced but the optimizer: the terms below are FLOPs and bytes alone
FLAT = Hardware("t", 1e15, 1e12, 1e12, Link(0.0, 1e9), Link(0.0, 1e9), gpus_per_node=8, compute_dtype_bytes=4)


def test_lora_skips_frozen_weight_gradients_and_reduces_only_the_adapters():
    import dataclasses

    from raydist.config import PeftConfig
    from raydist.models.gpt import param_counts

    m = _workload(tie_embeddings=False).model
    full = Workload(m, 2048, global_batch=8, compute_dtype_bytes=4)
    lora = dataclasses.replace(full, peft=PeftConfig(method="lora", lora_rank=16, lora_targets="all"))
    adapters = m.num_layers * _adapters_per_block(m, 16)
    counts, tokens, rate = param_counts(m), 2048, FLAT.peak_flops * FLAT.compute_efficiency
    ddp = Layout.of(dp_replicate=8, micro_batch=1)
    t_full, t_lora = step_time(full, ddp, FLAT, 1), step_time(lora, ddp, FLAT, 1)
    # no weight-gradient GEMM for the frozen blocks' and head's weights (2 FLOPs per element and token);
    # the adapters' forward, input-gradient and weight-gradient GEMMs (6)
    saved = m.num_layers * 2 * counts["block_matmul"] + 2 * m.vocab_size * m.d_model - 6 * adapters
    assert t_lora["compute"] == pytest.approx(t_full["compute"] - tokens * saved / rate, rel=1e-9)
    assert 0.6 < t_lora["compute"] / t_full["compute"] < 0.8  # a third of the matmuls gone, not of attention
    # DDP all-reduces the adapters' fp32 gradients alone (2 (p-1)/p x 4 N / beta); AdamW reads 36 B each
    assert t_lora["dp_comm"] == pytest.approx(2 * 7 / 8 * 4 * adapters / 1e9, rel=1e-9)
    assert t_lora["optimizer"] == pytest.approx(36 * adapters / 1e12, rel=1e-9)
    # FSDP all-gathers every held weight (adapters too), twice (resharding after forward), and
    # reduce-scatters the adapters' gradients
    fsdp = Layout.of(dp_shard=8, micro_batch=1)
    held = counts["total"] + adapters
    assert step_time(lora, fsdp, FLAT, 1)["dp_comm"] == pytest.approx(7 / 8 * (2 * 4 * held + 4 * adapters) / 1e9,
                                                                      rel=1e-9)
    assert t_lora["model_flops"] < t_full["model_flops"] and 0 < estimate(lora, ddp, FLAT).mfu < 1


def test_freeze_runs_the_frozen_blocks_forward_only():
    import dataclasses

    from raydist.config import PeftConfig
    from raydist.models.gpt import param_counts

    m = _workload(tie_embeddings=False).model
    full = Workload(m, 2048, global_batch=8, compute_dtype_bytes=4)
    lay = Layout.of(dp_replicate=8, micro_batch=1)

    def frozen(k: int) -> Workload:
        return dataclasses.replace(full, peft=PeftConfig(method="freeze", trainable_last_layers=k))

    # a block's forward + backward, from full training with one block more
    one_more = Workload(ModelConfig(**{**m.__dict__, "num_layers": m.num_layers + 1}), 2048, 8, 4)
    block_s = step_time(one_more, lay, FLAT, 1)["compute"] - step_time(full, lay, FLAT, 1)["compute"]
    everything = step_time(frozen(m.num_layers), lay, FLAT, 1)
    assert everything["compute"] == pytest.approx(step_time(full, lay, FLAT, 1)["compute"], rel=1e-12)
    k = 2
    t = step_time(frozen(k), lay, FLAT, 1)
    assert t["compute"] == pytest.approx(everything["compute"] - (m.num_layers - k) * 2 / 3 * block_s, rel=1e-9)
    # DDP reduces the k blocks, the final norm and the untied head
    trained = k * param_counts(m)["per_block"] + m.d_model + m.vocab_size * m.d_model
    assert t["dp_comm"] == pytest.approx(2 * 7 / 8 * 4 * trained / 1e9, rel=1e-9)
    # and only the trained blocks keep activations: one block's worth per trained block, all of them at k = L
    acts = {n: rank_memory(frozen(n), lay, 1)["activations"] for n in (1, 2, m.num_layers)}
    assert acts[m.num_layers] == rank_memory(full, lay, 1)["activations"]
    assert acts[m.num_layers] - acts[1] == pytest.approx((m.num_layers - 1) * (acts[2] - acts[1]), rel=1e-12)
