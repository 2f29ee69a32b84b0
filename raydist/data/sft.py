"""Prompt/response data for supervised fine-tuning: only response tokens count in the loss.

`raydist data prepare` of a JSONL corpus (`*.jsonl`, one object per line with string fields `prompt` and
`response`) tokenizes each example as prompt + response + end-of-sequence and writes, beside each packed
row of `tokens`, a `loss_mask` row of the same length: 1 where the token is a response token (or the
closing end-of-sequence, so the model learns to stop), 0 for prompt tokens. Row r's targets are its
tokens 1..T, so mask[1..T] says which targets count.

The loss over a global batch is the mean over counted target tokens (as in instruction tuning, e.g.
Ouyang et al., 2022, "Training language models to follow instructions with human feedback"):

    loss = sum_{counted i} CE_i / N_counted          (N_counted over the whole global batch)

Every layout computes it the same way: each micro-batch's loss is sum_{counted local} CE_i / n_local (masked
tokens count as zero in the mean over all n_local local targets, exactly the quantity the unmasked
runners already average across micro-batches and data-parallel ranks), multiplied by the step's
N_targets / N_counted, a number all ranks agree on (one all-reduce of the counted targets over the
data-parallel ranks). So the averaging the runners and data-parallel strategies do anyway gives
sum CE / N_counted, whatever the split into ranks and micro-batches.

In memory the mask rides with the token rows: a target that does not count carries bit 32 (`NOT_TARGET`)
in the int64 row, so every path that moves rows (data-parallel slices, micro-batches) carries it
unchanged; `split_rows` turns a row block into (inputs, targets) with `IGNORE` for those targets. Storage
keeps the mask as its own parquet column.
"""

from __future__ import annotations

import json
from typing import Iterator

import fsspec
import numpy as np
import torch

from raydist.errors import ConfigError, DataError
from raydist.models.loss import IGNORE, cross_entropy

# IGNORE (-100, from the model module): the target id of a token that does not count
NOT_TARGET = 1 << 32  # in-memory flag on a token whose role as a target does not count
TOKEN_BITS = NOT_TARGET - 1


def is_jsonl(corpus: str) -> bool:
    return corpus.endswith(".jsonl")


def read_examples(uri: str) -> Iterator[tuple[str, str, str]]:
    """(name, prompt, response) of each line of a JSONL file; a DataError names the line and the fix."""
    with fsspec.open(uri, "r", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{uri} line {number}: not valid JSON ({exc})") from None
            if not isinstance(record, dict):
                raise DataError(f"{uri} line {number}: expected an object with 'prompt' and 'response'")
            for field in ("prompt", "response"):
                if not isinstance(record.get(field), str):
                    got = "missing" if field not in record else f"a {type(record[field]).__name__}"
                    raise DataError(f"{uri} line {number}: field {field!r} is {got}; each line needs string fields "
                                    "'prompt' and 'response'")
            yield f"{uri}#{number}", record["prompt"], record["response"]


def encode_example(tokenizer, prompt: str, response: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, loss_mask): prompt + response + end-of-sequence, mask 0 on the prompt, 1 after it."""
    p, r = tokenizer.encode(prompt), tokenizer.encode(response)
    tokens = np.concatenate([p, r, np.array([tokenizer.eos_id], np.int32)]).astype(np.int32)
    mask = np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(r) + 1, np.uint8)])
    return tokens, mask


def attach_mask(tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """int64 rows with NOT_TARGET set where mask == 0."""
    return tokens.astype(np.int64) | (mask == 0).astype(np.int64) * NOT_TARGET


def strip_mask(rows: torch.Tensor | np.ndarray):
    return rows & TOKEN_BITS


def split_rows(rows: torch.Tensor, masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T + 1) rows -> inputs (B, T), targets (B, T) (IGNORE where a target does not count)."""
    if not masked:
        return rows[:, :-1], rows[:, 1:]
    return strip_mask(rows[:, :-1]), as_targets(rows[:, 1:])


def as_targets(flagged: torch.Tensor) -> torch.Tensor:
    """Target ids with their flag bit -> target ids with IGNORE where the target does not count."""
    return torch.where(flagged >= NOT_TARGET, IGNORE, flagged)


def masked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """sum of the counted targets' cross-entropy / all targets (fp32): logits (B, T, V), targets (B, T).
    (`loss.cross_entropy` itself, and what every parallel plan's `loss_fn` computes.)"""
    return cross_entropy(logits, targets)


def check_masked_layout(live_recovery: bool) -> None:
    """Masked losses run under every parallel layout (DDP, FSDP, HSDP, TP with or without SP, CP, PP with
    every schedule); live recovery re-splits a step's rows across replicas by their count, which the
    counted-token scale does not follow yet: refuse it."""
    if live_recovery:
        raise ConfigError("prompt/response data (a loss mask) with elastic.live_recovery=true is not supported yet; "
                          "set elastic.live_recovery=false")
