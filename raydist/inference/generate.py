"""`raydist generate MODEL --prompt TEXT`: continue a prompt with a trained or pretrained model, one process.

MODEL is a run directory (its newest committed checkpoint, or `--step N`) or `hf:DIR`, loaded exactly as
`raydist eval` loads it (raydist.inference.load.load_model). The text is tokenized with
- `--tokenizer SPEC` when given (`byte`, a tokenizers JSON file, or `hf:DIR`);
- for `hf:DIR`, DIR/tokenizer.json (the prompt gets the file's special tokens, e.g. Llama's begin-of-text);
- for a run, the tokenizer its prepared data was made with (the manifest at run.json's data path), else
  data.tokenizer.

Decoding is autoregressive with a KV cache (raydist.models.gpt.KVCache): the prompt goes through the model
once, then each new token alone, attending over the cached keys and values; RoPE angles continue at the
cache's length. With temperature T = 0 the next token is the argmax of the logits (greedy); with T > 0 it is
drawn from softmax(logits / T) by a torch.Generator seeded with --seed, so a seed names one completion.
Generation stops after --max-new-tokens or at the end-of-sequence token (config.json's eos_token_id for
hf:DIR, else the tokenizer's end-of-document id), which is kept in the ids and left out of the text.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from raydist.config import ConfigError, hf_dir_of
from raydist.models.gpt import GPT, KVCache


def pick_token(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    """logits (V,) -> the next token: argmax when temperature == 0, else a draw from softmax(logits / T)."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate_ids(model: GPT, prompt: list[int], max_new_tokens: int, *, temperature: float = 0.0, seed: int = 0,
                 eos_ids: tuple[int, ...] = (), use_cache: bool = True) -> list[int]:
    """The new tokens after `prompt` (at most max_new_tokens; ends after an id in eos_ids).

    use_cache=False recomputes the whole sequence at every step (the reference the cache must equal).
    """
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    cache = KVCache() if use_cache else None
    new: list[int] = []
    feed = torch.tensor([prompt], device=device)  # (1, T): the prompt, then one token at a time
    for _ in range(max_new_tokens):
        if cache is not None:
            logits = model(feed, cache=cache)[0, -1]  # (V,)
        else:
            logits = model(torch.tensor([prompt + new], device=device))[0, -1]
        token = pick_token(logits.float(), temperature, generator)
        new.append(token)
        if token in eos_ids:
            break
        feed = torch.tensor([[token]], device=device)
    return new


def _hf_eos_ids(hf_dir: str) -> tuple[int, ...]:
    """config.json's eos_token_id (an int or a list), as transformers' generate stops on it."""
    try:
        eos = json.loads((Path(hf_dir) / "config.json").read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError):
        return ()
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


def resolve_tokenizer(model_spec: str, override: str | None):
    """(tokenizer, eos ids, add_special_tokens) for MODEL; ConfigError when it has none."""
    from raydist.data.tokenizer import get_tokenizer

    if model_spec.startswith("hf:"):
        hf_dir = hf_dir_of(model_spec)
        if not (Path(hf_dir) / "config.json").is_file():
            raise ConfigError(f"MODEL={model_spec!r}: {hf_dir} holds no config.json; give hf:DIR of a Hugging Face "
                              "Llama directory or a run directory")
        spec = override or f"hf:{hf_dir}"
        if override is None and not (Path(hf_dir) / "tokenizer.json").is_file():
            raise ConfigError(f"MODEL={model_spec!r} has no tokenizer.json; pass --tokenizer FILE (a tokenizers "
                              "JSON file) or 'byte'")
        tokenizer = get_tokenizer(spec)
        eos = _hf_eos_ids(hf_dir) or (tokenizer.eos_id,)
        return tokenizer, eos, True
    from raydist.data.prepare import read_manifest
    from raydist.inference.load import read_run_config, read_run_facts

    cfg = read_run_config(model_spec)  # ConfigError: not a run directory
    facts = read_run_facts(model_spec)
    data_path = facts.data_path if facts is not None else cfg.data.path
    spec = override
    if spec is None:
        manifest = read_manifest(data_path, missing_ok=True) if data_path else None
        spec = manifest["tokenizer"]["name"] if manifest else cfg.data.tokenizer
    tokenizer = get_tokenizer(spec)
    return tokenizer, (tokenizer.eos_id,), False


def cmd_generate(args) -> int:
    from raydist.inference.load import load_model

    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    if not args.temperature >= 0:
        raise ConfigError(f"--temperature={args.temperature} must be >= 0 (0: greedy)")
    tokenizer, eos_ids, special = resolve_tokenizer(args.model, args.tokenizer)
    prompt = [int(i) for i in tokenizer.encode(args.prompt, add_special_tokens=special)]
    if not prompt:
        raise ConfigError(f"--prompt={args.prompt!r} encodes to no tokens; give some text")
    loaded = load_model(args.model, len(prompt) + args.max_new_tokens, args.step)
    vocab = loaded.model.cfg.vocab_size
    if max(prompt) >= vocab:
        raise ConfigError(f"the prompt has token id {max(prompt)} (tokenizer {tokenizer.name}) but the model "
                          f"has vocab_size={vocab}; pass the model's own tokenizer with --tokenizer")
    new = generate_ids(loaded.model, prompt, args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                       eos_ids=eos_ids)
    text = tokenizer.decode([t for t in new if t not in eos_ids])
    if args.json:
        print(json.dumps({"model": args.model, "step": loaded.step, "prompt": args.prompt, "prompt_ids": prompt,
                          "completion": text, "completion_ids": new, "temperature": args.temperature,
                          "seed": args.seed, "stopped_at_eos": bool(new and new[-1] in eos_ids)}))
    else:
        print(text)
    return 0


def register_cli(sub) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a run's checkpoint or hf:DIR (KV cache)")
    p.add_argument("model", help="a run directory (its newest committed checkpoint) or hf:DIR")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sample from softmax(logits/T)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    p.add_argument("--step", type=int, help="this checkpoint of the run instead of the newest")
    p.add_argument("--tokenizer", help="'byte', a tokenizers JSON file or hf:DIR (default: the model's own)")
    p.add_argument("--json", action="store_true", help="one JSON line with prompt/completion ids and text")
    p.set_defaults(func=cmd_generate)
