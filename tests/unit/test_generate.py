"""`raydist generate`: the KV cache equals recomputing the sequence, greedy decoding equals transformers'
`generate(do_sample=False)` on the same weights and tokenizer, runs use their data's tokenizer, bad input is
one `error:` line."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import tokenizers  # noqa: F401  (the tests below build and read tokenizer.json files with it)
import torch
import transformers

from raydist.config import ModelConfig
from raydist.inference.generate import generate_ids
from raydist.models.gpt import KVCache, build_model
from raydist.testing import TINY_MODEL, save_tiny_hf, tiny_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT = "def wrap(text, width=70):\n    "


def train_bpe(vocab_size: int):
    """A byte-level BPE tokenizer of exactly `vocab_size` tokens trained on a standard-library module."""
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    with open(os.path.join(sysconfig.get_paths()["stdlib"], "textwrap.py")) as f:
        text = f.read()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    assert tok.get_vocab_size() == vocab_size
    return tok


@pytest.fixture(scope="module")
def llama_with_tokenizer(tmp_path_factory):
    """A transformers Llama (tiny shape, grouped-query attention, order-one weights) and its tokenizer.json."""
    path = tmp_path_factory.mktemp("llama-gen")
    save_tiny_hf(path, tied=False, seed=4)
    train_bpe(TINY_MODEL["vocab_size"]).save(str(path / "tokenizer.json"))
    return str(path)


@pytest.fixture(scope="module")
def qwen3_with_tokenizer(tmp_path_factory):
    """A transformers Qwen3 (heads of 32 on the 64-wide model, per-head q/k norms) and its tokenizer.json."""
    path = tmp_path_factory.mktemp("qwen3-gen")
    save_tiny_hf(path, family="qwen3", tied=True, seed=6, head_dim=32)
    train_bpe(TINY_MODEL["vocab_size"]).save(str(path / "tokenizer.json"))
    return str(path)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    from raydist.cli import main

    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _hf_model(path: str):
    from raydist.inference.load import load_model

    return load_model(f"hf:{path}", 64).model


# ---- the cache -------------------------------------------------------------------------------------


def test_cached_forward_equals_full_forward():
    """Logits of a sequence fed in pieces (5 tokens, then 1, 1, then 3) through a KV cache equal the
    full causal forward's at the same positions; the cache holds the K kv heads, not the repeated H."""
    cfg = ModelConfig(**TINY_MODEL)
    model = build_model(cfg, 16, seed=3).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)  # (B, T, V)
        cache = KVCache()
        pieces = [model(tokens[:, a:b], cache=cache) for a, b in [(0, 5), (5, 6), (6, 7), (7, 10)]]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 10
    k, v = cache.layers["0"]
    assert k.shape == v.shape == (2, cfg.num_kv_heads, 10, cfg.d_model // cfg.num_heads)
    assert cfg.num_kv_heads < cfg.num_heads  # grouped-query attention is what is tested
    with torch.no_grad():  # and positions matter: the same last token without its prefix gives other logits
        alone = model(tokens[:, 9:])
    assert (alone[:, 0] - full[:, 9]).abs().max() > 1e-3


@pytest.mark.parametrize("temperature, seed", [(0.0, 0), (0.8, 5)], ids=["greedy", "sampled"])
def test_generation_with_cache_equals_recomputing(llama_with_tokenizer, temperature, seed):
    model = _hf_model(llama_with_tokenizer)
    prompt = [5, 17, 200, 33, 91, 7]
    cached = generate_ids(model, prompt, 30, temperature=temperature, seed=seed)
    recomputed = generate_ids(model, prompt, 30, temperature=temperature, seed=seed, use_cache=False)
    print(f"T={temperature}: {cached}")
    assert cached == recomputed and len(cached) == 30
    assert len(set(cached)) > 3  # not a degenerate repetition that any bug would also produce
    if temperature > 0:  # the seed names the completion
        assert generate_ids(model, prompt, 30, temperature=temperature, seed=seed + 1) != cached
        assert cached != generate_ids(model, prompt, 30)


def test_generation_stops_at_eos(llama_with_tokenizer):
    model = _hf_model(llama_with_tokenizer)
    prompt = [5, 17, 200, 33, 91, 7]
    free = generate_ids(model, prompt, 12)
    stopped = generate_ids(model, prompt, 12, eos_ids=(free[3],))
    assert stopped == free[:free.index(free[3]) + 1]


# ---- against transformers ----------------------------------------------------------------------------


@pytest.mark.parametrize("model_dir, max_new_tokens", [("llama_with_tokenizer", 1), ("llama_with_tokenizer", 24),
                                                        ("qwen3_with_tokenizer", 24)])
def test_greedy_cli_equals_transformers_generate(request, capsys, model_dir, max_new_tokens):
    from tokenizers import Tokenizer

    path = request.getfixturevalue(model_dir)
    code, out, err = run_cli(capsys, "generate", f"hf:{path}", "--prompt", PROMPT,
                             "--max-new-tokens", str(max_new_tokens), "--json")
    assert code == 0, err
    got = json.loads(out.strip().splitlines()[-1])
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    assert got["prompt_ids"] == tok.encode(PROMPT).ids

    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model.generate(torch.tensor([got["prompt_ids"]]), do_sample=False, max_new_tokens=max_new_tokens,
                                pad_token_id=0)[0, len(got["prompt_ids"]):].tolist()
    print(f"raydist {got['completion_ids']}\ntransformers {theirs}\ntext {got['completion']!r}")
    assert got["completion_ids"] == theirs and len(theirs) == max_new_tokens
    assert got["completion"] == tok.decode(theirs)
    code, out, _ = run_cli(capsys, "generate", f"hf:{path}", "--prompt", PROMPT,
                           "--max-new-tokens", str(max_new_tokens))
    assert code == 0 and out == got["completion"] + "\n"  # without --json: the completion text


# ---- a run directory: its checkpoint and its data's tokenizer ------------------------------------------


def test_generate_from_run_uses_checkpoint_and_data_tokenizer(tiny_data, tmp_path, capsys):
    from raydist.config import Config
    from raydist.inference.load import load_model
    from raydist.testing import run_fit

    run_dir = str(tmp_path / "run")
    raw = tiny_config(tiny_data, train={"steps": 2}, checkpoint={"every_steps": 0, "async_save": False})
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "config.toml"), "w") as f:
        f.write(Config.from_dict(raw).to_toml())
    run_fit(raw, 1, run_dir)

    code, out, err = run_cli(capsys, "generate", run_dir, "--prompt", "import os\n", "--max-new-tokens", "16",
                             "--json", "--temperature", "1.0", "--seed", "2")
    assert code == 0, err
    got = json.loads(out.strip().splitlines()[-1])
    assert got["step"] == 2 and got["prompt_ids"] == list(b"import os\n")  # the data's byte tokenizer
    model = load_model(run_dir, 32).model
    expected = generate_ids(model, list(b"import os\n"), 16, temperature=1.0, seed=2, eos_ids=(256,),
                            use_cache=False)
    assert got["completion_ids"] == expected
    assert got["completion"] == bytes(t for t in expected if t < 256).decode("utf-8", errors="replace")


# ---- bad input -------------------------------------------------------------------------------------


def test_bad_inputs_are_one_error_line(llama_with_tokenizer, tmp_path, capsys):
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(llama_with_tokenizer, no_tokenizer)
    os.remove(no_tokenizer / "tokenizer.json")
    model = f"hf:{llama_with_tokenizer}"
    cases = [
        ([str(tmp_path / "nope"), "--prompt", "x"], "has no config.toml"),
        ([f"hf:{tmp_path}/nope", "--prompt", "x"], "holds no config.json"),
        ([f"hf:{no_tokenizer}", "--prompt", "x"], "has no tokenizer.json; pass --tokenizer"),
        ([model, "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens=0 must be >= 1"),
        ([model, "--prompt", "x", "--temperature", "-1"], "--temperature=-1.0 must be >= 0"),
        ([model, "--prompt", ""], "encodes to no tokens"),
        ([model, "--prompt", "x", "--tokenizer", str(tmp_path / "missing.json")], "not found"),
    ]
    for argv, match in cases:
        code, out, err = run_cli(capsys, "generate", *argv)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], (argv, err)


# ---- data.tokenizer = "hf:DIR": data prepared with the model's own tokenizer ------------------------------


def test_data_prepare_with_hf_dir_tokenizer(llama_with_tokenizer, tmp_path, capsys):
    """`raydist data prepare --tokenizer hf:DIR` tokenizes with DIR/tokenizer.json: the rows are that
    tokenizer's ids of the corpus (joined by its </s>), and `raydist eval hf:DIR` reads the data."""
    import numpy as np
    from tokenizers import Tokenizer

    from raydist.data.prepare import read_manifest
    from raydist.data.stream import Split, read_shard

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(300)))
    out = str(tmp_path / "prepared")
    code, _, err = run_cli(capsys, "data", "prepare", "--corpus", str(corpus), "--out", out, "--seq-len", "16",
                           "--tokenizer", f"hf:{llama_with_tokenizer}", "--set", "data.val_fraction=0.0")
    assert code == 0, err
    tok = Tokenizer.from_file(os.path.join(llama_with_tokenizer, "tokenizer.json"))
    manifest = read_manifest(out)
    assert manifest["tokenizer"]["vocab_size"] == TINY_MODEL["vocab_size"]
    assert manifest["tokenizer"]["eos_id"] == tok.token_to_id("</s>")
    data = Split.open(out, "train", manifest)
    rows = np.concatenate([read_shard(data, i).tokens for i in range(len(data.shards))])
    expected = tok.encode(corpus.read_text()).ids
    assert rows.reshape(-1).tolist() == expected[:rows.size] and rows.size > 100

    code, out_text, err = run_cli(capsys, "eval", f"hf:{llama_with_tokenizer}", "--data", out, "--split", "train")
    assert code == 0, err
    assert json.loads(out_text.strip().splitlines()[-1])["tokens"] == rows.shape[0] * 16

    code, _, err = run_cli(capsys, "data", "prepare", "--corpus", str(corpus), "--out", str(tmp_path / "p2"),
                           "--tokenizer", f"hf:{tmp_path}/no-model")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "no-model/tokenizer.json" in lines[0] and "hf:DIR" in lines[0], err
