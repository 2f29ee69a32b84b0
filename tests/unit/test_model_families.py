"""The model families (raydist.families.registry) against `transformers`: Mistral, Qwen2/2.5 (q/k/v biases) and
Qwen3 (per-head q/k RMSNorm, a head dim apart from d_model / heads) load from a `save_pretrained` directory
with the logits `transformers` computes, export to a directory `transformers` loads with the original
model_type and the same logits, and greedy generation gives the same tokens."""

from __future__ import annotations

import json

import pytest
import safetensors.torch  # noqa: F401  (raydist.models.hf reads and writes with it)
import torch
import transformers

from raydist.config import ModelConfig
from raydist.inference.generate import generate_ids
from raydist.models import hf
from raydist.models.gpt import build_model
from raydist.families.registry import FAMILIES

from test_hf import SHAPE, hf_logits, randomize, raydist_logits, save_pretrained

T = 24


def hf_model(family: str, tied: bool, seed: int, head_dim: int | None = None):
    """A `transformers` model of `family` with order-one random weights (biases and head norms included)."""
    common = dict(**SHAPE, tie_word_embeddings=tied, rms_norm_eps=1e-6, max_position_embeddings=64,
                  attn_implementation="eager")
    config = {
        "mistral": lambda: transformers.MistralConfig(**common, sliding_window=None),
        "qwen2": lambda: transformers.Qwen2Config(**common, use_sliding_window=False),
        "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=head_dim or 16, use_sliding_window=False),
    }[family]()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomize(model, seed)
    return model


CASES = [("mistral", False, None), ("qwen2", True, None), ("qwen2", False, None), ("qwen3", True, None),
         ("qwen3", False, 32)]  # qwen3 at head_dim 32: q is 64 -> 4 x 32 = 128 wide, as Qwen3-0.6B's 1024 -> 2048
IDS = ["mistral", "qwen2-tied", "qwen2", "qwen3-tied", "qwen3-head32"]


@pytest.mark.parametrize("family,tied,head_dim", CASES, ids=IDS)
def test_checkpoint_loads_with_the_logits_of_transformers(tmp_path, family, tied, head_dim):
    ref = hf_model(family, tied, seed=1, head_dim=head_dim)
    save_pretrained(ref, tmp_path)
    fields = hf.model_config_from_hf(tmp_path)
    assert fields["family"] == family and fields["head_dim"] == (head_dim or 0)
    model = build_model(ModelConfig(**fields), max_seq_len=64, seed=0)
    extra = {n for n in model.state_dict() if n.endswith(".bias") or "q_norm" in n or "k_norm" in n}
    assert bool(extra) == (family != "mistral")  # the family's own tensors exist, and are read below
    hf.load_hf_into(model, tmp_path)
    tokens = torch.randint(0, SHAPE["vocab_size"], (3, T), generator=torch.Generator().manual_seed(0))
    expected, got = hf_logits(ref, tokens), raydist_logits(model, tokens)
    assert expected.abs().max() > 1.0
    diff = (got - expected).abs().max().item()
    print(f"{family} tied={tied} head_dim={head_dim}: max abs logit diff {diff:.2e}")
    assert diff < 1e-5
    # negative controls: the family's tensors matter, and their rotary layout does
    with torch.no_grad():
        for name in sorted(extra)[:1]:
            model.state_dict()[name].mul_(0.5)
    if extra:
        assert (raydist_logits(model, tokens) - expected).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_head_tensors_are_permuted_like_their_rows(tmp_path, family):
    """Biases of wq/wk and the q/k norm weights scale the coordinates RoPE pairs up: loading them without
    the rotary permutation changes the logits (the permutation is what makes them equal)."""
    ref = hf_model(family, tied=False, seed=2)
    save_pretrained(ref, tmp_path)
    model = build_model(ModelConfig(**hf.model_config_from_hf(tmp_path)), max_seq_len=64, seed=0)
    hf.load_hf_into(model, tmp_path)
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, T), generator=torch.Generator().manual_seed(3))
    expected = hf_logits(ref, tokens)
    name = "attention.wq.bias" if family == "qwen2" else "attention.q_norm.weight"
    with torch.no_grad():
        for layer in model.layers.values():
            p = layer.get_parameter(name)
            p.copy_(hf.to_hf(f"layers.0.{name}", p, model.cfg))  # the Hugging Face order, unpermuted
    assert (raydist_logits(model, tokens) - expected).abs().max() > 1e-3


@pytest.mark.parametrize("family,tied,head_dim", CASES, ids=IDS)
def test_export_loads_in_transformers_with_its_model_type_and_the_same_logits(tmp_path, family, tied, head_dim):
    fields = dict(family=family, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, ffn_hidden=128,
                  vocab_size=96, tie_embeddings=tied, norm_eps=1e-6, head_dim=head_dim or 0)
    cfg = ModelConfig(**fields)
    model = build_model(cfg, max_seq_len=64, seed=7)
    randomize(model, seed=7)
    hf.save_hf(model.state_dict(), cfg, tmp_path, max_position_embeddings=64)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == FAMILIES[family].hf_model_type
    assert written["architectures"] == [FAMILIES[family].hf_architecture]
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    assert type(ref).__name__ == FAMILIES[family].hf_architecture
    tokens = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    expected, got = raydist_logits(model, tokens), hf_logits(ref, tokens)
    assert expected.abs().max() > 1.0
    assert (got - expected).abs().max().item() < 1e-5
    again = build_model(ModelConfig(**hf.model_config_from_hf(tmp_path)), 64, seed=0)
    hf.load_hf_into(again, tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    # greedy decoding with raydist's KV cache picks the tokens transformers' generate picks
    prompt = tokens[0, :8].tolist()
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12,
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert generate_ids(model.eval(), prompt, 12) == theirs
