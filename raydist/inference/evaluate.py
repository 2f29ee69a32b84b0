"""`raydist eval MODEL --data PATH`: mean next-token cross-entropy over every row of a prepared split, one
JSON line {"loss", "tokens", ...}: the same number transformers computes on those tokens. MODEL is loaded
by raydist.inference.load (a run directory or hf:DIR)."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from raydist.config import ConfigError, hf_dir_of
from raydist.data.sft import IGNORE, split_rows
from raydist.inference.load import load_model
from raydist.models.gpt import GPT


@torch.no_grad()
def evaluate_split(model: GPT, data_path: str, split: str = "val", batch_rows: int = 16) -> dict:
    """{"loss": mean next-token cross-entropy over every target token of the split (the response tokens of
    prompt/response data), "tokens": their count}."""
    from raydist.data.prepare import read_manifest
    from raydist.data.stream import Split, read_shard

    manifest = read_manifest(data_path)
    if manifest["tokenizer"]["vocab_size"] > model.cfg.vocab_size:
        raise ConfigError(f"{data_path} was tokenized with a vocabulary of {manifest['tokenizer']['vocab_size']} "
                          f"but the model has vocab_size={model.cfg.vocab_size}; prepare the data with the "
                          "model's tokenizer")
    if manifest["seq_len"] > model.max_seq_len:
        raise ConfigError(f"{data_path} has seq_len={manifest['seq_len']}, longer than the model's "
                          f"{model.max_seq_len} positions")
    data = Split.open(data_path, split, manifest)
    total, count = 0.0, 0
    for index in range(len(data.shards)):
        tokens = torch.from_numpy(read_shard(data, index).tokens)
        for rows in tokens.split(batch_rows):
            inputs, targets = split_rows(rows, data.masked)  # prompt/response data: only response targets count
            logits = model(inputs)  # (B, T, V)
            total += float(F.cross_entropy(logits.flatten(0, 1).double(), targets.flatten(), ignore_index=IGNORE,
                                           reduction="sum"))
            count += int((targets != IGNORE).sum())
    return {"loss": total / max(count, 1), "tokens": count}


def cmd_eval(args) -> int:
    from raydist.data.prepare import read_manifest

    manifest = read_manifest(args.data)
    if args.model.startswith("hf:"):  # data made with another tokenizer than DIR's tokenizer.json: refused
        from raydist.data.tokenizer import check_data_tokenizer

        check_data_tokenizer(hf_dir_of(args.model), manifest["tokenizer"], args.data)
    seq_len = manifest["seq_len"]
    loaded = load_model(args.model, seq_len, args.step)
    result = evaluate_split(loaded.model, args.data, args.split, args.batch_rows)
    result.update(model=args.model, step=loaded.step, split=args.split, data=args.data)
    print(json.dumps(result))
    return 0


def register_cli(sub) -> None:
    p = sub.add_parser("eval", help="mean token cross-entropy of a run's checkpoint or hf:DIR on a prepared split")
    p.add_argument("model", help="a run directory (its newest committed checkpoint) or hf:DIR")
    p.add_argument("--data", required=True, help="prepared data (a directory or URI holding manifest.json)")
    p.add_argument("--split", default="val", choices=("train", "val"))
    p.add_argument("--step", type=int, help="this checkpoint of the run instead of the newest")
    p.add_argument("--batch-rows", type=int, default=16, help="rows per forward")
    p.set_defaults(func=cmd_eval)
