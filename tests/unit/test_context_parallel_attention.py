"""Ring and Ulysses attention on their own against full attention (gloo ranks, no model): outputs, the
log-sum-exp and the gradients of q, k, v for blocks of odd size, grouped-query heads, both ring backends
(plain torch in fp64; Triton fp32 under TRITON_INTERPRET=1), and the zig-zag sharding itself."""

import os

import pytest
import torch
import torch.distributed as dist

from raydist.kernels import runtime
from raydist.kernels.reference import attention_reference
from raydist.parallel.context import contiguous_positions, unshard_sequence, zigzag_positions
from raydist.parallel.runtime import spawn


def _inputs(seq_len, heads, kv_heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape_q, shape_kv = (2, heads, seq_len, head_dim), (2, kv_heads, seq_len, head_dim)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in (shape_q, shape_kv, shape_kv))
    # weights for a loss that reads every output and every lse entry: dloss/dout and dloss/dlse are random
    w_out = torch.randn(shape_q, generator=g, dtype=torch.float64).to(dtype)
    w_lse = torch.randn(shape_q[:3], generator=g, dtype=torch.float64)
    return q, k, v, w_out, w_lse


def _compare_ring(seq_len, heads, kv_heads, head_dim, backend, dtype_name, through_lse=True):
    """Max |difference| of out, lse, dq, dk, dv between ring attention on this rank's tokens and full
    attention computed on the whole sequence here; the loss reads the lse too unless not `through_lse` (as a
    model's: then the backward gets no lse gradient)."""
    if backend == "triton":
        os.environ["TRITON_INTERPRET"] = "1"
    from raydist.parallel.ring_attention import Ring, ring_attention

    dtype = getattr(torch, dtype_name)
    q, k, v, w_out, w_lse = _inputs(seq_len, heads, kv_heads, head_dim, dtype)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = attention_reference(*full, causal=True, return_lse=True)
    w_lse = w_lse if through_lse else torch.zeros_like(w_lse)
    ((out * w_out).sum() + (lse * w_lse.to(lse.dtype)).sum()).backward()

    ring = Ring(dist.group.WORLD)
    pos = zigzag_positions(seq_len, ring.size, ring.rank)
    local = [x[:, :, pos].clone().requires_grad_() for x in (q, k, v)]
    out_l, lse_l = ring_attention(*local, ring=ring, backend=backend, return_lse=True)
    loss = (out_l * w_out[:, :, pos]).sum()
    (loss + (lse_l * w_lse[:, :, pos].to(lse_l.dtype)).sum() if through_lse else loss).backward()
    # k/v gradients of this rank's tokens collect every rank's queries: compare them token by token
    pairs = {"out": (out_l, out[:, :, pos]), "lse": (lse_l, lse[:, :, pos])}
    for name, a, b in zip(("dq", "dk", "dv"), local, full):
        pairs[name] = (a.grad, b.grad[:, :, pos])
    return {name: float((a.detach().double() - b.detach().double()).abs().max()) for name, (a, b) in pairs.items()}


@pytest.mark.parametrize("cp,chunk", [(2, 3), (3, 5)], ids=["cp2-chunk3", "cp3-chunk5"])
def test_ring_attention_equals_full_attention_on_odd_blocks(cp, chunk):
    # 6 query heads on 2 kv heads (grouped-query); chunks of odd length, so blocks are 3 x 6, 5 x 10, ...
    for errors in spawn(_compare_ring, cp, 2 * cp * chunk, 6, 2, 8, "torch", "float64"):
        assert max(errors.values()) < 1e-10, errors


@pytest.mark.parametrize("cp,chunk,dtype,tolerance", [(2, 3, "float64", 1e-10), (3, 5, "float32", 2e-5)],
                         ids=["cp2-fp64", "cp3-fp32"])
def test_ring_attention_on_aten_blocks_equals_full_attention(cp, chunk, dtype, tolerance):
    # torch's fused blocks (the CPU's flash attention), head dim 80, grouped-query, odd chunks; the loss reads
    # the lse too, so the backward runs with a dlse term (the torch blocks then: see `_compare_ring`)
    for errors in spawn(_compare_ring, cp, 2 * cp * chunk, 6, 2, 80, "aten", dtype):
        assert max(errors.values()) < tolerance, errors
    for errors in spawn(_compare_ring, cp, 2 * cp * chunk, 6, 2, 80, "aten", dtype, False):
        assert max(errors.values()) < tolerance, errors


@pytest.mark.skipif(runtime.triton_import_error() is not None, reason="triton is not importable here")
def test_ring_attention_on_triton_blocks_equals_full_attention():
    # fp32 Triton blocks (interpreted on CPU), head dim 16 (the kernel's smallest), odd chunks of 3
    for errors in spawn(_compare_ring, 2, 12, 4, 2, 16, "triton", "float32"):
        assert max(errors.values()) < 2e-5, errors


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_tiled_torch_blocks_equal_full_attention(causal):
    # one block alone, keys in tiles of 2 over 7 keys (a short last tile), 6 query heads on 2 kv heads, fp64
    from raydist.parallel.attention_blocks import torch_backward, torch_forward

    q, k, v, w_out, w_lse = _inputs(7, 6, 2, 8, torch.float64)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = attention_reference(*full, causal=causal, return_lse=True) if causal else _full_noncausal(*full)
    ((out * w_out).sum() + (lse * w_lse).sum()).backward()
    out_t, lse_t = torch_forward(q, k, v, causal, tile=2)
    grads = torch_backward(w_out, q, k, v, out_t, lse_t, causal, grad_lse=w_lse, tile=2)
    assert float((out_t - out).abs().max()) < 1e-12 and float((lse_t - lse).abs().max()) < 1e-12
    for got, x in zip(grads, full):
        assert float((got - x.grad).abs().max()) < 1e-12


def _full_noncausal(q, k, v):
    from raydist.kernels.reference import repeat_kv

    scores = q @ repeat_kv(k, q.shape[1]).transpose(-2, -1) / q.shape[-1] ** 0.5
    lse = torch.logsumexp(scores, -1)
    return torch.exp(scores - lse[..., None]) @ repeat_kv(v, q.shape[1]), lse


def test_torch_block_memory_grows_linearly_with_the_sequence():
    # head dim 80 (the reference blocks, and the ring's backward when the lse has a gradient). Doubling T
    # doubles the peak (B, H, T, KEY_TILE) tiles; the (B, H, T, T) scores of a materialising block would
    # quadruple it, which the second check plants and sees caught
    from raydist.metrics.memory import LiveActivations
    from raydist.parallel.attention_blocks import torch_backward, torch_forward

    def peak(seq_len, tile=None):
        q, k, v, w_out, _ = _inputs(seq_len, 4, 2, 80, torch.float32)
        with LiveActivations(track_peak=True) as live:
            out, lse = torch_forward(q, k, v, True, tile=tile)
            torch_backward(w_out, q, k, v, out, lse, True, tile=tile)
        return live.peak_bytes

    small, large = peak(1024), peak(2048)
    assert large < 2.3 * small, (small, large)
    materialised_small, materialised_large = peak(1024, tile=1024), peak(2048, tile=2048)  # one tile: T x S
    assert materialised_large > 3.5 * materialised_small, (materialised_small, materialised_large)


def _compare_ulysses(seq_len, heads, kv_heads, head_dim):
    from raydist.parallel.ulysses import ulysses_attention

    q, k, v, w_out, _ = _inputs(seq_len, heads, kv_heads, head_dim, torch.float64)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attention_reference(*full, causal=True)
    (out * w_out).sum().backward()
    group = dist.group.WORLD
    pos = contiguous_positions(seq_len, dist.get_world_size(), dist.get_rank())
    local = [x[:, :, pos].clone().requires_grad_() for x in (q, k, v)]
    out_l = ulysses_attention(*local, group=group, inner=attention_reference)
    (out_l * w_out[:, :, pos]).sum().backward()
    gathered = unshard_sequence(out_l.detach(), "ulysses", group, dim=2)
    pairs = {"out": (out_l, out[:, :, pos]), "gathered out": (gathered, out)}
    for name, a, b in zip(("dq", "dk", "dv"), local, full):
        pairs[name] = (a.grad, b.grad[:, :, pos])
    return {name: float((a.detach().double() - b.detach().double()).abs().max()) for name, (a, b) in pairs.items()}


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1)], ids=["kv-split", "kv-repeated"])
def test_ulysses_equals_full_attention(heads, kv_heads):
    # kv_heads=1 is not divisible by cp=2: the kv head is repeated to 2, one per rank
    for errors in spawn(_compare_ulysses, 2, 10, heads, kv_heads, 8):
        assert max(errors.values()) < 1e-10, errors


def _gather_zigzag(seq_len):
    x = torch.arange(seq_len)[None, :, None].float()  # (1, T, 1)
    local = x[:, zigzag_positions(seq_len, dist.get_world_size(), dist.get_rank())]
    return unshard_sequence(local, "ring", dist.group.WORLD, dim=1).flatten().tolist()


def test_zigzag_sharding_balances_causal_work_and_round_trips():
    cp, seq_len = 4, 24
    shards = [zigzag_positions(seq_len, cp, r).tolist() for r in range(cp)]
    assert shards[0] == [0, 1, 2, 21, 22, 23] and shards[3] == [9, 10, 11, 12, 13, 14]
    assert sorted(sum(shards, [])) == list(range(seq_len))
    # causal work of a rank = the keys its queries see = sum of (position + 1): equal on every rank
    assert len({sum(p + 1 for p in shard) for shard in shards}) == 1
    contiguous = [contiguous_positions(seq_len, cp, r).tolist() for r in range(cp)]
    assert len({sum(p + 1 for p in shard) for shard in contiguous}) == cp  # unbalanced without zig-zag
    assert spawn(_gather_zigzag, 2, 12) == [list(map(float, range(12)))] * 2


def test_sharding_rejects_indivisible_lengths():
    with pytest.raises(ValueError, match=r"seq_len=30 is not divisible by 8"):
        zigzag_positions(30, 4, 0)
    with pytest.raises(ValueError, match=r"seq_len=10 is not divisible by 4"):
        contiguous_positions(10, 4, 0)
