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


if INTERPRETED:
    # The interpreter reduces with numpy only when the combiner *is* the standard library's (it compares
    # objects, triton/runtime/interpreter.py `ReduceOps.apply_impl`, and never calls them); any other it runs
    # in Python element by element, which made tl.reduce ~95% of an interpreted attention block's time. Those
    # two are then never called, so the mode they were built in does not matter.
    max_combine = getattr(tl.standard, "_elementwise_max", max_combine)
    sum_combine = getattr(tl.standard, "_sum_combine", sum_combine)
