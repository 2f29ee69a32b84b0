"""The search: every valid layout for a world size, estimated, the ones that do not fit dropped, ranked.

Search space (every knob below is tuned for one figure, MFU (Chowdhery et al. 2022, PaLM, Appendix B),
which for a fixed model and batch is proportional to 1 / step time):
    tp        divisors of the world that divide num_heads, num_kv_heads and ffn_hidden, within a node
    cp        divisors with seq_len % (2 cp) == 0;   cp_impl ring | ulysses
    pp        divisors up to num_layers;             pp_schedule 1f1b | interleaved (2 or 4 chunks) | zbh1 | zbv
              (pipelines compose with tp + sp and cp: the 4-D and 5-D meshes)
    dp        what is left, split every way into dp_replicate x dp_shard (DDP, FSDP, HSDP)
    micro_batch  divisors of the per-rank batch (global_batch / dp), smallest first
    activation_checkpoint  none | selective | every_k | full;  FSDP reshard after forward or not
Sequence parallelism is always on with tp > 1: it moves the same bytes as plain TP (a reduce-scatter + all-gather pair is one all-reduce) and keeps less
activation memory. Validity is the runtime's own (`cost_model.layout_problems` -> `raydist.parallel.layout.validate`):
the planner proposes exactly the layouts `raydist train` accepts.

Plans are ranked by estimated step time (equivalently MFU: every layout does the same model FLOPs);
ties go to the smaller memory footprint. `choose_layout` is the entry point for `parallel = "auto"`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from typing import Iterable, Iterator

from raydist.config import Config, ConfigError
from raydist.parallel.layout import mesh_problems
from raydist.parallel.mesh import MeshSpec
from raydist.planner.cost_model import Estimate, complete, estimate, layout_problems
from raydist.planner.hardware import Hardware, get_hardware
from raydist.planner.memory import rank_memory
from raydist.planner.placement import Layout, Workload, rank_layer_counts
from raydist.schedule.batch import divisors, microbatch_count, per_rank_rows
from raydist.schedule.registry import DEFAULT_KIND, SCHEDULE_KINDS

ALL_FEATURES = frozenset({"tp", "cp", "pp", "ep"})
CHECKPOINT_POLICIES = ("none", "selective", "every_k", "full")


def implemented_features() -> frozenset[str]:
    """The parallelisms whose modules exist in this checkout (DDP/FSDP/HSDP and recompute always do)."""
    modules = {"tp": "raydist.parallel.tensor", "cp": "raydist.parallel.context", "pp": "raydist.parallel.pipeline",
               "ep": "raydist.models.moe"}
    return frozenset(k for k, mod in modules.items() if importlib.util.find_spec(mod) is not None)


def layout_shapes(w: Workload, world: int, hw: Hardware, features: Iterable[str] = ALL_FEATURES) -> Iterator[Layout]:
    """Every mesh x algorithm choice (micro_batch 1 and no recompute; `plan` varies those)."""
    features = frozenset(features)
    m = w.model
    for tp in divisors(world):
        if tp > 1 and ("tp" not in features or tp > hw.gpus_per_node):
            continue
        for cp in divisors(world // tp):
            if cp > 1 and "cp" not in features:
                continue
            for pp in divisors(world // (tp * cp)):
                if pp > 1 and ("pp" not in features or pp > m.num_layers):
                    continue
                dp = world // (tp * cp * pp)
                if w.global_batch % dp:
                    continue
                for dp_shard, ep in ((s, e) for s in divisors(dp) for e in divisors(math.gcd(s, m.moe_experts or 1))
                                     if e == 1 or "ep" in features):
                    base = Layout(MeshSpec(pp, dp // dp_shard, dp_shard, cp, tp, ep), sequence_parallel=tp > 1)
                    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}  # (not asdict: 5x)
                    for cp_impl in (("ring", "ulysses") if cp > 1 else ("ring",)):
                        # each kind's chunk counts (with pp = 1 only the default: no pipeline to schedule)
                        schedules = [(k.name, v) for k in SCHEDULE_KINDS.values() for v in k.planner_virtual_stages
                                     if (pp > 1 or k.name == DEFAULT_KIND) and pp * v <= m.num_layers]
                        for schedule, v in schedules:
                            for reshard in ((True, False) if base.fsdp_size > 1 else (True,)):
                                yield Layout(**{**fields, "cp_impl": cp_impl, "pp_schedule": schedule,
                                                "virtual_stages": v, "fsdp_reshard_after_forward": reshard})


def valid_layouts(w: Workload, world: int, hw: Hardware, features: Iterable[str] = ALL_FEATURES,
                  policies: Iterable[str] = CHECKPOINT_POLICIES,
                  micro_batches: Iterable[int] | None = None) -> Iterator[tuple[Layout, bool]]:
    """Every candidate (shape x recompute policy x micro-batch) with whether the runtime accepts it;
    accepted ones come completed (micro-batch count, stage partition), in increasing micro-batch order
    per shape and policy."""
    for _, _, lay, ok in _candidates(w, world, hw, features, policies, micro_batches):
        yield lay, ok


def _candidates(w, world, hw, features, policies, micro_batches):
    """valid_layouts' candidates as (completed shape, policy, layout, accepted)."""
    for shape in layout_shapes(w, world, hw, features):
        shape = complete(w, shape)  # the stage partition, once per shape
        per_rank = per_rank_rows(w.global_batch, shape.dp)  # (shapes whose dp divides it)
        sizes = sorted(micro_batches) if micro_batches is not None else divisors(per_rank)
        layers = max(rank_layer_counts(w, shape)) if shape.num_stages <= w.model.num_layers else 0
        fields = {f.name: getattr(shape, f.name) for f in dataclasses.fields(shape)}
        mesh_ok = not mesh_problems(shape, w.model, w.seq_len)  # (most invalid candidates: once per mesh)
        for policy in policies:
            if policy == "every_k" and layers < 4:  # segments of round(sqrt(L)) = 1 block: same as full
                continue
            for size in sizes:
                divides = per_rank % size == 0
                # (a constructor call: dataclasses.replace costs twice as much, half a million times)
                lay = Layout(**{**fields, "micro_batch": size, "activation_checkpoint": policy,
                                "num_microbatches": microbatch_count(per_rank, size) if divides else 1})
                yield shape, policy, lay, divides and mesh_ok and not layout_problems(w, lay)


def enumerate_estimates(w: Workload, world: int, hw: Hardware, features: Iterable[str] = ALL_FEATURES,
                        policies: Iterable[str] = CHECKPOINT_POLICIES,
                        micro_batches: Iterable[int] | None = None) -> tuple[list[Estimate], dict[str, int]]:
    """(estimates of the layouts that fit, counts: considered / invalid / too big)."""
    counts = {"considered": 0, "invalid": 0, "too_big": 0, "fit": 0}
    fits: list[Estimate] = []
    too_big: set = set()  # (shape, policy) whose smaller micro-batch already did not fit
    for shape, policy, lay, ok in _candidates(w, world, hw, features, policies, micro_batches):
        counts["considered"] += 1
        if not ok:
            counts["invalid"] += 1
            continue
        if (shape, policy) in too_big:  # larger micro-batches only need more memory
            continue
        memory = rank_memory(w, lay, lay.num_microbatches)  # (complete: the batch plan's count)
        if memory["total"] > hw.usable_memory_bytes:  # not timed: step_time costs more than the memory model
            counts["too_big"] += 1
            too_big.add((shape, policy))
            continue
        counts["fit"] += 1
        fits.append(estimate(w, lay, hw, memory))
    fits.sort(key=lambda e: (e.step_time_s, e.memory["total"]))
    return fits, counts


def plan(w: Workload, world: int, hw: Hardware, top: int = 5, **kwargs) -> tuple[list[Estimate], dict[str, int]]:
    fits, counts = enumerate_estimates(w, world, hw, **kwargs)
    return fits[:top] if top else fits, counts


def choose_layout(cfg: Config, world_size: int, gpus_per_node: int | None = None,
                  device: str = "auto") -> tuple[Layout, dict]:
    """The best layout the planner finds for `cfg` on `world_size` ranks, among the parallelisms this
    checkout implements: (the Layout, ready to train with, and its estimate as a dict: memory_gb,
    step_time_s, mfu, reasons, ...). Raises ConfigError when no layout fits.

    device: 'h100' | 'a100' | 'h200' | 'cpu' | 'auto' (CUDA device name when CUDA is visible, else cpu).
    """
    from raydist.planner.hardware import config_signature

    device = _resolve_device(device)
    hw = get_hardware(device, world_size, gpus_per_node, config_signature(cfg))
    w = Workload.from_config(cfg, hw.compute_dtype_bytes)
    limit = cfg.train.micro_batch  # set: an upper bound, as in an elastic run (Config.micro_batch_is_exact)
    fits, counts = enumerate_estimates(w, world_size, hw, features=implemented_features(),
                                       micro_batches=range(1, limit + 1) if limit else None)
    if not fits:
        bound = f" with micro-batches of at most train.micro_batch={limit}" if limit else ""
        raise ConfigError(f"no layout of {world_size} {device} ranks fits the model{bound} ({counts['considered']} "
                          f"considered, {counts['too_big']} too big for {hw.usable_memory_bytes / 1e9:.3g} GB); "
                          "add workers, shrink the model or the sequence, or lower train.global_batch")
    best = fits[0]
    return best.layout, {**best.to_dict(), "device": device}


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0).lower()
        for key in ("h200", "h100", "a100"):
            if key in name:
                return key
        return "h100"
    return "cpu"
