"""The fused loss's per-chunk elementwise work as Triton kernels (kernels/triton_cross_entropy.py), with the
interface of models.loss.TORCH_CHUNKS: `kernels.loss = triton` runs the fused loss with these. The matmuls
stay torch's (cuBLAS on a GPU); what the kernels replace is the passes over each (rows, V) chunk of
logits: one pass for the log-sum-exp and the target's logit, one in-place pass turning the logits into
their gradient in the matmul's dtype (no fp32 copy of the chunk)."""

from __future__ import annotations

import torch

from raydist.kernels import runtime
from raydist.models.loss import ChunkOps


def _check(z: torch.Tensor) -> None:
    if z.dim() != 2 or z.stride(1) != 1:
        raise ValueError(f"a chunk of logits must be (rows, V) with contiguous rows, got {tuple(z.shape)} "
                         f"strides {z.stride()}")
    if z.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"logits of dtype {z.dtype}; the loss kernels take fp32, fp16 or bf16")
    runtime.check_tensor_device(z, "logits")


def row_stats(z: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp over each row of z (rows, V), z[row, index[row]]), both fp32 (rows,)."""
    _check(z)
    k = runtime.load_kernel_module("triton_cross_entropy")
    rows = z.shape[0]
    lse = torch.empty(rows, dtype=torch.float32, device=z.device)
    picked = torch.empty(rows, dtype=torch.float32, device=z.device)
    k._row_stats[(rows,)](z, z.stride(0), index.contiguous(), lse, picked, z.shape[1], BLOCK_V=k.BLOCK_V,
                          num_warps=k.NUM_WARPS)
    return lse, picked


def softmax_grad_(z: torch.Tensor, lse: torch.Tensor, index: torch.Tensor, hit: torch.Tensor,
                  scale: torch.Tensor) -> torch.Tensor:
    """z <- (softmax(z) - one_hot(index) where hit) * scale per row, in place (z's dtype); returns z."""
    _check(z)
    k = runtime.load_kernel_module("triton_cross_entropy")
    k._softmax_grad[(z.shape[0],)](z, z.stride(0), lse.contiguous(), index.contiguous(),
                                   hit.to(torch.int8).contiguous(), scale.float().contiguous(), z.shape[1],
                                   BLOCK_V=k.BLOCK_V, num_warps=k.NUM_WARPS)
    return z


TRITON_CHUNKS = ChunkOps(row_stats, softmax_grad_)
