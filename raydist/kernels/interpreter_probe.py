"""A one-program Triton kernel for `runtime.interpreter_error`: a loop bounded by program-id arithmetic, as
raydist's attention kernels have. Some Triton interpreters cannot run one with some numpy versions (Triton
3.6 takes `int()` of a 1-element array, an error since numpy 2.4; Triton 3.9 runs it), so the interpreter is
probed once before the kernels are offered on the CPU. Loaded through `runtime.load_kernel_module`."""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

INTERPRETED = bool(knobs.runtime.interpret)


@triton.jit
def count_tiles(OUT, N, BLOCK: tl.constexpr):
    hi = (tl.program_id(0) + 1) * N
    tiles = 0
    for _ in range(0, hi, BLOCK):
        tiles += 1
    tl.store(OUT, tiles)
