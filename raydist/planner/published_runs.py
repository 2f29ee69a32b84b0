"""Published training runs with their measured throughput, and what the cost model predicts for each.

The planner's step times are only worth budgeting with if they hold against runs someone measured. Each row
below is one published run in bf16 (no Float8, no torch.compile: the cost model prices neither), with its
exact setup and its source; `raydist plan --published table` (and `all`) prints the prediction beside it:

    error = predicted tokens/s per GPU / published - 1   (= predicted MFU / published MFU - 1)

MFU here is PaLM's (Chowdhery et al. 2022, Appendix B): model FLOPs per token (6 N_matmul + 12 L H E T,
raydist.models.gpt.flops_per_token, the same count torchtitan's `get_num_flop_per_token` makes) times tokens/s
per GPU over the device's dense bf16 peak. Rows that publish tokens/s are converted with that count; rows
that publish MFU are taken as published.

What a row's layout cannot say, the row says: torchtitan's "selective" checkpointing is per-op (it saves the
outputs of every other matmul and recomputes the rest and every elementwise op), not raydist's selective
policy (elementwise ops only), so those rows set `op_sac` and are priced with torchtitan's policy
(`torchtitan_op_sac_share`); the Llama 3 paper gives neither its recompute policy nor its chunks per rank,
so those rows take the best of the open choices, as `published.published_options` does.

Sources:
- [torchtitan-h100] torchtitan, docs/performance.md, benchmarks of December 2024 (torch 1963fc8, torchtitan
  9dec370): Llama 3.1 8B, Tables 1 and 3, plain FSDP rows. Grand Teton hosts: 8 H100 (96 GB HBM2e, 2.4 TB/s,
  500 W power limit) per host on NVLink, 400 Gb/s RDMA per GPU; throughput read at step 90.
- [torchtitan-405b] torchtitan, docs/performance.md (Llama 3.1 405B on 128 H100, FSDP 16 x TP 8, local batch
  2, full AC, no Float8): 109 tokens/s per GPU.
- [torchtitan-a100] torchtitan, docs/performance.md (Llama 3 8B and 70B, Llama 2 13B and 70B on 64 A100 80GB
  with FSDP2).
- [llama3] Llama Team 2024, "The Llama 3 Herd of Models", Table 4: 405B on 8,192 and 16,384 H100 at
  sequence 8192, and on 16,384 with CP 16 at 131,072; BF16 MFU 43%, 41%, 38%.
- [korthikanti] Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  Tables 3 and 5: 22B, 175B, 530B and 1T on A100 80GB with sequence parallelism and selective recompute,
  MFU 41.5%, 51.4%, 56.0%, 56.3%.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

from raydist.config import ModelConfig
from raydist.models.gpt import flops_per_token
from raydist.planner.cost_model import Estimate, complete, estimate, layout_problems
from raydist.planner.hardware import Hardware, get_hardware
from raydist.planner.placement import Layout, Workload
from raydist.planner.published import LLAMA3_405B, MEGATRON_1T

MEDIAN_BOUND, BOUND = 0.15, 0.30  # the median |error| over the table, and every row's (but KNOWN_MISSES')
# Rows the cost model misses by more than BOUND today, each with the |error| it may not exceed and why it
# misses; a row here that comes within BOUND fails the check too (take it out: the list stays what is true).
KNOWN_MISSES: dict[str, tuple[float, str]] = {}  # key -> (its bound, why it misses); none today


@dataclass(frozen=True)
class PublishedRun:
    key: str
    title: str
    source: str  # a key of the module docstring's source list, with the table
    workload: Workload
    layout: Layout
    device: str  # a row of raydist.planner.hardware.DEVICES
    world_size: int
    tokens_per_s_per_gpu: float | None = None  # what the source measured: one of these two
    mfu: float | None = None
    gpus_per_node: int = 8
    variants: dict = field(default_factory=dict)  # Layout field -> values the source leaves open
    notes: str = ""
    op_sac: bool = False  # torchtitan's per-op selective recompute (priced as itself, not as the layout's)

    def hardware(self) -> Hardware:
        return get_hardware(self.device, self.world_size, self.gpus_per_node)

    def published_mfu(self) -> float:
        if self.mfu is not None:
            return self.mfu
        w = self.workload
        return self.tokens_per_s_per_gpu * flops_per_token(w.model, w.seq_len) / self.hardware().peak_flops

    def problems(self) -> list[str]:
        """Why the row's layout cannot run its workload (empty: it can), and a world that does not match."""
        out = layout_problems(self.workload, self.layout)
        if self.layout.world_size != self.world_size:
            out.append(f"the layout has {self.layout.world_size} ranks, the run {self.world_size}")
        return out


def _llama(layers, d, heads, kv, ffn, vocab) -> ModelConfig:
    return ModelConfig(num_layers=layers, d_model=d, num_heads=heads, num_kv_heads=kv, ffn_hidden=ffn,
                       vocab_size=vocab, tie_embeddings=False)


def _megatron(layers, d, heads) -> ModelConfig:
    """Korthikanti et al.'s GPT as raydist's Llama-style block (published.py's MEGATRON_1T explains the
    mapping): a SwiGLU MLP of the GPT MLP's parameter count, multi-head attention, vocabulary 51200, tied."""
    return replace(MEGATRON_1T.workload.model, num_layers=layers, d_model=d, num_heads=heads, num_kv_heads=heads,
                   ffn_hidden=(8 * d // 3) // 8 * 8)


LLAMA3_8B = _llama(32, 4096, 32, 8, 14336, 128256)
LLAMA3_70B = _llama(80, 8192, 64, 8, 28672, 128256)
LLAMA2_13B = _llama(40, 5120, 40, 40, 13824, 32000)
LLAMA2_70B = _llama(80, 8192, 64, 8, 28672, 32000)
LLAMA3_405B_MODEL = LLAMA3_405B.workload.model


def _mesh(**degrees) -> Layout:
    return Layout.of(**{"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, **degrees})


def _w(model: ModelConfig, seq: int, batch: int, name: str) -> Workload:
    return Workload(model, seq_len=seq, global_batch=batch, compute_dtype_bytes=2, name=name)


TT_SELECTIVE = ("torchtitan's selective AC is per-op: it saves the outputs of the matmuls, attention and the "
                "reduce-scatters but recomputes every second matmul of each block and every elementwise op; "
                "priced as that (torchtitan_op_sac_share), its memory as raydist's selective")


def torchtitan_op_sac_share(m: ModelConfig) -> float:
    """The share of a block's forward matmul FLOPs that torchtitan's per-op selective recompute re-runs.

    Its policy (torchtitan/models/llama/parallelize_llama.py, `_apply_ac_to_transformer_block`, Dec. 2024)
    counts the block's `aten.mm` calls in forward and saves every one but the 2nd, 4th, 6th...: in the call
    order query, key, value and output projections, then the MLP's gate, up and down (`down(silu(gate(x)) *
    up(x))`), that recomputes the key, output and up projections: 0.365 of the matmul FLOPs at Llama 3 8B's
    shape."""
    q, kv = m.num_heads * m.head_size, m.num_kv_heads * m.head_size
    d, f = m.d_model, m.ffn_hidden
    calls = (d * q, d * kv, d * kv, q * d, d * f, d * f, f * d)
    return sum(calls[1::2]) / sum(calls)


LLAMA3_OPEN = {"activation_checkpoint": ("none", "selective", "full", "every_k"), "virtual_stages": (2, 4)}
LLAMA3_NOTE = ("the paper's FSDP keeps parameters gathered after forward (fsdp_reshard_after_forward off); its "
               "recompute policy and chunks per rank are not given: the best fitting of them is priced")

RUNS: tuple[PublishedRun, ...] = (
    PublishedRun("tt-llama3.1-8b-8xh100", "Llama 3.1 8B, 8 H100, FSDP 8, local batch 2", "torchtitan-h100",
                 _w(LLAMA3_8B, 8192, 16, "llama3.1-8b"),
                 _mesh(dp_shard=8, micro_batch=2, activation_checkpoint="selective"), "h100-hbm2e", 8,
                 tokens_per_s_per_gpu=5762, notes=TT_SELECTIVE, op_sac=True),
    PublishedRun("tt-llama3.1-8b-128xh100", "Llama 3.1 8B, 128 H100, FSDP 128, local batch 2", "torchtitan-h100",
                 _w(LLAMA3_8B, 8192, 256, "llama3.1-8b"),
                 _mesh(dp_shard=128, micro_batch=2, activation_checkpoint="selective"), "h100-hbm2e", 128,
                 tokens_per_s_per_gpu=5605, notes=TT_SELECTIVE, op_sac=True),
    PublishedRun("tt-llama3.1-405b-128xh100", "Llama 3.1 405B, 128 H100, FSDP 16 x TP 8, local batch 2, full AC",
                 "torchtitan-405b", _w(LLAMA3_405B_MODEL, 8192, 32, "llama3.1-405b"),
                 _mesh(dp_shard=16, tp=8, sequence_parallel=True, micro_batch=2, activation_checkpoint="full"),
                 "h100-hbm2e", 128, tokens_per_s_per_gpu=109),
    PublishedRun("tt-llama3-8b-64xa100", "Llama 3 8B, 64 A100, FSDP 64, local batch 1, selective op AC",
                 "torchtitan-a100", _w(LLAMA3_8B, 8192, 64, "llama3-8b"),
                 _mesh(dp_shard=64, micro_batch=1, activation_checkpoint="selective"), "a100", 64,
                 tokens_per_s_per_gpu=2973, notes=TT_SELECTIVE, op_sac=True),
    PublishedRun("tt-llama3-70b-64xa100", "Llama 3 70B, 64 A100, FSDP 64, local batch 1, full AC",
                 "torchtitan-a100", _w(LLAMA3_70B, 8192, 64, "llama3-70b"),
                 _mesh(dp_shard=64, micro_batch=1, activation_checkpoint="full"), "a100", 64,
                 tokens_per_s_per_gpu=331),
    PublishedRun("tt-llama2-13b-64xa100", "Llama 2 13B, 64 A100, FSDP 64, local batch 2, no AC",
                 "torchtitan-a100", _w(LLAMA2_13B, 4096, 128, "llama2-13b"),
                 _mesh(dp_shard=64, micro_batch=2), "a100", 64, tokens_per_s_per_gpu=2162),
    PublishedRun("tt-llama2-70b-64xa100", "Llama 2 70B, 64 A100, FSDP 64, local batch 2, full AC",
                 "torchtitan-a100", _w(LLAMA2_70B, 4096, 128, "llama2-70b"),
                 _mesh(dp_shard=64, micro_batch=2, activation_checkpoint="full"), "a100", 64,
                 tokens_per_s_per_gpu=353),
    PublishedRun("llama3-405b-8k-8192xh100", "Llama 3 405B, 8,192 H100, TP8 CP1 PP16 DP64, seq 8192", "llama3",
                 _w(LLAMA3_405B_MODEL, 8192, 2048, "llama3-405b"),
                 LLAMA3_405B.layout.replace(dp_shard=64), "h100", 8192, mfu=0.43, variants=LLAMA3_OPEN,
                 notes=LLAMA3_NOTE),
    PublishedRun("llama3-405b-8k-16384xh100", "Llama 3 405B, 16,384 H100, TP8 CP1 PP16 DP128, seq 8192", "llama3",
                 LLAMA3_405B.workload, LLAMA3_405B.layout, "h100", 16384, mfu=0.41, variants=LLAMA3_OPEN,
                 notes=LLAMA3_NOTE),
    PublishedRun("llama3-405b-128k-16384xh100", "Llama 3 405B, 16,384 H100, TP8 CP16 PP16 DP8, seq 131072",
                 "llama3", _w(LLAMA3_405B_MODEL, 131072, 128, "llama3-405b-128k"),
                 LLAMA3_405B.layout.replace(dp_shard=8, cp=16), "h100", 16384, mfu=0.38, variants=LLAMA3_OPEN,
                 notes=LLAMA3_NOTE),
    *(PublishedRun(f"megatron-{name}", f"Megatron GPT {name.upper()}, {gpus} A100, TP8 PP{pp}, SP + selective",
                   "korthikanti", _w(model, 2048, gpus, f"megatron-{name}"),
                   _mesh(tp=8, pp=pp, micro_batch=1, sequence_parallel=True, activation_checkpoint="selective",
                         pp_schedule="1f1b"),
                   "a100", gpus, mfu=mfu)
      for name, model, pp, gpus, mfu in (("22b", _megatron(48, 6144, 64), 1, 8, 0.415),
                                         ("175b", _megatron(96, 12288, 96), 8, 64, 0.514),
                                         ("530b", _megatron(105, 20480, 128), 35, 280, 0.560),
                                         ("1t", MEGATRON_1T.workload.model, 64, 512, 0.563))),
)


@dataclass(frozen=True)
class Prediction:
    run: PublishedRun
    estimate: Estimate
    published_mfu: float

    @property
    def predicted_mfu(self) -> float:
        return self.estimate.mfu

    @property
    def error(self) -> float:
        return self.predicted_mfu / self.published_mfu - 1

    def tokens_per_s_per_gpu(self) -> tuple[float, float]:
        """(predicted, published)."""
        w, hw = self.run.workload, self.run.hardware()
        per_flop = hw.peak_flops / flops_per_token(w.model, w.seq_len)
        return self.predicted_mfu * per_flop, self.published_mfu * per_flop

    def to_dict(self) -> dict:
        predicted, published = self.tokens_per_s_per_gpu()
        return {"key": self.run.key, "title": self.run.title, "source": self.run.source,
                "device": self.run.device, "gpus": self.run.world_size, "layout": self.estimate.layout.describe(),
                "published_mfu": round(self.published_mfu, 4), "predicted_mfu": round(self.predicted_mfu, 4),
                "published_tokens_per_s_per_gpu": round(published, 1),
                "predicted_tokens_per_s_per_gpu": round(predicted, 1), "error": round(self.error, 4),
                "notes": self.run.notes}


def predict(run: PublishedRun) -> Prediction:
    """The cost model's estimate of the run's own layout; with open choices, the fastest that fits (else the
    fastest)."""
    hw = run.hardware()
    per_op = torchtitan_op_sac_share(run.workload.model) if run.op_sac else None
    options = [estimate(run.workload, complete(run.workload, lay), hw, per_op_recompute=per_op)
               for lay in variant_layouts(run) if not layout_problems(run.workload, lay)]
    best = min(options, key=lambda e: (not e.fits, e.step_time_s))
    return Prediction(run, best, run.published_mfu())


def variant_layouts(run: PublishedRun) -> list[Layout]:
    """The run's layout with every combination of the choices its source leaves open, not yet completed: a
    stage partition completed before the variants kept 2 chunks per rank's under 4, and those were dropped."""
    layouts = [run.layout]
    for key, values in run.variants.items():
        layouts = [lay.replace(**{key: value}) for lay in layouts for value in values]
    return layouts


def predict_all(runs=RUNS) -> list[Prediction]:
    return [predict(run) for run in runs]


def summary(predictions: list[Prediction]) -> dict:
    errors = [abs(p.error) for p in predictions]
    return {"runs": len(errors), "median_abs_error": statistics.median(errors), "max_abs_error": max(errors),
            "worst": max(predictions, key=lambda p: abs(p.error)).run.key, "bound": BOUND}


def check(predictions: list[Prediction]) -> list[str]:
    """What is wrong with the predictions against the published runs (empty: they hold): a median |error|
    above MEDIAN_BOUND, a row off by more than BOUND (or a known miss by more than its own bound), a known miss
    that now holds."""
    problems = []
    s = summary(predictions)
    if s["median_abs_error"] > MEDIAN_BOUND:
        problems.append(f"median |error| {s['median_abs_error']:.1%} over {s['runs']} published runs exceeds "
                        f"{MEDIAN_BOUND:.0%}")
    for p in predictions:
        key, err = p.run.key, abs(p.error)
        bound, why = KNOWN_MISSES.get(key, (BOUND, ""))
        if err > bound:
            problems.append(f"{key}: predicted MFU {p.predicted_mfu:.1%} against the published {p.published_mfu:.1%} "
                            f"({p.error:+.1%}) is off by more than {bound:.0%}")
        elif why and err <= BOUND:
            problems.append(f"{key}: now within {BOUND:.0%} ({p.error:+.1%}); take it out of KNOWN_MISSES")
    return problems


def format_table(predictions: list[Prediction]) -> str:
    lines = [f"{'published run':58s} {'device':11s} {'MFU pub':>8s} {'pred':>7s} {'tok/s/GPU pub':>14s} "
             f"{'pred':>9s} {'error':>7s}"]
    for p in predictions:
        predicted, published = p.tokens_per_s_per_gpu()
        lines.append(f"{p.run.title[:58]:58s} {p.run.device:11s} {p.published_mfu:8.1%} {p.predicted_mfu:7.1%} "
                     f"{published:14,.0f} {predicted:9,.0f} {p.error:+7.1%}")
    s = summary(predictions)
    lines.append(f"{s['runs']} runs: median |error| {s['median_abs_error']:.1%}, worst {s['max_abs_error']:.1%} "
                 f"({s['worst']}); sources and setups: raydist/planner/published_runs.py")
    for key, (_, why) in KNOWN_MISSES.items():
        lines.append(f"  known miss, {key}: {why}")
    lines.extend(f"  error: {problem}" for problem in check(predictions))
    return "\n".join(lines)
