"""What the Triton kernels do per tile, checked from inside the CPU interpreter, and their tuning settings.

- The attention's forward and both backward kernels apply the causal / bounds mask only to the tiles that
  need it (the diagonal band and the tails), and visit no tile that has nothing to see: each tile loop
  (`_fwd_tiles`, `_dq_tiles`, `_dkdv_tiles`) is wrapped in the interpreted module to record the tiles
  it walked and whether masked.
- Autotuning keys on the operands' strides: a linear's forward and its two transposed backward GEMMs
  are tuned apart even at a square shape where only the strides differ.
- No SwiGLU config that spills: two fp32 accumulators of a 128 x 128 tile over 4 warps need 256
  registers a thread (the limit is 255).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from raydist.kernels import runtime

pytestmark = pytest.mark.skipif(runtime.triton_import_error() is not None,
                                reason=f"triton not importable: {runtime.triton_import_error()}")


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reason = runtime.triton_unusable_reason("cpu")
    if reason is not None:
        pytest.skip(reason)


def _value(x):
    """A Python int / numpy array from an interpreter tensor (or the plain value)."""
    return x.handle.data if hasattr(x, "handle") else x


def _int(x) -> int:
    return int(np.asarray(x).reshape(-1)[0])  # (the interpreter holds a scalar as a 0-d or 1-element array)


def record_tiles(monkeypatch, module, name: str) -> list[dict]:
    """Wrap the @triton.jit tile loop `name` of the interpreted `module`: each call's arguments, by name."""
    original = getattr(module, name)
    signature = inspect.signature(original.fn)
    calls: list[dict] = []

    def wrapper(*args, **kwargs):
        calls.append({k: _value(v) for k, v in signature.bind(*args, **kwargs).arguments.items()})
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def _run_attention(t: int, s: int, causal: bool, heads=(2, 1)):
    from raydist.kernels.attention import attention_backward, attention_forward

    g = torch.Generator().manual_seed(0)
    h, kv = heads
    q = torch.randn(1, h, t, 16, generator=g)
    k, v = torch.randn(1, kv, s, 16, generator=g), torch.randn(1, kv, s, 16, generator=g)
    out, lse = attention_forward(q, k, v, causal)
    attention_backward(torch.randn_like(out), q, k, v, out, lse, causal)


def query_side_tiles(calls: list[dict]) -> list[tuple[int, dict[int, bool]]]:
    """[(query tile start, {key tile start: masked})] per program of _attn_fwd / _attn_bwd_dq: each program
    walks its key tiles in two calls (unmasked, then masked), and the interpreter runs programs in turn."""
    programs = []
    for first, second in zip(calls[::2], calls[1::2]):
        row0 = _int(first["rows"])
        assert _int(second["rows"]) == row0 and (first["MASKED"], second["MASKED"]) == (False, True)
        walked: dict[int, bool] = {}
        for c in (first, second):
            for start in range(_int(c["lo"]), _int(c["hi"]), c["BLOCK_N"]):
                assert start not in walked, f"key tile {start} walked twice for rows {row0}"
                walked[start] = bool(c["MASKED"])
        programs.append((row0, walked))
    return programs


@pytest.mark.parametrize("t,s,causal", [(40, 40, True), (24, 40, False), (32, 32, True)])
def test_attention_masks_only_the_tiles_that_need_it(interpreted, monkeypatch, t, s, causal):
    kernels = runtime.load_kernel_module("triton_attention")
    fwd = record_tiles(monkeypatch, kernels, "_fwd_tiles")
    dq = record_tiles(monkeypatch, kernels, "_dq_tiles")
    dkdv = record_tiles(monkeypatch, kernels, "_dkdv_tiles")
    _run_attention(t, s, causal)
    [config] = kernels.FWD_CONFIGS  # the interpreter's one config (triton_attention._configs)
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]

    def visible(r0, c0):  # some query row of the tile sees some key of the tile
        return r0 < t and c0 < s and (not causal or c0 <= min(r0 + bm - 1, t - 1))

    # forward and dQ: a query tile walks key tiles; the mask is needed where a key lies right of the tile's
    # first row (the diagonal) or past the keys' end (the tail); nowhere else
    for calls in (fwd, dq):
        programs = query_side_tiles(calls)
        assert sorted(r0 for r0, _ in programs) == sorted(list(range(0, t, bm)) * 2)  # 2 heads
        for r0, walked in programs:
            expected = {c0: (causal and c0 + bn - 1 > r0) or c0 + bn > s
                        for c0 in range(0, s, bn) if visible(r0, c0)}
            assert walked == expected, (r0, walked, expected)
    # dK, dV: a key tile walks the query tiles of every head of its group; masked where a query row lies
    # left of the tile's last key (the diagonal) or past the queries' end (a key tail needs none: its
    # rows are never stored)
    walked: dict[tuple[int, int], dict[int, bool]] = {}
    for c in dkdv:
        per = walked.setdefault((_int(c["cols"]), _int(c["row_base"])), {})
        for start in range(_int(c["lo"]), _int(c["hi"]), c["BLOCK_M"]):
            assert start not in per
            per[start] = bool(c["MASKED"])
    for (c0, _), per in walked.items():
        expected = {r0: (causal and r0 < c0 + bn - 1) or r0 + bm > t for r0 in range(0, t, bm) if visible(r0, c0)}
        assert per == expected, (c0, per, expected)
    assert {c0 for c0, _ in walked} == set(range(0, s, bn)) and len({rb for _, rb in walked}) == 2  # both heads
    if causal and t >= 2 * bm:  # the point of it: whole tiles below the diagonal run unmasked
        assert any(not m for per in walked.values() for m in per.values())


@pytest.fixture
def compiled(monkeypatch):
    """The kernel modules as built for a GPU (their settings only: nothing launches, no GPU needed)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return runtime.load_kernel_module("triton_attention"), runtime.load_kernel_module("triton_matmul")


def test_autotuning_keys_on_the_strides_of_every_operand(compiled):
    attention, matmul = compiled
    assert {"stride_am", "stride_ad", "stride_bd", "stride_bn"} <= set(matmul._matmul.keys)
    reads = {"_attn_fwd": ("q", "k", "v"), "_attn_bwd_dkdv": ("q", "k", "v", "do"), "_attn_bwd_dq": ("q", "k", "v", "do")}
    for name, tensors in reads.items():
        kernel = getattr(attention, name)
        for tensor in tensors:  # the sequence axis' stride: (B, T, H, E) views and contiguous (B, H, T, E)
            assert f"stride_{tensor}t" in kernel.keys and f"stride_{tensor}t" in kernel.fn.arg_names, (name, tensor)


def test_a_linears_forward_and_backward_gemms_tune_apart(interpreted, monkeypatch):
    """At M = N = D only the strides tell x W^T, dZ W and X^T dZ apart: three autotuning keys."""
    from raydist.kernels.matmul import linear

    kernels = runtime.load_kernel_module("triton_matmul")
    tuner = kernels._matmul
    keys = []
    run = tuner.run

    def recording_run(*args, **kwargs):
        named = dict(zip(tuner.arg_names, args), **kwargs)
        keys.append(tuple(named[k] for k in tuner.keys if k in named))
        return run(*args, **kwargs)

    monkeypatch.setattr(tuner, "run", recording_run)
    x = torch.randn(32, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)
    linear(x, w).sum().backward()
    assert len(keys) == 3 and len(set(keys)) == 3, keys


def test_no_swiglu_config_spills_registers(compiled):
    _, compiled = compiled
    assert compiled._matmul.early_config_prune is compiled._prune  # the prune is wired to the kernel
    bf16 = {"A": torch.empty(0, dtype=torch.bfloat16)}
    kept = compiled._prune(compiled.MATMUL_CONFIGS, bf16, SWIGLU=True)
    shapes = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps) for c in kept}
    assert (128, 128, 4) in {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps) for c in compiled.MATMUL_CONFIGS}
    assert (128, 128, 4) not in shapes and (128, 128, 8) in shapes
    for c in kept:  # two fp32 accumulators per thread: at most 128 of its 255 registers
        assert 2 * c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] / (32 * c.num_warps) <= 128, c
    assert compiled._prune(compiled.MATMUL_CONFIGS, bf16, SWIGLU=False) == compiled.MATMUL_CONFIGS
