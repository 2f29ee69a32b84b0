"""Triton grouped GEMM for a mixture of experts. Imported lazily by grouped_mm.py.

Rows X (M, K) sorted by expert, expert e owning rows [offs[e-1], offs[e]) (offs: cumulative ends, int32):

    forward / dX:   Y[rows of e] = X[rows of e] @ W[e]          W (E, K, N), any strides (W[e]^T is a view)
    dW:             dW[e] = X[rows of e]^T @ dY[rows of e]      (E, K, N)

`_grouped_mm`: one program per (row tile of one expert, column tile). Tiles never straddle two experts: an
expert's rows are cut into ceil(rows_e / BLOCK_M) tiles of its own, so the grid holds at most
ceil(M / BLOCK_M) + E row tiles and a program maps its index to (expert, tile) by walking the offsets (E
scalar loads). Programs beyond the last tile, and experts with no rows, store nothing.
`_grouped_wgrad`: one program per (expert, K tile, N tile), accumulating over the expert's rows in BLOCK_M
slices; an expert with no rows writes zeros (its gradient is zero, not missing).
Both accumulate in fp32 and store in the output's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

INTERPRETED = bool(knobs.runtime.interpret)


def _configs():
    if INTERPRETED:  # one small config: the interpreter's cost is per program and per op
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16}, num_warps=1, num_stages=1)]
    shapes = [(128, 128, 32, 4, 4), (64, 128, 32, 4, 4), (128, 64, 32, 4, 4), (64, 64, 64, 4, 3),
              (128, 128, 64, 8, 3), (64, 256, 32, 8, 3)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
            for m, n, k, w, s in shapes]


CONFIGS = _configs()


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    if UPCAST:  # the interpreter multiplies bf16 bit patterns in tl.dot: widen first there only
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.autotune(configs=CONFIGS, key=["N", "K", "E", "stride_wk", "stride_wn"])
@triton.jit
def _grouped_mm(X, W, OFFS, Y, N, K, E,
                stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_ym, stride_yn,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    zero = pid_m * 0  # int32 scalars that the loop below carries
    start, before, expert, row0, row_end = zero, zero, zero - 1, zero, zero
    for e in range(0, E):
        end = tl.load(OFFS + e)
        tiles = (end - start + BLOCK_M - 1) // BLOCK_M
        hit = (pid_m >= before) & (pid_m < before + tiles)
        expert = tl.where(hit, e, expert)
        row0 = tl.where(hit, start + (pid_m - before) * BLOCK_M, row0)
        row_end = tl.where(hit, end, row_end)
        before += tiles
        start = end
    if expert >= 0:
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        row_ok = rows < row_end
        col_ok = cols < N
        x_ptrs = X + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
        w_ptrs = W + expert * stride_we + offs_k[:, None] * stride_wk + cols[None, :] * stride_wn
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = _dot(x, w, acc, UPCAST, PRECISION)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        y_ptrs = Y + rows[:, None] * stride_ym + cols[None, :] * stride_yn
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.autotune(configs=CONFIGS, key=["N", "K", "E"])
@triton.jit
def _grouped_wgrad(X, DY, OFFS, DW, N, K, E,
                   stride_xm, stride_xk, stride_dym, stride_dyn, stride_we, stride_wk, stride_wn,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    expert = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_n = tl.program_id(2)
    end = tl.load(OFFS + expert)
    start = tl.load(OFFS + expert - 1, mask=expert > 0, other=0)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    k_ok = ks < K
    col_ok = cols < N
    acc = tl.full([BLOCK_K, BLOCK_N], 0.0, dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + offs_m
        row_ok = rows < end
        xt = tl.load(X + rows[None, :] * stride_xm + ks[:, None] * stride_xk, mask=k_ok[:, None] & row_ok[None, :],
                     other=0.0)  # (BLOCK_K, BLOCK_M): X^T's tile
        dy = tl.load(DY + rows[:, None] * stride_dym + cols[None, :] * stride_dyn,
                     mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _dot(xt, dy, acc, UPCAST, PRECISION)
    dw_ptrs = DW + expert * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    tl.store(dw_ptrs, acc.to(DW.dtype.element_ty), mask=k_ok[:, None] & col_ok[None, :])
