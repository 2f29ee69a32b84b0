"""Combiners for `tl.reduce`, shared by the Triton kernel modules. Triton's standard-library reductions
(tl.max, tl.sum) are @jit functions fixed to the interpreted-or-compiled mode of the process's first
`import triton` (see runtime.py), so the kernels reduce with these instead; like the kernel modules, this one
is loaded through `runtime.load_kernel_module`, once per mode, so a kernel and its combiners share theirs."""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

INTERPRETED = bool(knobs.runtime.interpret)


@triton.jit
def max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def sum_combine(a, b):
    return a + b
