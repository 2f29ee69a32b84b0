"""Triton flash-attention kernels (forward, and backward as two kernels). Imported lazily by attention.py.

FlashAttention (Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with
IO-Awareness"): tile Q into BLOCK_M rows and K/V into BLOCK_N rows; a program keeps its Q tile in registers
and streams K/V tiles, never writing the (T, S) score matrix to memory, so the memory is O(T) (the output and
a log-sum-exp per row) instead of O(T^2). The softmax is computed online:

    m_new = max(m, rowmax(s));  l = l * exp(m - m_new) + rowsum(exp(s - m_new));
    acc = acc * exp(m - m_new) + exp(s - m_new) v;     at the end  out = acc / l,  lse = m + log(l)

with exponentials in base 2 (scores pre-multiplied by log2(e)), lse stored in natural log.

The backward recomputes P = exp(s - lse) tile by tile from Q, K and the saved lse (recomputation instead
of storing P). With delta_i = rowsum(dO_i * O_i) - dlse_i (the dlse term lets gradients flow through a
returned lse, as ring attention needs):  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta),
dQ = scale * dS K,  dK = scale * dS^T Q.  `_attn_bwd_dkdv` owns one K/V tile of one kv head and loops over
every query head of its group (grouped-query attention needs no atomics and is deterministic);
`_attn_bwd_dq` owns one Q tile.

Causal blocks: for the query tile starting at row r0, key tiles wholly left of r0 need no mask; only the
tiles from floor(r0 / BLOCK_N) * BLOCK_N up to r0 + BLOCK_M are masked (and skipped beyond). Sequence
tails (T not a multiple of the block) are masked loads and stores.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

from raydist.kernels import runtime

INTERPRETED = bool(knobs.runtime.interpret)
# Inside the kernels log2(e) = 1.4426950408889634 and ln(2) = 0.6931471805599453 appear as literals.


def _configs(shapes):
    if INTERPRETED:  # the interpreter benchmarks nothing usefully: one small config keeps tests quick
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1, num_stages=1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


def _prune_fp32(configs, named_args, **kwargs):
    """fp32 tiles take twice the shared memory (BLOCK_M=128 at head dim 128 needs ~225 KB, over an H100's
    227 KB with pipelining) and compile slowly: keep the small tiles only."""
    if named_args["Q"].dtype.itemsize < 4:
        return configs
    small = [c for c in configs if c.kwargs["BLOCK_M"] <= 64 and c.kwargs["BLOCK_N"] <= 64 and c.num_stages <= 2]
    return small or configs[:1]


# (BLOCK_M, BLOCK_N, num_warps, num_stages). Keyed on the shape and layout (KEY): each (T, S, head_dim, causal,
# strides, dtypes) is tuned once per process.
FWD_CONFIGS = _configs([(128, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2),
                        (64, 64, 4, 2)])
BWD_DKDV_CONFIGS = _configs([(32, 64, 4, 2), (64, 64, 4, 2), (32, 128, 8, 2), (64, 128, 8, 2), (32, 64, 4, 3),
                             (64, 64, 8, 3)])
BWD_DQ_CONFIGS = _configs([(64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2), (128, 64, 8, 2), (64, 32, 4, 3),
                           (128, 64, 4, 3)])
PRUNE = {"early_config_prune": _prune_fp32}
# Keyed on the sequence-axis stride of every tensor a kernel reads, so layouts tune apart: the model's (B, T, H,
# E) views against contiguous (B, H, T, E) blocks (ring attention), and dO's layout, which need not be q's
# (the autotuner adds the dtypes itself).
KEY = ["T_Q", "T_K", "HEAD_DIM", "CAUSAL", "stride_qt", "stride_kt", "stride_vt"]
BWD_KEY = KEY + ["stride_dot"]


# Only Triton *builtins* below, plus our own @triton.jit helpers: Triton's standard-library functions
# (tl.max, tl.sum, tl.zeros, tl.sigmoid, tl.cdiv) are @jit functions fixed to the interpreted-or-compiled
# mode of the process's first `import triton`, which would tie these kernels to it (see runtime.py).
_reduce = runtime.load_kernel_module("triton_reduce")  # built in this module's mode
_max_combine, _sum_combine = _reduce.max_combine, _reduce.sum_combine


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # acc + a @ b in fp32 (acc None: just a @ b). UPCAST: Triton 3.9's interpreter multiplies bf16 *bit
    # patterns* in tl.dot (numpy holds bf16 as uint16), so there bf16 operands are widened first. Never on GPU.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _key_tile_t(base, cols, offs_e, stride_t, stride_e, T_K, MASKED: tl.constexpr):
    # A key-side tile (K or V) transposed, (E, BLOCK_N): keys `cols`, zero past T_K when MASKED (the tail).
    ptrs = base + cols[None, :] * stride_t + offs_e[:, None] * stride_e
    if MASKED:
        tile = tl.load(ptrs, mask=cols[None, :] < T_K, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_ke, stride_vt, stride_ve,
               rows, offs_n, offs_e, lo, hi, T_K, scale_log2,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
               BLOCK_N: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kt = _key_tile_t(k_base, cols, offs_e, stride_kt, stride_ke, T_K, MASKED)  # (E, BLOCK_N)
        v_ptrs = v_base + cols[:, None] * stride_vt + offs_e[None, :] * stride_ve  # (BLOCK_N, E)
        if MASKED:
            v = tl.load(v_ptrs, mask=cols[:, None] < T_K, other=0.0)
        else:
            v = tl.load(v_ptrs)
        s = _dot(q, kt, None, UPCAST, PRECISION) * scale_log2  # (BLOCK_M, BLOCK_N), log2 domain
        if MASKED:
            keep = cols[None, :] < T_K
            if CAUSAL:
                keep = keep & (cols[None, :] <= rows[:, None])
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=FWD_CONFIGS, key=KEY, prune_configs_by=PRUNE)
@triton.jit
def _attn_fwd(Q, K, V, O, LSE,
              stride_qb, stride_qh, stride_qt, stride_qe,
              stride_kb, stride_kh, stride_kt, stride_ke,
              stride_vb, stride_vh, stride_vt, stride_ve,
              stride_ob, stride_oh, stride_ot, stride_oe,
              num_heads, group_size, T_Q, T_K, scale_log2,
              HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)  # b * H + h
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    kv_h = h // group_size  # query head h reads kv head h // (H / K)
    row0 = pid_m * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qt + offs_e[None, :] * stride_qe
    q = tl.load(q_ptrs, mask=rows[:, None] < T_Q, other=0.0)  # (BLOCK_M, E)
    k_base = K + b * stride_kb + kv_h * stride_kh
    v_base = V + b * stride_vb + kv_h * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
    if CAUSAL:  # tiles left of row0 are fully visible; the diagonal band needs the mask
        n_full = (row0 // BLOCK_N) * BLOCK_N
        hi = tl.minimum(T_K, row0 + BLOCK_M)
    else:  # all full tiles are visible; only the tail tile needs the bounds mask
        n_full = (T_K // BLOCK_N) * BLOCK_N
        hi = T_K
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_ke, stride_vt, stride_ve,
                               rows, offs_n, offs_e, 0, n_full, T_K, scale_log2,
                               False, CAUSAL, UPCAST, PRECISION, BLOCK_N)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_ke, stride_vt, stride_ve,
                               rows, offs_n, offs_e, n_full, hi, T_K, scale_log2,
                               True, CAUSAL, UPCAST, PRECISION, BLOCK_N)
    # Every row sees key 0 in its first tile, so l_i > 0 and m_i is finite here (no 0/0).
    out = acc / l_i[:, None]
    o_ptrs = O + b * stride_ob + h * stride_oh + rows[:, None] * stride_ot + offs_e[None, :] * stride_oe
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=rows[:, None] < T_Q)
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # back to natural log
    tl.store(LSE + pid_bh * T_Q + rows, lse, mask=rows < T_Q)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_base, do_base, LSE, DELTA, row_base, stride_qt, stride_qe, stride_dot, stride_doe,
                cols, offs_m, offs_e, lo, hi, T_Q, T_K, scale_log2,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr):
    # dK, dV of one key tile over the query tiles [lo, hi). Unmasked (MASKED false): whole query tiles that
    # see every key of the tile, no bounds or causal test; masked: the diagonal band and the tail tile.
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        q_ptrs = q_base + rows[:, None] * stride_qt + offs_e[None, :] * stride_qe
        do_ptrs = do_base + rows[:, None] * stride_dot + offs_e[None, :] * stride_doe
        if MASKED:
            row_ok = rows < T_Q
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)  # (BLOCK_M, E)
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
            lse_log2 = tl.load(LSE + row_base + rows, mask=row_ok, other=0.0) * 1.4426950408889634
            delta = tl.load(DELTA + row_base + rows, mask=row_ok, other=0.0)
        else:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse_log2 = tl.load(LSE + row_base + rows) * 1.4426950408889634
            delta = tl.load(DELTA + row_base + rows)
        s_t = _dot(k, tl.trans(q), None, UPCAST, PRECISION) * scale_log2  # (BLOCK_N, BLOCK_M)
        if MASKED:
            keep = row_ok[None, :] & (cols[:, None] < T_K)
            if CAUSAL:
                keep = keep & (rows[None, :] >= cols[:, None])
            p_t = tl.where(keep, tl.exp2(s_t - lse_log2[None, :]), 0.0)
        else:
            p_t = tl.exp2(s_t - lse_log2[None, :])
        dv = _dot(p_t.to(do.dtype), do, dv, UPCAST, PRECISION)
        dp_t = _dot(v, tl.trans(do), None, UPCAST, PRECISION)  # (BLOCK_N, BLOCK_M)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = _dot(ds_t.to(q.dtype), q, dk, UPCAST, PRECISION)
    return dk, dv


@triton.autotune(configs=BWD_DKDV_CONFIGS, key=BWD_KEY, prune_configs_by=PRUNE)
@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV,
                   stride_qb, stride_qh, stride_qt, stride_qe,
                   stride_kb, stride_kh, stride_kt, stride_ke,
                   stride_vb, stride_vh, stride_vt, stride_ve,
                   stride_dob, stride_doh, stride_dot, stride_doe,
                   stride_dkb, stride_dkh, stride_dkt, stride_dke,
                   num_heads, num_kv_heads, group_size, T_Q, T_K, scale, scale_log2,
                   HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bk = tl.program_id(1)  # b * K + kv_h
    b = pid_bk // num_kv_heads
    kv_h = pid_bk % num_kv_heads
    col0 = pid_n * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, HEAD_DIM)
    col_ok = cols[:, None] < T_K
    k = tl.load(K + b * stride_kb + kv_h * stride_kh + cols[:, None] * stride_kt + offs_e[None, :] * stride_ke,
                mask=col_ok, other=0.0)  # (BLOCK_N, E)
    v = tl.load(V + b * stride_vb + kv_h * stride_vh + cols[:, None] * stride_vt + offs_e[None, :] * stride_ve,
                mask=col_ok, other=0.0)
    dk = tl.full([BLOCK_N, HEAD_DIM], 0.0, dtype=tl.float32)
    dv = tl.full([BLOCK_N, HEAD_DIM], 0.0, dtype=tl.float32)
    # Query tiles: [lo, band) the causal diagonal band (masked), [band, full) whole tiles whose every row sees
    # every key of this tile (no mask), [max(band, full), T_Q) the tail tile (masked). Tiles on BLOCK_M's grid.
    lo = 0
    band = 0
    if CAUSAL:  # query tiles wholly above this key tile cannot see it
        lo = (col0 // BLOCK_M) * BLOCK_M
        band = lo + ((col0 + BLOCK_N - 1 - lo + BLOCK_M - 1) // BLOCK_M) * BLOCK_M  # first start >= last col
    full = (T_Q // BLOCK_M) * BLOCK_M
    for g in range(0, group_size):
        h = kv_h * group_size + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        row_base = (b * num_heads + h) * T_Q  # LSE and DELTA are contiguous (B, H, T)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, LSE, DELTA, row_base, stride_qt, stride_qe, stride_dot,
                             stride_doe, cols, offs_m, offs_e, lo, tl.minimum(band, T_Q), T_Q, T_K, scale_log2,
                             True, CAUSAL, UPCAST, PRECISION, BLOCK_M)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, LSE, DELTA, row_base, stride_qt, stride_qe, stride_dot,
                             stride_doe, cols, offs_m, offs_e, band, full, T_Q, T_K, scale_log2,
                             False, CAUSAL, UPCAST, PRECISION, BLOCK_M)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, LSE, DELTA, row_base, stride_qt, stride_qe, stride_dot,
                             stride_doe, cols, offs_m, offs_e, tl.maximum(band, full), T_Q, T_Q, T_K, scale_log2,
                             True, CAUSAL, UPCAST, PRECISION, BLOCK_M)
    dk = dk * scale
    out_off = b * stride_dkb + kv_h * stride_dkh + cols[:, None] * stride_dkt + offs_e[None, :] * stride_dke
    tl.store(DK + out_off, dk.to(DK.dtype.element_ty), mask=col_ok)
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=col_ok)  # DK and DV share one layout


@triton.jit
def _dq_tiles(dq, q, do, lse_log2, delta, k_base, v_base, stride_kt, stride_ke, stride_vt, stride_ve,
              rows, offs_n, offs_e, lo, hi, T_K, scale_log2,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_N: tl.constexpr):
    # dQ of one query tile over the key tiles [lo, hi): unmasked (MASKED false) for whole tiles every row
    # sees, masked for the diagonal band and the tail tile, as the forward's _fwd_tiles.
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kt = _key_tile_t(k_base, cols, offs_e, stride_kt, stride_ke, T_K, MASKED)  # (E, BLOCK_N)
        vt = _key_tile_t(v_base, cols, offs_e, stride_vt, stride_ve, T_K, MASKED)
        s = _dot(q, kt, None, UPCAST, PRECISION) * scale_log2  # (BLOCK_M, BLOCK_N)
        p = tl.exp2(s - lse_log2[:, None])
        if MASKED:
            keep = cols[None, :] < T_K
            if CAUSAL:
                keep = keep & (cols[None, :] <= rows[:, None])
            p = tl.where(keep, p, 0.0)
        dp = _dot(do, vt, None, UPCAST, PRECISION)
        ds = p * (dp - delta[:, None])
        dq = _dot(ds.to(kt.dtype), tl.trans(kt), dq, UPCAST, PRECISION)
    return dq


@triton.autotune(configs=BWD_DQ_CONFIGS, key=BWD_KEY, prune_configs_by=PRUNE)
@triton.jit
def _attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ,
                 stride_qb, stride_qh, stride_qt, stride_qe,
                 stride_kb, stride_kh, stride_kt, stride_ke,
                 stride_vb, stride_vh, stride_vt, stride_ve,
                 stride_dob, stride_doh, stride_dot, stride_doe,
                 stride_dqb, stride_dqh, stride_dqt, stride_dqe,
                 num_heads, group_size, T_Q, T_K, scale, scale_log2,
                 HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    kv_h = h // group_size
    row0 = pid_m * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, HEAD_DIM)
    row_ok = rows < T_Q
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qt + offs_e[None, :] * stride_qe,
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_dot + offs_e[None, :] * stride_doe,
                 mask=row_ok[:, None], other=0.0)
    lse_log2 = tl.load(LSE + pid_bh * T_Q + rows, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + pid_bh * T_Q + rows, mask=row_ok, other=0.0)
    k_base = K + b * stride_kb + kv_h * stride_kh
    v_base = V + b * stride_vb + kv_h * stride_vh
    dq = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
    if CAUSAL:  # key tiles left of row0 are wholly visible; the diagonal band needs the mask
        n_full = (row0 // BLOCK_N) * BLOCK_N
        hi = tl.minimum(T_K, row0 + BLOCK_M)
    else:  # whole key tiles are visible; the tail tile needs the bounds mask
        n_full = (T_K // BLOCK_N) * BLOCK_N
        hi = T_K
    dq = _dq_tiles(dq, q, do, lse_log2, delta, k_base, v_base, stride_kt, stride_ke, stride_vt, stride_ve,
                   rows, offs_n, offs_e, 0, n_full, T_K, scale_log2, False, CAUSAL, UPCAST, PRECISION, BLOCK_N)
    dq = _dq_tiles(dq, q, do, lse_log2, delta, k_base, v_base, stride_kt, stride_ke, stride_vt, stride_ve,
                   rows, offs_n, offs_e, n_full, hi, T_K, scale_log2, True, CAUSAL, UPCAST, PRECISION, BLOCK_N)
    dq = dq * scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqt + offs_e[None, :] * stride_dqe,
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])
