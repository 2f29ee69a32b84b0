"""Peak FLOP/s for MFU: a table for known accelerators; on CPU none that a training run reports.

MFU = achieved model FLOP/s / peak FLOP/s, where achieved = tokens/s * flops_per_token (models/gpt.py).
On CUDA the peak is the dense bf16 tensor-core figure of the device (fp32 runs use the same peak, so
their MFU reads honestly low). A CPU has no datasheet figure that means anything for a shared VM, and a
matmul timed in the training process does not hold either: the runs once measured it every few logged
intervals and kept the best, and the default 2-worker run on a 2-core machine showed MFU 153% at step 60
(the early timings ran while the other worker loaded, so the peak was understated) and 27.9% at step 300 at
about the same tokens/s. So `run_peak_flops` gives a training run no CPU peak and the metrics no CPU MFU
(`mfu_peak_source` says why); `peak_flops` still times a matmul for the benchmarks that compare kernels
side by side in one process (benchmarks/mfu.py).
"""

from __future__ import annotations

import time

import torch

# Dense (no sparsity) bf16 tensor-core peak FLOP/s per device.
PEAK_FLOPS_BF16 = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe part is lower (756e12)
    "H100 PCIE": 756e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 125e12,
    "V100": 125e12,
    "B200": 2250e12,
}


def cuda_peak_flops(device_name: str) -> float | None:
    name = device_name.upper()
    for key in sorted(PEAK_FLOPS_BF16, key=len, reverse=True):
        if key in name:
            return PEAK_FLOPS_BF16[key]
    return None


def measure_cpu_matmul_peak(size: int = 512, min_time_s: float = 0.3) -> float:
    """fp32 FLOP/s of a (size x size) @ (size x size) matmul on this process's torch threads."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    for _ in range(3):
        a @ b
    reps, elapsed = 0, 0.0
    start = time.perf_counter()
    while elapsed < min_time_s:
        a @ b
        reps += 1
        elapsed = time.perf_counter() - start
    return 2.0 * size**3 * reps / elapsed


NO_CPU_PEAK = "none:cpu (no peak FLOP/s holds on a shared CPU; raydist.metrics.flops)"


def run_peak_flops(device: torch.device) -> tuple[float, str]:
    """(peak FLOP/s, its source) for a training run's MFU: the device's table figure on CUDA (0.0 for a
    device the table lacks), 0.0 on CPU (the module's docstring); 0.0 means no MFU is reported."""
    if device.type == "cuda":
        return peak_flops(device)
    return 0.0, NO_CPU_PEAK


def peak_flops(device: torch.device) -> tuple[float, str]:
    """(peak FLOP/s, how it was obtained): on CPU a matmul timed now, for side-by-side benchmarks."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = cuda_peak_flops(name)
        if peak is not None:
            return peak, f"table:{name}"
        return 0.0, f"unknown:{name}"
    return measure_cpu_matmul_peak(), "measured:cpu_fp32_matmul"
