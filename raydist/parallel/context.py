"""Context parallelism: the sequence split across the cp mesh axis, attention made whole again.

    apply_context_parallel(model, mesh, impl)   # parallelize() calls this when cp > 1

installs a cp attention on every block. Each cp rank is given only its own tokens: inputs (B, T/cp), targets
(B, T/cp) and their positions (T/cp,) in the full sequence, which index the model's RoPE tables
(`POSITIONS` below says which; raydist.data.peers sends each rank those columns of its rows and no others).

- `parallel.cp_impl = ring` (ring_attention.py): zig-zag sharding (rank r holds chunks r and 2cp-1-r of
  2cp equal chunks) so causal work is equal on every rank; K/V blocks travel around the ring.
- `parallel.cp_impl = ulysses` (ulysses.py): contiguous sharding; all-to-all to head shards, the model's
  own causal attention on whole sequences, all-to-all back.

Everything outside attention is per token, so it runs unchanged on the local tokens. The loss is each
rank's mean over its T/cp tokens, and FSDP averages gradients over dp_shard x cp: equal token counts on
every cp rank (both shardings give T/cp) make that the mean over the whole sequence. The cp ranks hold the
same parameters (FSDP shards them over dp_shard x cp; mesh.py).

Attention backends: ring attention runs the Triton flash-attention blocks on CUDA (where the head dim is one the
kernel supports) and wherever the model's attention is the Triton kernel (TRITON_INTERPRET=1 on a CPU), and
plain-torch blocks otherwise (`ring_backend_for`);
Ulysses wraps whichever attention the model has. Under tensor parallelism both see H/tp local heads.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist

from raydist.parallel.mesh import Mesh

IMPLEMENTATIONS = ("ring", "ulysses")


def zigzag_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Positions (T/cp,) rank `rank` holds under ring sharding: chunks rank and 2cp-1-rank of size T/(2cp)."""
    if seq_len % (2 * cp):
        raise ValueError(f"ring attention splits the sequence into 2 x cp = {2 * cp} equal chunks, but seq_len="
                         f"{seq_len} is not divisible by {2 * cp}; make data.seq_len a multiple of {2 * cp}")
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat((torch.arange(first, first + chunk), torch.arange(second, second + chunk)))


def contiguous_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Positions (T/cp,) rank `rank` holds under Ulysses sharding: [rank T/cp, (rank+1) T/cp)."""
    if seq_len % cp:
        raise ValueError(f"Ulysses splits the sequence into cp={cp} equal shards, but seq_len={seq_len} is not "
                         f"divisible by {cp}; make data.seq_len a multiple of {cp}")
    local = seq_len // cp
    return torch.arange(rank * local, (rank + 1) * local)


POSITIONS = {"ring": zigzag_positions, "ulysses": contiguous_positions}


def unshard_sequence(local: torch.Tensor, impl: str, group, dim: int = 1) -> torch.Tensor:
    """The inverse of the sharding (all-gather, then reorder): local (..., T/cp, ...) -> (..., T, ...) on
    every cp rank. Not used in training; tests and tools use it to compare with a single-process run."""
    cp = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    seq_len = local.shape[dim] * cp
    order = torch.cat([POSITIONS[impl](seq_len, cp, r) for r in range(cp)])
    gathered = torch.cat(parts, dim=dim)  # in rank order: position order[i] is at index i
    full = torch.empty_like(gathered)
    full.index_copy_(dim, order.to(local.device), gathered)
    return full


def context_attention(impl: str, group, inner: Callable, backend: str) -> Callable:
    """The `attention_fn(q, k, v)` for `impl` on the cp process group `group`."""
    if impl == "ring":
        from raydist.parallel.ring_attention import Ring, ring_attention

        return functools.partial(ring_attention, ring=Ring(group), backend=backend)
    if impl == "ulysses":
        from raydist.parallel.ulysses import ulysses_attention

        return functools.partial(ulysses_attention, group=group, inner=inner)
    raise ValueError(f"parallel.cp_impl={impl!r} is not one of {', '.join(IMPLEMENTATIONS)}")


def ring_backend_for(attention_fn: Callable, device_type: str, head_dim: int) -> str:
    """'triton' when the model runs the Triton attention kernel (kernels.select installed it, CUDA or the CPU
    interpreter), or on CUDA wherever that kernel can run this head dim; else 'aten'. Ring attention needs
    per-block attention that returns the log-sum-exp, which SDPA's public call (the model's attention under
    `kernels.attention = auto`) does not: the blocks are the Triton flash kernel, or torch's own fused
    kernels that return it (CUDA's memory-efficient attention for any head dim, the CPU's flash attention;
    attention_blocks.py). Never a (T, S) score matrix, the memory context parallelism exists to save."""
    from raydist.kernels import runtime
    from raydist.kernels.attention import SUPPORTED_HEAD_DIMS, triton_causal_attention

    if attention_fn is triton_causal_attention:
        return "triton"
    cuda_flash = device_type == "cuda" and head_dim in SUPPORTED_HEAD_DIMS
    return "triton" if cuda_flash and runtime.triton_unusable_reason("cuda") is None else "aten"


def apply_context_parallel(model, mesh: Mesh, impl: str) -> None:
    """Install cp attention (`impl`: ring | ulysses) on every block of `model` (after tensor parallelism,
    before checkpointing and FSDP); the step runner gives it this rank's tokens (`POSITIONS`)."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"parallel.cp_impl={impl!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    cp_mesh = mesh["cp"]
    group = cp_mesh.get_group()
    model.set_sequence_group(group)  # per-sequence statistics (a mixture of experts' balance loss) span cp
    for block in model.layers.values():
        inner = block.attention.attention_fn
        backend = ring_backend_for(inner, mesh.device_type, block.attention.head_dim)
        block.attention.attention_fn = context_attention(impl, group, inner, backend)
