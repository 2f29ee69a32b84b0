"""The training loss, apart from any one model: next-token cross-entropy over logits (B, T, V) in fp32,
with IGNORE targets (prompt tokens of prompt/response data) counting as zero. Tensor parallelism's
vocabulary-parallel form is raydist.parallel.vocab_loss; both divide by the same count."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100  # target id of a token that does not count (prompt tokens of prompt/response data)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token loss in fp32, logits (B, T, V), targets (B, T): the sum over counted targets / all B T
    targets, an IGNORE target counting as zero (the plain mean when every target counts). Dividing by all
    targets, not the counted ones, keeps every micro-batch's weight its share of the rows; the runners
    rescale by the step's targets / counted targets (raydist.data.sft)."""
    total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), ignore_index=IGNORE,
                            reduction="sum")
    return total / targets.numel()


# ---- the head's matmul and the loss together, chunk by chunk of tokens ---------------------------------

LOGITS_CHUNK_BYTES = 32 * 2**20  # fp32 logits of one chunk of tokens (V = 128256: 65 tokens, 32 MiB)


def chunk_rows(vocab: int, chunk_bytes: int = LOGITS_CHUNK_BYTES) -> int:
    """Tokens per chunk of `linear_cross_entropy`: as many as fit `chunk_bytes` of fp32 logits, at least one."""
    return max(1, chunk_bytes // (4 * vocab))


def matmul_dtype(h: torch.Tensor) -> torch.dtype:
    """What F.linear would compute in here: autocast's dtype where autocast is on, else the input's."""
    device = h.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    """cross_entropy(h W^T, targets) without the (N, V) logits: the forward keeps each token's log-sum-exp
    (N floats), the backward recomputes one chunk's logits at a time, turns them into the softmax minus the
    one-hot target (the gradient of the logits) and multiplies it straight into dh and dW. One more matmul
    than the plain loss (the logits twice), for (rows, V) fp32 at a time instead of (N, V) and its gradient
    (the chunked loss of Liger-Kernel, Hsu et al. 2024, with the recompute of FlashAttention's backward)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
        cd = matmul_dtype(h)
        n = h.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(cd)
            for s in range(0, n, rows):
                z = (h[s:s + rows].to(cd) @ w.t()).float()  # (rows, V), as F.linear + .float() give them
                t = targets[s:s + rows]
                lse_c = torch.logsumexp(z, dim=-1)
                picked = z.gather(1, t.clamp(min=0)[:, None]).squeeze(1)
                total += torch.where(t != IGNORE, lse_c - picked, 0.0).sum()
                lse[s:s + rows] = lse_c
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.rows, ctx.cd = rows, cd
        return total / n

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, weight, targets, lse = ctx.saved_tensors
        rows, cd, n = ctx.rows, ctx.cd, h.shape[0]
        want_h, want_w = ctx.needs_input_grad[:2]
        dh = torch.empty_like(h) if want_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        scale = grad.float() / n
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(cd)
            for s in range(0, n, rows):
                hc, t = h[s:s + rows].to(cd), targets[s:s + rows]
                # in place from here: one (rows, V) fp32 buffer (and its cast under bf16)
                dz = (hc @ w.t()).float().sub_(lse[s:s + rows, None]).exp_()  # the softmax
                dz.scatter_add_(1, t.clamp(min=0)[:, None], -torch.ones_like(dz[:, :1]))  # minus the one-hot
                dz.mul_(torch.where(t != IGNORE, scale, 0.0)[:, None])
                dz = dz.to(cd)  # the logits' gradient in the logits' dtype, as the plain loss hands it on
                if want_h:
                    dh[s:s + rows] = (dz @ w).to(h.dtype)
                if want_w and dz.dtype == dw.dtype:
                    dw.addmm_(dz.t(), hc)
                elif want_w:
                    dw += (dz.t() @ hc).float()
        return dh, None if dw is None else dw.to(weight.dtype), None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         rows: int | None = None) -> torch.Tensor:
    """`cross_entropy(F.linear(h, weight), targets)` for h (B, T, D), weight (V, D), targets (B, T), with
    at most `rows` tokens' logits (default: `chunk_rows(V)`, 32 MiB of fp32) alive at once, in the forward
    and in the backward: the same loss and gradients (to fp32 rounding) without the (B, T, V) logits and
    their gradient. Under autocast the matmuls run in autocast's dtype, as F.linear's would."""
    flat_h, flat_t = h.flatten(0, 1), targets.flatten(0, 1)
    return _LinearCrossEntropy.apply(flat_h, weight, flat_t, rows or chunk_rows(weight.shape[0]))
