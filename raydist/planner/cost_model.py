"""One layout's estimate: does it fit, how long is a step, what MFU, and which term dominates.

`estimate(workload, layout, hardware)` combines memory.py (per-rank bytes) and timing.py (per-step
seconds). MFU = model FLOPs per rank per step / (step time * device peak), as Chowdhery et al. 2022 (PaLM,
Appendix B) define it: the model's own FLOPs against the device's peak, so recompute and communication
count against it).

`layout_problems` says why a layout cannot run a workload: the batch does not split, or the runtime's own
validator (`raydist.parallel.layout.validate`, and for peft.method freeze `raydist.models.peft.check_pipeline_stages`)
refuses it, so the planner and the runtime accept the same layouts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from raydist.errors import ConfigError
from raydist.models.peft import check_pipeline_stages
from raydist.parallel.layout import stage_partition, validate
from raydist.planner.hardware import Hardware
from raydist.planner.memory import rank_memory
from raydist.planner.placement import Layout, Workload
from raydist.planner.timing import step_time
from raydist.schedule.batch import BatchPlan, splits
from raydist.schedule.registry import SCHEDULE_KINDS

TIME_TERMS = {
    "recompute": "activation recompute",
    "bubble": "pipeline bubble",
    "tp_comm": "tensor-parallel collectives",
    "cp_comm": "context-parallel K/V exchange",
    "pp_comm": "pipeline sends",
    "dp_comm_exposed": "data-parallel gradient/parameter traffic not hidden by compute",
    "optimizer": "optimizer step (memory-bound)",
}


@dataclass
class Estimate:
    layout: Layout
    num_microbatches: int
    memory: dict[str, float]  # bytes by term, 'total'
    time: dict[str, float]  # seconds by term, 'total'
    mfu: float
    fits: bool
    memory_limit_bytes: float

    @functools.cached_property
    def reasons(self) -> list[str]:
        """`explain`'s lines, made when first read: a search estimates ~10^5 layouts and shows a few."""
        return explain(self)

    @property
    def memory_gb(self) -> float:
        return self.memory["total"] / 1e9

    @property
    def step_time_s(self) -> float:
        return self.time["total"]

    def to_dict(self) -> dict:
        return {
            "mesh": self.layout.mesh(),
            "layout": self.layout.describe(),
            "settings": {k: v for k, v in self.layout.to_dict().items() if k not in self.layout.mesh()},
            "num_microbatches": self.num_microbatches,
            "memory_gb": round(self.memory_gb, 4),
            "step_time_s": float(f"{self.step_time_s:.6g}"),
            "mfu": round(self.mfu, 4),
            "fits": self.fits,
            "memory_breakdown_gb": {k: round(v / 1e9, 4) for k, v in self.memory.items()},
            "time_breakdown_s": {k: float(f"{v:.4g}") for k, v in self.time.items() if k != "model_flops"},
            "reasons": self.reasons,
        }


def num_microbatches(w: Workload, lay: Layout) -> int:
    """The workload's micro-batch count under `lay` (the batch plan's: raydist.schedule.batch)."""
    return BatchPlan(w.global_batch, lay.dp, lay.micro_batch).num_microbatches


def complete(w: Workload, lay: Layout) -> Layout:
    """`lay` with what follows from the workload filled in, as the runtime resolves it: the micro-batch
    count and the pipeline's stage partition."""
    changes = {}
    if splits(w.global_batch, lay.dp, lay.micro_batch) and lay.num_microbatches != num_microbatches(w, lay):
        changes["num_microbatches"] = num_microbatches(w, lay)
    if lay.pp > 1 and not lay.stage_layers and lay.num_stages <= w.model.num_layers:
        changes["stage_layers"] = stage_partition(w.model, lay.num_stages)
    return lay.replace(**changes) if changes else lay


def layout_problems(w: Workload, lay: Layout) -> list[str]:
    """Why `lay` cannot run `w` (empty: it can)."""
    if not splits(w.global_batch, lay.dp, lay.micro_batch):
        return [f"train.global_batch={w.global_batch} must be divisible by dp ({lay.dp}) x train.micro_batch "
                f"({lay.micro_batch}); change global_batch, micro_batch or the layout"]
    lay = complete(w, lay)
    problems = validate(lay, w.model, w.seq_len)
    if not problems:
        try:
            check_pipeline_stages(w.peft.method, w.peft.trainable_last_layers, lay)
        except ConfigError as exc:
            problems = [str(exc)]
    return problems


def estimate(w: Workload, lay: Layout, hw: Hardware, memory: dict[str, float] | None = None,
             per_op_recompute: float | None = None) -> Estimate:
    """memory: `rank_memory`'s bytes for `lay` when the caller has them (the search prices memory first and
    times only the layouts that fit). per_op_recompute: a published run's own recompute policy
    (`timing.step_time`)."""
    mb = num_microbatches(w, lay)
    memory = rank_memory(w, lay, mb) if memory is None else memory
    time = step_time(w, lay, hw, mb, per_op_recompute)
    mfu = time["model_flops"] / (time["total"] * hw.peak_flops) if time["total"] > 0 else 0.0
    fits = memory["total"] <= hw.usable_memory_bytes
    return Estimate(lay, mb, memory, time, mfu, fits, hw.usable_memory_bytes)


def explain(est: Estimate) -> list[str]:
    """One line for the dominant memory term and one for the dominant non-compute time term."""
    mem, t = est.memory, est.time
    lay = est.layout
    terms = {"model state (params+grads+AdamW)": mem["params"] + mem["grads"] + mem["optimizer"],
             "activations": mem["activations"], "transient buffers": mem["transient"]}
    top = max(terms, key=terms.get)
    lines = [f"memory {est.memory_gb:.3g} GB of {est.memory_limit_bytes / 1e9:.3g} GB usable, "
             f"{top} {terms[top] / max(mem['total'], 1):.0%}" + _memory_hint(top, lay, mem["grads"] < mem["params"])]
    total = max(t["total"], 1e-12)
    overheads = {k: t[k] for k in TIME_TERMS}
    worst = max(overheads, key=overheads.get)
    compute_share = t["compute"] / total
    if overheads[worst] <= 0.01 * total:
        lines.append(f"compute-bound: model FLOPs are {compute_share:.0%} of the step")
    else:
        lines.append(f"compute {compute_share:.0%} of the step; largest overhead: {TIME_TERMS[worst]} "
                     f"{overheads[worst] / total:.0%}" + _time_hint(worst, est))
    return lines


def _memory_hint(term: str, lay: Layout, frozen: bool) -> str:
    if term.startswith("model state"):
        if frozen:  # peft: gradients and moments for the trained parameters only
            return " (4 bytes per held parameter, 12 more per trained one; shard with dp_shard/tp/pp to cut it)"
        return " (16 bytes per held parameter; shard with dp_shard/tp/pp to cut it)"
    if term == "activations":
        return (f" ({lay.activation_checkpoint} recompute, micro_batch {lay.micro_batch}; "
                "recompute or smaller micro-batches cut it)")
    return " (gathered FSDP units, logits, recompute region)"


def _time_hint(term: str, est: Estimate) -> str:
    lay = est.layout
    if term == "bubble":
        v = lay.virtual_stages
        formula = SCHEDULE_KINDS[lay.pp_schedule].formula
        return (f" ({lay.pp_schedule}, p={lay.pp}, m={est.num_microbatches}, v={v}: {formula} = "
                f"{est.time['bubble_fraction']:.1%})")
    if term == "dp_comm_exposed":
        return f" ({lay.data_parallel_kind.value} over {lay.dp * lay.cp} ranks, {est.time['dp_comm']:.3g} s before overlap)"
    if term == "tp_comm":
        return f" (tp={lay.tp}: 4 activation all-reduces per block per micro-batch)"
    if term == "recompute":
        if lay.activation_checkpoint == "selective":
            return " (selective: norms, RoPE and SwiGLU products re-run in backward)"
        return f" ({lay.activation_checkpoint}: one extra forward of the blocks)"
    return ""
