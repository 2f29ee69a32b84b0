"""What the cost model knows about a device and its links: peak FLOP/s, memory, alpha-beta per link.

The cost of a collective over p ranks is `alpha * log2(p) + n / beta` (Hockney 1994's alpha-beta model of a
message, with the log2(p) start-ups of tree / recursive-doubling collectives, Thakur, Rabenseifner & Gropp
2005; alpha: start-up latency of a message, beta: bandwidth, n: bytes moved). Two link classes matter: inside
a node (NVLink 4: ~450 GB/s per direction on H100, NVIDIA's "900 GB/s" is both directions) and between nodes
(one 400 Gb/s = 50 GB/s NIC per GPU, as in the H100 clusters of Llama Team 2024), about 10x apart. The table
below holds datasheet figures; `--device cpu` takes them from `raydist plan --calibrate` (measured here, see
calibrate.py).

Measured, for the H100 (and the H200: the same chip's compute), by the GPU check suite on one H100 80GB
(2026-11-27, torch 2.11 + CUDA 13.0; benchmarks/results/gpu_suite_h100.json, README "The GPU check suite"):
- `compute_efficiency`, the share of the dense bf16 peak (raydist.metrics.flops' table) that the model's
  matmuls reach: cuBLAS forward+backward at Llama 3 8B/70B MLP shapes over 8192 tokens ran at 682-707
  TFLOP/s, 0.69-0.72 of 989: 0.70.
- `attention_efficiency`, by sequence length: flash SDPA's causal forward+backward at Llama 3 heads ran at
  346/401/439 TFLOP/s (T = 2k/4k/8k, the 70B's within 1%), 0.35/0.41/0.44 of the peak on the FLOPs it
  does; a causal kernel does half the FLOPs that MFU counts (12 L d T per token, Chowdhery et al. 2022),
  so in the planner's FLOPs the rates are twice that: 0.70/0.81/0.89.
- `elementwise`: norms, RoPE, the attention layout copies, residual adds, the SwiGLU product, the loss over
  the vocabulary and the weights' bf16 casts are priced as the bytes they move at memory bandwidth
  (timing.py); without them the planner put the suite's 8B-shaped stack at 63% MFU against 43.6% measured.
The A100 row keeps the earlier assumption (not measured: 0.75 of its peak for every FLOP, no elementwise
term).
- beta inside a Hopper node is what NCCL's ring all-gather and reduce-scatter reach over NVLink 4 on 8 GPUs,
  360 GB/s of bus bandwidth ("exactly what we'd expect on H100", NCCL's maintainer, NVIDIA/nccl-tests issue
  326), not the links' 450 GB/s. The A100 row keeps its datasheet link.
- alpha is an order-of-magnitude guess: 1 us for NVLink and 10 us across nodes (a network hop and the NIC add
  to it); NCCL's real small-message latency is higher, which matters only for layouts with many tiny
  collectives.
- `usable_memory_fraction`: the share of HBM a plan may fill (CUDA context, NCCL buffers, fragmentation).
- `comm_overlap`: the share of data-parallel communication (DDP buckets, FSDP prefetch) hidden behind
  compute. 1.0 on GPUs (separate copy engines / NCCL streams); on a CPU the collectives run on the same
  cores as the math, so gloo time adds to compute (0.0).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from raydist.errors import ConfigError
from raydist.store.cache import cache_dir

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class Link:
    alpha_s: float  # start-up latency per collective step
    beta_bytes_per_s: float  # bandwidth per rank, one direction


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # per device, the MFU denominator
    memory_bytes: float  # per device (HBM, or host RAM / ranks on CPU)
    memory_bandwidth_bytes_per_s: float  # HBM (or DRAM) bandwidth: the optimizer step is bound by it
    intra: Link  # inside a node
    inter: Link  # between nodes
    gpus_per_node: int = 8
    compute_efficiency: float = 0.75  # the matmuls' share of peak_flops
    # ((seq_len, share of peak_flops on the planner's attention FLOPs), ...) ascending; empty: compute_efficiency
    attention_efficiency: tuple[tuple[int, float], ...] = ()
    elementwise: bool = False  # price memory-bound work (norms, RoPE, SwiGLU, the loss, casts) at the bandwidth
    usable_memory_fraction: float = 0.9
    comm_overlap: float = 1.0
    compute_dtype_bytes: int = 2  # bf16 on GPUs, fp32 (4) on CPU
    source: str = "datasheet"
    # Measured per workload by `--calibrate CONFIG` (CPU): fixed seconds per block per micro-batch
    # (dispatch, Python) and recompute cost as a fraction of forward+backward time, by policy. None:
    # the analytic model (no fixed cost; full/every_k = one more forward = 1/3 of forward+backward).
    block_overhead_s: float = 0.0
    recompute_factors: dict | None = None
    # Measured the same way, by tp degree (a str): one micro-batch's forward+backward of the model split over
    # tp ranks (raydist's tensor parallelism, all of them at once) over one rank's of the whole model. On CPU
    # tensor parallelism costs more than its collectives: every DTensor op's Python dispatch, and the norms,
    # residuals and loss each rank repeats without sequence parallelism (timing.step_time's tp term).
    tp_factors: dict | None = None

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes * self.usable_memory_fraction

    def attention_share(self, seq_len: int) -> float:
        """The attention kernels' share of peak_flops at `seq_len`: the measured point at or below it (the
        shortest one below the first), compute_efficiency when none was measured."""
        if not self.attention_efficiency:
            return self.compute_efficiency
        below = [share for t, share in self.attention_efficiency if t <= seq_len]
        return below[-1] if below else self.attention_efficiency[0][1]

    def link(self, crosses_nodes: bool) -> Link:
        return self.inter if crosses_nodes else self.intra

    def with_gpus_per_node(self, gpus_per_node: int | None) -> "Hardware":
        return self if not gpus_per_node else replace(self, gpus_per_node=gpus_per_node)

    def to_dict(self) -> dict:
        return asdict(self)


# Datasheet rows. H100/H200 SXM: NVLink 4 (18 links x 25 GB/s = 450 GB/s per direction, of which NCCL's
# collectives reach 360, the module docstring says), one 400 Gb/s NDR port per GPU. A100 80GB SXM
# (Megatron's Selene): NVLink 3 (300 GB/s per direction), one 200 Gb/s HDR port per GPU.
HOPPER_NCCL_NVLINK = 360 * GB
HOPPER_MEASURED = dict(compute_efficiency=0.70, attention_efficiency=((2048, 0.70), (4096, 0.81), (8192, 0.89)),
                       elementwise=True, source="measured (GPU check suite, one H100, 2026-11-27)")
# The H100 of Meta's Grand Teton hosts, which torchtitan's published H100 benchmarks ran on: 96 GB of HBM2e at
# 2.4 TB/s, run at a 500 W power limit (torchtitan docs/performance.md). Its sustained peak "is between SXM and
# NVL" (ibid.). Where between: a chip's dynamic power goes as f V^2 and its voltage with its clock, so at a
# power limit the clock scales about as the cube root of the power; that puts the 400 W H100 NVL at 0.83 of
# the 700 W SXM (its datasheet: 835 of 989 TFLOP/s, 0.844) and the 500 W Grand Teton part at
# (500/700)^(1/3) = 0.894, which scales the measured efficiencies; MFU keeps the SXM's 989 as its
# denominator, as torchtitan's figures do.
POWER_CAPPED_H100 = (500 / 700) ** (1 / 3)


def _power_capped(measured: dict, factor: float) -> dict:
    return dict(measured, compute_efficiency=measured["compute_efficiency"] * factor,
                attention_efficiency=tuple((t, share * factor) for t, share in measured["attention_efficiency"]),
                source=f"{measured['source']}, x{factor:.3f} for a 500 W limit (torchtitan's Grand Teton H100)")


DEVICES: dict[str, Hardware] = {
    "h100": Hardware("h100", 989e12, 80 * GB, 3.35e12, Link(1e-6, HOPPER_NCCL_NVLINK), Link(10e-6, 50 * GB),
                     **HOPPER_MEASURED),
    "h200": Hardware("h200", 989e12, 141 * GB, 4.8e12, Link(1e-6, HOPPER_NCCL_NVLINK), Link(10e-6, 50 * GB),
                     **HOPPER_MEASURED),
    "a100": Hardware("a100", 312e12, 80 * GB, 2.0e12, Link(1e-6, 300 * GB), Link(10e-6, 25 * GB)),
    "h100-hbm2e": Hardware("h100-hbm2e", 989e12, 96 * GB, 2.4e12, Link(1e-6, HOPPER_NCCL_NVLINK),
                           Link(10e-6, 50 * GB),
                           **_power_capped(HOPPER_MEASURED, POWER_CAPPED_H100)),
}
DEVICE_NAMES = (*DEVICES, "cpu")


def workload_signature(model: dict, seq_len: int, kernels: dict) -> str:
    """Key of a workload's measured compute in the calibration file: the model's shape, the sequence length
    and the [kernels] it was timed with (the fused loss against the plain one changes the step, so a
    calibration taken with other kernels is not this workload's)."""
    keys = ("num_layers", "d_model", "num_heads", "num_kv_heads", "ffn_hidden", "vocab_size", "tie_embeddings")
    chosen = "-".join(f"{k}:{kernels[k]}" for k in sorted(kernels))
    return "-".join(str(model[k]) for k in keys) + f"-s{seq_len}-{chosen}"


def config_signature(cfg) -> str:
    """`workload_signature` of a `raydist.config.Config`: its model, data.seq_len and [kernels]."""
    from dataclasses import asdict

    return workload_signature(asdict(cfg.model), cfg.data.seq_len, asdict(cfg.kernels))




def calibration_path() -> Path:
    return cache_dir() / "calibration.json"


def load_calibration() -> dict | None:
    path = calibration_path()
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def save_calibration(record: dict) -> Path:
    """Write the record; workloads measured earlier with the same host and world size are kept."""
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    old = load_calibration() or {}
    if old.get("host") == record.get("host") and old.get("world_size") == record.get("world_size"):
        record = dict(record, workloads={**old.get("workloads", {}), **record.get("workloads", {})})
    record = dict(record, saved_at=time.time())
    path.write_text(json.dumps(record, indent=1))
    return path


def cpu_hardware(world_size: int, gpus_per_node: int | None = None, calibration: dict | None = None,
                 workload_signature: str | None = None) -> Hardware:
    """The CPU row: calibrated numbers when present, else a quick in-process matmul and gloo guesses.

    On CPU all ranks of a node share its cores and RAM, so peak and memory are per rank as measured with
    `world_size` processes running at once (calibrate.py does exactly that)."""
    cal = calibration if calibration is not None else load_calibration()
    ranks_per_node = gpus_per_node or world_size
    ram = _host_memory_bytes() / max(1, ranks_per_node)
    if cal and cal.get("device") == "cpu":
        link = Link(cal["alpha_s"], cal["beta_bytes_per_s"])
        hw = Hardware("cpu", cal["matmul_peak_flops"], ram, cal["memory_bandwidth_bytes_per_s"], link, link,
                      gpus_per_node=ranks_per_node, compute_efficiency=1.0,
                      usable_memory_fraction=0.8, comm_overlap=0.0, compute_dtype_bytes=4,
                      source=f"calibrated with {cal.get('world_size')} local processes")
        measured = (cal.get("workloads") or {}).get(workload_signature or "")
        if measured:
            hw = replace(hw, compute_efficiency=measured["compute_efficiency"],
                         block_overhead_s=measured["block_overhead_s"],
                         recompute_factors=dict(measured["recompute_factors"]),
                         tp_factors=dict(measured.get("tp_factors") or {}),
                         source=hw.source + " + this workload's forward/backward"
                         + (f", its rate fitted to {measured['fitted_to_run']['run_dir']}"
                            if measured.get("fitted_to_run") else ""))
        elif world_size != cal.get("world_size"):
            hw = replace(hw, source=hw.source + f" (planning {world_size}: per-rank peak may differ)")
        return hw
    from raydist.metrics.flops import measure_cpu_matmul_peak

    # Uncalibrated: one process's matmul peak shared by the ranks that share the cores.
    cores = max(1, os.cpu_count() or 1)
    peak = measure_cpu_matmul_peak(min_time_s=0.2) * min(1.0, cores / max(1, ranks_per_node))
    link = Link(200e-6, 1 * GB)  # loopback gloo, a guess until --calibrate measures it
    return Hardware("cpu", peak, ram, 5 * GB, link, link, gpus_per_node=ranks_per_node, compute_efficiency=1.0,
                    usable_memory_fraction=0.8, comm_overlap=0.0, compute_dtype_bytes=4,
                    source="uncalibrated (run `raydist plan --calibrate`)")


def _host_memory_bytes() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 * GIB


def get_hardware(device: str, world_size: int, gpus_per_node: int | None = None,
                 workload_signature: str | None = None) -> Hardware:
    """The device row; for cpu the calibration (and this workload's measured compute, when calibrated)."""
    device = device.lower()
    if device == "cpu":
        return cpu_hardware(world_size, gpus_per_node, workload_signature=workload_signature)
    if device not in DEVICES:
        raise ConfigError(f"--device {device!r} is not one of {', '.join(DEVICE_NAMES)}")
    return DEVICES[device].with_gpus_per_node(gpus_per_node)
