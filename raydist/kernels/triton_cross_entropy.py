"""Triton kernels for the elementwise half of the fused loss (kernels/cross_entropy.py launches them;
models/loss.py `_LinearCrossEntropy` runs the matmuls). Imported lazily, once per mode (runtime.py).

One program per token row of a chunk of logits z (rows, V), the head's matmul output in its own dtype:

    _row_stats:     lse = log sum_v exp(z_v) (online: a running max and a rescaled sum over BLOCK_V
                    columns at a time, as FlashAttention's softmax), and z at the target's column
    _softmax_grad:  z_v <- (exp(z_v - lse) - [v == target]) * scale, in place, in z's dtype

All arithmetic in fp32, whatever z's dtype; the gradient overwrites the logits it came from, so the backward
holds one (rows, V) buffer in the matmul's dtype instead of an fp32 copy and the four passes of the torch
path (subtract, exp, scatter, scale; then the cast).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

from raydist.kernels import runtime

INTERPRETED = bool(knobs.runtime.interpret)
# Columns per loop iteration: a row of 128k fp32 logits is 32 iterations on a GPU; the interpreter runs
# small blocks quicker.
BLOCK_V = 64 if INTERPRETED else 4096
NUM_WARPS = 1 if INTERPRETED else 8


# Only Triton builtins, plus our own @triton.jit helpers (see triton_attention.py: the standard library's
# tl.max / tl.sum are fixed to the mode of the process's first `import triton`).
_reduce = runtime.load_kernel_module("triton_reduce")  # built in this module's mode
_max_combine, _sum_combine = _reduce.max_combine, _reduce.sum_combine


@triton.jit
def _row_stats(Z, stride_z, INDEX, LSE, PICKED, n_cols, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = Z + row * stride_z
    offs = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)  # a running max per lane, merged at the end
    s = tl.full([BLOCK_V], 0.0, tl.float32)  # sum of exp(z - m) per lane
    for start in range(0, n_cols, BLOCK_V):
        cols = start + offs
        z = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, z)
        # a lane that has seen only -inf (the tail's masked columns) shifts by 0, not -inf: its s stays 0
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.exp(z - shift)
        m = m_new
    top = tl.reduce(m, 0, _max_combine)
    total = tl.reduce(s * tl.exp(m - top), 0, _sum_combine)
    tl.store(LSE + row, top + tl.log(total))
    target = tl.load(INDEX + row)
    tl.store(PICKED + row, tl.load(base + target).to(tl.float32))


@triton.jit
def _softmax_grad(Z, stride_z, LSE, INDEX, HIT, SCALE, n_cols, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = Z + row * stride_z
    offs = tl.arange(0, BLOCK_V)
    lse = tl.load(LSE + row)
    scale = tl.load(SCALE + row)
    target = tl.load(INDEX + row)
    hit = tl.load(HIT + row)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + offs
        inside = cols < n_cols
        z = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
        g = tl.exp(z - lse)
        g = tl.where((cols == target) & (hit != 0), g - 1.0, g) * scale
        tl.store(base + cols, g.to(Z.dtype.element_ty), mask=inside)
