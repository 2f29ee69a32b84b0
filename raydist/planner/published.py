"""Published training layouts, run through the cost model next to the planner's own best.

- Llama 3 405B (Llama Team 2024, "The Llama 3 Herd of Models", Tables 3 and 4): 126 layers, d_model 16384, 128
  heads, 8 KV heads, FFN 53248, vocabulary 128256; 16,384 H100s at sequence length 8192 with TP 8, CP 1, PP
  16, DP 128 and 16M tokens per batch (2048 sequences, 16 per DP group, micro-batch 1). The paper's DP is FSDP
  sharding optimizer state and gradients but not resharding parameters after forward (ZeRO-2-like); raydist
  models FSDP2 (ZeRO-3), so the layout is taken as dp_shard=128 with fsdp_reshard_after_forward=false, the
  closest thing this model has. The paper uses interleaved 1F1B; its tables give neither its recompute policy
  nor its chunks per rank, so the best fitting combination of those (recompute none/selective/full/every_k, 2
  or 4 chunks) is reported for that mesh.
- Megatron 1T (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", its
  table of model configurations): 128 layers, hidden 25600, 160 heads, TP 8, PP 64, 512 A100 80GB, global
  batch 512, micro-batch 1, sequence 2048, selective recompute + sequence parallel. raydist's block is
  Llama-style (SwiGLU, RMSNorm), so the GPT MLP (2 matrices of h x 4h) is replaced by a SwiGLU MLP of the same
  parameter count (ffn_hidden = 68264, 8h/3 rounded down to a multiple of tp), multi-head attention (160 KV
  heads), vocabulary 51200, tied embeddings; DP = 512 / (8 * 64) = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from raydist.config import ModelConfig
from raydist.planner.cost_model import Estimate, estimate
from raydist.planner.enumerate import enumerate_estimates
from raydist.planner.hardware import get_hardware
from raydist.planner.placement import Layout, Workload


@dataclass(frozen=True)
class Published:
    key: str
    title: str
    workload: Workload
    layout: Layout
    device: str
    world_size: int
    gpus_per_node: int
    variants: dict  # Layout field -> values the paper leaves open; the best fitting combination is reported


LLAMA3_405B = Published(
    key="llama3-405b",
    title="Llama 3 405B, 16,384 H100, seq 8192 (TP8 CP1 PP16 DP128)",
    workload=Workload(ModelConfig(num_layers=126, d_model=16384, num_heads=128, num_kv_heads=8,
                                  ffn_hidden=53248, vocab_size=128256, tie_embeddings=False),
                      seq_len=8192, global_batch=2048, compute_dtype_bytes=2, name="llama3-405b"),
    layout=Layout.of(pp=16, dp_replicate=1, dp_shard=128, cp=1, tp=8, micro_batch=1, sequence_parallel=True,
                     pp_schedule="interleaved", virtual_stages=2, fsdp_reshard_after_forward=False),
    device="h100", world_size=16384, gpus_per_node=8,
    variants={"activation_checkpoint": ("none", "selective", "full", "every_k"), "virtual_stages": (2, 4)},
)

MEGATRON_1T = Published(
    key="megatron-1t",
    title="Megatron 1T, 512 A100 80GB, seq 2048 (TP8 PP64, selective recompute + SP)",
    workload=Workload(ModelConfig(num_layers=128, d_model=25600, num_heads=160, num_kv_heads=160,
                                  ffn_hidden=68264, vocab_size=51200, tie_embeddings=True),
                      seq_len=2048, global_batch=512, compute_dtype_bytes=2, name="megatron-1t"),
    layout=Layout.of(pp=64, dp_replicate=1, dp_shard=1, cp=1, tp=8, micro_batch=1, sequence_parallel=True,
                     activation_checkpoint="selective", pp_schedule="1f1b"),
    device="a100", world_size=512, gpus_per_node=8,
    variants={"activation_checkpoint": ("none", "selective", "full", "every_k")},
)

PUBLISHED = {p.key: p for p in (LLAMA3_405B, MEGATRON_1T)}


def published_estimate(pub: Published) -> Estimate:
    """The published mesh under the model, with the best of its allowed recompute policies."""
    return min(published_options(pub), key=lambda e: (not e.fits, e.step_time_s))


def published_options(pub: Published) -> list[Estimate]:
    """The published mesh with every combination of the knobs the paper leaves open (or that raydist
    implements differently), estimated."""
    hw = get_hardware(pub.device, pub.world_size, pub.gpus_per_node)
    layouts = [pub.layout]
    for key, values in pub.variants.items():
        layouts = [lay.replace(**{key: value}) for lay in layouts for value in values]
    return [estimate(pub.workload, lay, hw) for lay in layouts]


def compare(pub: Published, top: int = 3) -> dict:
    """{'published': Estimate, 'best': [Estimate...], 'counts': ...} for one published configuration."""
    hw = get_hardware(pub.device, pub.world_size, pub.gpus_per_node)
    mine = published_estimate(pub)
    fits, counts = enumerate_estimates(pub.workload, pub.world_size, hw)
    return {"published": mine, "best": fits[:top], "counts": counts, "hardware": hw}


def megatron_accounting(pub: Published) -> float:
    """Cross-check with Megatron-LM's own accounting (Korthikanti et al. 2022): 18 bytes per parameter
    (fp16 weights, fp32 gradients, fp32 master, Adam) on the first stage, plus 34 s b h / t activation bytes
    per layer (sequence parallel + selective recompute) for the L layers' worth that 1F1B's first stage
    holds (p in-flight micro-batches x L/p layers), times (1 + (p-1)/(p v)) when interleaved."""
    from raydist.planner.memory import stage_elements

    w, lay = pub.workload, pub.layout
    params = stage_elements(w, lay, 0)
    v = lay.virtual_stages
    factor = 1 + (lay.pp - 1) / (lay.pp * v) if v > 1 else 1.0
    acts = 34 * w.seq_len * lay.micro_batch * w.model.d_model / lay.tp * w.model.num_layers * factor
    return 18.0 * params + acts


def format_comparison(pub: Published, result: dict) -> str:
    mine: Estimate = result["published"]
    lines = [pub.title,
             f"  published  {mine.layout.describe():50s} {mine.memory_gb:7.1f} GB  "
             f"step {mine.step_time_s:8.3f} s  MFU {mine.mfu:6.1%}  {'fits' if mine.fits else 'DOES NOT FIT'}"]
    for i, est in enumerate(result["best"], 1):
        lines.append(f"  planner #{i} {est.layout.describe():50s} {est.memory_gb:7.1f} GB  "
                     f"step {est.step_time_s:8.3f} s  MFU {est.mfu:6.1%}")
    lines.append(f"  cross-check, Megatron-LM accounting (18 B/param + 34 s b h / t per layer): "
                 f"{megatron_accounting(pub) / 1e9:.1f} GB for the published mesh")
    c = result["counts"]
    lines.append(f"  searched {c['considered']} layouts: {c['fit']} fit, {c['too_big']} too big, "
                 f"{c['invalid']} invalid")
    for reason in mine.reasons:
        lines.append(f"  published: {reason}")
    if result["best"]:
        for reason in result["best"][0].reasons:
            lines.append(f"  planner #1: {reason}")
    return "\n".join(lines)
