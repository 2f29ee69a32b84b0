"""Triton tiled matmul with grouped tile order and a fused epilogue. Imported lazily by matmul.py.

C (M, N) = epilogue(A (M, D) @ B (D, N)), accumulated in fp32 over BLOCK_K slices of D.

Grouped order (L2 reuse): program ids walk GROUP_M tile-rows of C down one tile-column before moving
right, so a wave of programs shares GROUP_M A-row-panels and a few B-column-panels instead of sweeping a
whole row of C (which would stream all of B through L2 for every row panel).

Epilogue, applied to the fp32 accumulator before the single store (no extra pass over C in memory):
    + bias[N];  then none | gelu (exact, erf) | silu;   or, with a second B (SWIGLU):
    C = silu(A @ B) * (A @ B2)  — the SwiGLU product, sharing every A tile between the two products.
With SAVE_PRE the pre-activation(s) are stored too (H1, H2), for the backward.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

INTERPRETED = bool(knobs.runtime.interpret)
ACTIVATION_CODES = {"none": 0, "gelu": 1, "silu": 2}


def _configs():
    if INTERPRETED:  # one config, no autotuning: the interpreter's cost is per program and per op, so
        # tiles of 32 (tests still span several tiles with tails); GROUP_M 2 exercises the grouped order
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2},
                              num_warps=1, num_stages=1)]
    shapes = [(128, 128, 32, 4, 4), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4), (128, 256, 64, 8, 3),
              (256, 128, 64, 8, 3), (64, 64, 64, 4, 4), (128, 128, 64, 8, 3), (64, 64, 32, 2, 5)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for m, n, k, w, s in shapes]


def _prune(configs, named_args, **kwargs):
    """fp32 operands and the SwiGLU's second accumulator double the tile footprint: drop the largest tiles.
    The SwiGLU's two fp32 accumulators must also leave each thread room: at most 128 of its 255 registers
    (a 128 x 128 tile over 4 warps needs 256 for them alone, and spills)."""
    swiglu = kwargs.get("SWIGLU", named_args.get("SWIGLU", False))
    if not (named_args["A"].dtype.itemsize >= 4 or swiglu):
        return configs
    kept = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128 and c.num_stages <= 4
            and (not swiglu or 2 * c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 32 * c.num_warps)]
    return kept or configs[:1]


MATMUL_CONFIGS = _configs()


# Only Triton builtins inside the kernel (no tl.zeros, tl.sigmoid, tl.cdiv: standard-library @jit functions
# fixed to the mode of the first `import triton`; see triton_attention.py and runtime.py).
@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # acc + a @ b. UPCAST: Triton 3.9's interpreter multiplies bf16 bit patterns in tl.dot; widen first
    # there only.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


# keyed on the strides too: the backward's transposed operands (dX = dZ W, dW = X^T dZ) get configs of
# their own rather than the forward's
@triton.autotune(configs=MATMUL_CONFIGS, key=["M", "N", "D", "SWIGLU", "stride_am", "stride_ad", "stride_bd",
                                               "stride_bn"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _matmul(A, B, B2, BIAS, C, H1, H2, M, N, D,
            stride_am, stride_ad, stride_bd, stride_bn, stride_b2d, stride_b2n, stride_cm, stride_cn,
            HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, SWIGLU: tl.constexpr, SAVE_PRE: tl.constexpr,
            UPCAST: tl.constexpr, PRECISION: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = (M + BLOCK_M - 1) // BLOCK_M
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    per_group = GROUP_M * tiles_n  # programs that cover GROUP_M tile-rows across all tile-columns
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)  # the last group may be shorter
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Out-of-range rows/cols wrap (mod M, N) to valid memory: their results are never stored.
    a_ptrs = A + (rows % M)[:, None] * stride_am + offs_k[None, :] * stride_ad
    b_ptrs = B + offs_k[:, None] * stride_bd + (cols % N)[None, :] * stride_bn
    b2_ptrs = B2 + offs_k[:, None] * stride_b2d + (cols % N)[None, :] * stride_b2n
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    acc2 = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k_ok = offs_k < D - k0  # the D tail
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = _dot(a, b, acc, UPCAST, PRECISION)
        if SWIGLU:
            b2 = tl.load(b2_ptrs, mask=k_ok[:, None], other=0.0)
            acc2 = _dot(a, b2, acc2, UPCAST, PRECISION)
            b2_ptrs += BLOCK_K * stride_b2d
        a_ptrs += BLOCK_K * stride_ad
        b_ptrs += BLOCK_K * stride_bd

    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    c_off = rows[:, None] * stride_cm + cols[None, :] * stride_cn
    c_mask = (rows[:, None] < M) & (cols[None, :] < N)
    if SAVE_PRE:  # pre-activations, same layout as C
        tl.store(H1 + c_off, acc.to(H1.dtype.element_ty), mask=c_mask)
        if SWIGLU:
            tl.store(H2 + c_off, acc2.to(H2.dtype.element_ty), mask=c_mask)
    if SWIGLU:
        out = acc * _sigmoid(acc) * acc2
    elif ACTIVATION == 1:
        out = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
    elif ACTIVATION == 2:
        out = acc * _sigmoid(acc)
    else:
        out = acc
    tl.store(C + c_off, out.to(C.dtype.element_ty), mask=c_mask)
