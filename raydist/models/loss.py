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
