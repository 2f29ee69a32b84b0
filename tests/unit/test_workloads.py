"""The Llama 3 and Qwen3 workloads (workloads/llama3_*.toml, qwen3_8b*.toml): the published shapes, a layout
that validates on CPU for the workload's world size, a model that builds on the meta device without allocating
weights, and a planner memory estimate that fits an 80 GB H100."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest
import torch

from raydist.config import Config
from raydist.models.gpt import GPT, param_counts
from raydist.planner.cost_model import estimate
from raydist.planner.hardware import get_hardware
from raydist.planner.placement import Workload
from raydist.planner.policy import plan_layout

ROOT = Path(__file__).resolve().parents[2]
# Dubey et al., "The Llama 3 Herd of Models" (2024), Table 3; the vocabulary as released (128K + 256 special).
PUBLISHED = {
    "llama3_8b": dict(num_layers=32, d_model=4096, num_heads=32, ffn_hidden=14336, params=8.03e9, world=8),
    "llama3_70b": dict(num_layers=80, d_model=8192, num_heads=64, ffn_hidden=28672, params=70.6e9, world=64),
    "llama3_405b": dict(num_layers=126, d_model=16384, num_heads=128, ffn_hidden=53248, params=405.9e9, world=1024),
}
# Qwen3 8B as released (Qwen/Qwen3-8B config.json; "Qwen3 Technical Report", 2025: 8.2 B, 6.95 B non-embedding)
QWEN3 = {name: dict(num_layers=36, d_model=4096, num_heads=32, num_kv_heads=8, head_dim=128, ffn_hidden=12288,
                    vocab_size=151936, rope_theta=1e6, tie_embeddings=False, family="qwen3")
         for name in ("qwen3_8b", "qwen3_8b_lora")}
# Mixtures of experts as released: total and active (per token) parameters. Qwen/Qwen3-30B-A3B ("Qwen3 Technical
# Report", 2025: 30.5 B, 3.3 B activated) and mistralai/Mixtral-8x7B-v0.1 (Jiang et al. 2024: 46.7 B, 12.9 B active)
MOE = {"qwen3_30b_a3b": dict(shape=dict(family="qwen3_moe", num_layers=48, d_model=2048, num_heads=32, num_kv_heads=4,
                                        head_dim=128, vocab_size=151936, moe_experts=128, moe_top_k=8,
                                        moe_ffn_hidden=768, moe_norm_topk=True, tie_embeddings=False),
                             params=30.5e9, active=3.3e9, world=32),
       "mixtral_8x7b": dict(shape=dict(family="mixtral", num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8,
                                       ffn_hidden=14336, vocab_size=32000, moe_experts=8, moe_top_k=2,
                                       tie_embeddings=False),
                            params=46.7e9, active=12.9e9, world=64)}
WORLDS = {**{name: want["world"] for name, want in PUBLISHED.items()}, "qwen3_8b": 8, "qwen3_8b_lora": 8,
          **{name: want["world"] for name, want in MOE.items()}}
H100_BYTES = 80e9


def load(name: str) -> Config:
    return Config.load(ROOT / "workloads" / f"{name}.toml")


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_shape(name):
    cfg, want = load(name), PUBLISHED[name]
    m = cfg.model
    assert (m.num_layers, m.d_model, m.num_heads, m.ffn_hidden) == (want["num_layers"], want["d_model"],
                                                                    want["num_heads"], want["ffn_hidden"])
    assert (m.num_kv_heads, m.vocab_size, m.rope_theta, m.tie_embeddings) == (8, 128256, 500000.0, False)
    assert cfg.data.seq_len == 8192
    assert abs(param_counts(m)["total"] - want["params"]) / want["params"] < 0.005


@pytest.mark.parametrize("name", sorted(QWEN3))
def test_qwen3_published_shape(name):
    m = load(name).model
    assert {k: getattr(m, k) for k in QWEN3[name]} == QWEN3[name]
    counts = param_counts(m)
    assert abs(counts["total"] - 8.19e9) / 8.19e9 < 0.005
    assert abs(counts["total"] - counts["embedding"] - counts["head"] - 6.95e9) / 6.95e9 < 0.005


@pytest.mark.parametrize("name", sorted(MOE))
def test_moe_published_shape_and_active_parameters(name):
    m, want = load(name).model, MOE[name]
    assert {k: getattr(m, k) for k in want["shape"]} == want["shape"]
    counts = param_counts(m)
    active = counts["embedding"] + counts["head"] + m.num_layers * counts["block_matmul"]  # norms aside
    assert abs(counts["total"] - want["params"]) / want["params"] < 0.01
    assert abs(active - want["active"]) / want["active"] < 0.02


@pytest.mark.parametrize("name", sorted(WORLDS))
def test_layout_validates_for_its_world_size(name):
    cfg = load(name)
    world = cfg.ray.num_workers
    assert world == WORLDS[name] and cfg.ray.use_gpu == "true"
    # raises ConfigError naming the problem when raydist.parallel.layout.validate refuses
    layout = plan_layout(cfg, world)
    assert layout.world_size == world  # every GPU has a place in the mesh, none idle
    assert layout.global_batch == cfg.train.global_batch


@pytest.mark.parametrize("name", sorted(WORLDS))
def test_planner_estimate_fits_an_h100(name):
    cfg = load(name)
    world = cfg.ray.num_workers
    hw = get_hardware("h100", world, 8)
    est = estimate(Workload.from_config(cfg, hw.compute_dtype_bytes), plan_layout(cfg, world), hw)
    assert est.memory["total"] < H100_BYTES, est.memory
    assert est.fits, f"{est.memory_gb:.1f} GB of {est.memory_limit_bytes / 1e9:.1f} GB usable"


@pytest.mark.parametrize("name", sorted(WORLDS))
def test_model_builds_on_the_meta_device_without_weights(name):
    cfg = load(name)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    with torch.device("meta"):
        model = GPT(cfg.model, cfg.data.seq_len)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    tensors = [*model.parameters(), *model.buffers()]
    assert all(t.is_meta for t in tensors)
    n = sum(p.numel() for p in model.parameters())
    assert n == param_counts(cfg.model)["total"]
    assert grown < 0.01 * 4 * n  # far below the fp32 weights (32 GB for 8B): nothing was allocated


def test_plan_cli_says_the_configured_layout_fits(capsys):
    from raydist.cli import main

    assert main(["plan", "workloads/llama3_8b.toml", "--world", "8", "--device", "h100", "--json", "--top", "1"]) == 0
    configured = json.loads(capsys.readouterr().out)["configured"]
    assert configured["fits"] and configured["memory_gb"] < 80
    assert configured["mesh"]["dp_shard"] == 8
