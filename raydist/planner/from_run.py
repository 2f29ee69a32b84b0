"""The plan for a run against what the run measured: `raydist plan --from-run RUN_DIR` and `raydist report`.

From the run directory alone (any fsspec URI): its config (config.toml), the world and mesh it trained on and
its measured step times (metrics.jsonl). The layout is the one the run trained with (`policy.plan_layout` for
that world, checked against the mesh the records carry); the cost model prices it on the run's device (a CUDA
run's `mfu_peak_source` names the GPU; a CPU run is priced on this machine's `raydist plan --calibrate`
figures, so the comparison means something on the machine that ran it).

Measured, over the last attempt's logged intervals after the first (which holds start-up and warm-up): the
median step time, tokens/s and MFU (CUDA only), and the largest peak memory a record holds
(`torch.cuda.max_memory_allocated` on CUDA, the process's peak RSS on CPU, which also holds the Python
runtime and the data: on CPU the memory line compares unlike things and is shown, not judged).
"""

from __future__ import annotations

import dataclasses
import statistics

from raydist.config import Config, ConfigError, read_run_config
from raydist.planner.cost_model import Estimate, complete, estimate
from raydist.planner.hardware import DEVICES, Hardware, config_signature, get_hardware
from raydist.planner.placement import Workload
from raydist.planner.policy import plan_layout
from raydist.store.run_store import RunStore

# a CUDA device's name (torch.cuda.get_device_name, as mfu_peak_source carries it) -> the planner's row
GPU_ROWS = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"))


@dataclasses.dataclass
class RunComparison:
    run_dir: str
    device: str
    world_size: int
    hardware: Hardware
    estimate: Estimate
    measured: dict  # step_time_s, tokens_per_s, mfu (or None), mem_peak_gb (or None), intervals, steps

    def errors(self) -> dict[str, float | None]:
        """predicted / measured - 1 per figure (None where the run measured nothing)."""
        m, e = self.measured, self.estimate
        predicted = {"step_time_s": e.step_time_s, "mfu": e.mfu, "mem_peak_gb": e.memory_gb}
        return {k: (v / m[k] - 1 if m.get(k) else None) for k, v in predicted.items()}

    def to_dict(self) -> dict:
        return {"run_dir": self.run_dir, "device": self.device, "world_size": self.world_size,
                "layout": self.estimate.layout.describe(),
                "predicted": {"step_time_s": self.estimate.step_time_s, "mfu": round(self.estimate.mfu, 4),
                              "mem_peak_gb": round(self.estimate.memory_gb, 4)},
                "measured": self.measured, "errors": self.errors()}


def run_device(records: list[dict]) -> str:
    """The planner row of the device a run trained on: the GPU its records name, else cpu."""
    source = next((r.get("mfu_peak_source") for r in reversed(records) if r.get("mfu_peak_source")), "") or ""
    if not source.startswith("table:"):
        return "cpu"
    name = source.split(":", 1)[1].upper()
    for key, row in GPU_ROWS:
        if key in name:
            return row
    raise ConfigError(f"the run trained on {name!r}, which the planner has no row for; pass --device "
                      f"({', '.join(DEVICES)})")


def measured_figures(records: list[dict]) -> dict:
    """The last attempt's logged training intervals after its first (see the module docstring)."""
    train = [r for r in records if r.get("step_time_s") is not None]
    if not train:
        raise ConfigError("the run's metrics.jsonl holds no logged training step; compare a run that trained")
    last_start = max((i for i in range(1, len(train)) if train[i]["step"] <= train[i - 1]["step"]), default=0)
    attempt = train[last_start:]
    world = attempt[-1].get("world_size")
    attempt = [r for r in attempt if r.get("world_size") == world]
    timed = attempt[1:] or attempt
    tokens = [r["tokens_per_s"] for r in timed if r.get("tokens_per_s") is not None]
    mfus = [r["mfu"] for r in timed if r.get("mfu")]
    memory = [r["mem_peak_mb"] for r in timed if r.get("mem_peak_mb")]
    return {"step_time_s": statistics.median(r["step_time_s"] for r in timed),
            "tokens_per_s": statistics.median(tokens) if tokens else None,
            "mfu": statistics.median(mfus) if mfus else None,
            "mem_peak_gb": max(memory) * 2**20 / 1e9 if memory else None,
            "intervals": len(timed), "steps": [timed[0]["step"], timed[-1]["step"]],
            "world_size": world, "mesh": attempt[-1].get("mesh")}


def _read_run(run_dir: str) -> tuple[Config, list[dict], dict, int]:
    """(the run's config, its metrics records, `measured_figures` of them, the world it last trained on)."""
    cfg = read_run_config(run_dir)
    records = RunStore(run_dir).read_records("metrics.jsonl", [])
    if not records:
        raise ConfigError(f"{run_dir} has no metrics.jsonl records; use a run that logged a step")
    measured = measured_figures(records)
    return cfg, records, measured, int(measured["world_size"] or cfg.ray.num_workers)


def compare_run(run_dir: str, device: str | None = None, gpus_per_node: int | None = None,
                run: tuple | None = None) -> RunComparison:
    """The cost model's estimate of the run's own layout on its device against the run's measurements
    (`run`: `_read_run`'s, when the caller read it already)."""
    cfg, records, measured, world = run or _read_run(run_dir)
    device = device or run_device(records)
    layout = plan_layout(cfg, world)
    mesh = measured.get("mesh") or {}
    if any(mesh.get(name, degree) != degree for name, degree in layout.degrees().items()):
        raise ConfigError(f"the run's records say mesh {mesh}, but its config on {world} workers gives "
                          f"{layout.degrees()}; was the config edited after the run?")
    w = Workload.from_config(cfg, compute_dtype_bytes=4 if device == "cpu" else 2, name=cfg.train.run_name)
    hw = get_hardware(device, layout.world_size, gpus_per_node, workload_signature=config_signature(cfg))
    return RunComparison(run_dir, device, world, hw, estimate(w, complete(w, layout), hw), measured)


def format_comparison(c: RunComparison) -> str:
    e, m, errors = c.estimate, c.measured, c.errors()

    def row(name: str, predicted: str, measured: str, key: str) -> str:
        err = errors[key]
        return f"  {name:14s} {predicted:>14s} {measured:>14s} {'' if err is None else f'{err:+.1%}':>9s}"

    mem_note = " (peak RSS on CPU: not the same thing)" if c.device == "cpu" else ""
    lines = [f"{c.run_dir}: {e.layout.describe()} on {c.world_size} x {c.device}, "
             f"{m['intervals']} logged intervals (steps {m['steps'][0]}-{m['steps'][1]})",
             f"  {'':14s} {'predicted':>14s} {'measured':>14s} {'error':>9s}",
             row("step time", f"{e.step_time_s * 1e3:.4g} ms", f"{m['step_time_s'] * 1e3:.4g} ms", "step_time_s"),
             row("MFU", f"{e.mfu:.1%}", "n/a" if m["mfu"] is None else f"{m['mfu']:.1%}", "mfu"),
             row("memory", f"{e.memory_gb:.3g} GB", "n/a" if m["mem_peak_gb"] is None else f"{m['mem_peak_gb']:.3g} GB",
                 "mem_peak_gb") + mem_note,
             f"  priced on: {c.device}, {c.hardware.source}"]
    return "\n".join(lines)


def calibrate_from_run(run_dir: str) -> tuple[dict, float]:
    """`raydist plan --calibrate --from-run RUN_DIR`, for a CPU run on this machine: measure the machine with the
    run's config and world (`calibrate.calibrate`), then scale the workload's measured compute rate so that the
    run's own layout prices at the step time the run measured (communication, bubble and optimizer as the model
    has them). The other layouts of the workload are then priced from that one run. Returns the saved record and
    the scale (the bare forward+backward's rate over the rate inside the run's steps)."""
    from raydist.planner.calibrate import calibrate
    from raydist.planner.hardware import save_calibration

    run = _read_run(run_dir)
    cfg, records, measured, world = run
    if run_device(records) != "cpu":
        raise ConfigError(f"{run_dir} trained on a GPU; --calibrate measures this machine's CPU (a GPU run is "
                          "compared against the device's row without it)")
    record = calibrate(max(2, world), config=cfg, save=True)
    comparison = compare_run(run_dir, "cpu", run=run)
    t = comparison.estimate.time
    # what scales with the compute rate: the tp term too where it is the measured split ratio's
    compute = t["compute"] + t["recompute"] + t.get("tp_measured", 0.0)
    rest = t["total"] - compute
    if measured["step_time_s"] <= rest:
        raise ConfigError(f"{run_dir}: its measured step ({measured['step_time_s'] * 1e3:.4g} ms) is shorter than "
                          f"the model's communication and optimizer alone ({rest * 1e3:.4g} ms); nothing to fit")
    scale = compute / (measured["step_time_s"] - rest)
    [(signature, workload)] = record["workloads"].items()
    record["workloads"][signature] = dict(
        workload, compute_efficiency=workload["compute_efficiency"] * scale,
        block_overhead_s=workload["block_overhead_s"] / scale,
        fitted_to_run={"run_dir": run_dir, "step_time_s": measured["step_time_s"], "scale": scale,
                       "layout": comparison.estimate.layout.describe()})
    record.pop("path", None)
    record["path"] = str(save_calibration(record))
    return record, scale
