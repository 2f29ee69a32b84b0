"""Hugging Face Llama <-> raydist conversion: logits equal both ways, name/layout round trips, refusals, slices."""

import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch  # noqa: F401  (raydist.models.hf reads and writes with it)
import torch
import transformers

from raydist.config import ConfigError, ModelConfig
from raydist.models import hf
from raydist.models.gpt import GPT, build_model

SHAPE = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128)
T = 24  # tokens per sequence in the logit comparisons
SMALL_SHARD = 20_000  # bytes: several shards for the tiny model (~100 kB in fp32)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Logits of order one: every matrix (embeddings too) ~ N(0, 1/D_in), norm gains ~ 1 + N(0, 0.2).

    The default inits (std 0.02, unit norms) give logits so small that a wrong RoPE layout would hide
    under a 1e-5 tolerance."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() == 1:
                p.copy_(1 + 0.2 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[1]))


def save_pretrained(model, path, **kw) -> None:
    # transformers 5 dropped `safe_serialization` (always safetensors); 4.x needs it for safetensors.
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kw["safe_serialization"] = True
    model.save_pretrained(str(path), **kw)


def hf_llama(tied: bool, theta: float, seed: int = 0):
    config = transformers.LlamaConfig(**SHAPE, tie_word_embeddings=tied, rope_theta=theta, rms_norm_eps=1e-5,
                                      max_position_embeddings=64, attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    randomize(model, seed)
    assert model.config._attn_implementation == "eager"
    return model


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens, use_cache=False).logits


def raydist_logits(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(tokens)


def small_cfg(**kw) -> ModelConfig:
    base = dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, ffn_hidden=128, vocab_size=96)
    return ModelConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    """An untied HF checkpoint saved in several shards with an index (used by the streaming tests)."""
    path = tmp_path_factory.mktemp("hf-untied")
    save_pretrained(hf_llama(tied=False, theta=10000.0, seed=3), path, max_shard_size=SMALL_SHARD)
    assert (path / hf.INDEX_FILE).is_file()
    return path


# ---- names and layouts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_name_mapping_round_trips_every_parameter(tied):
    ours = list(GPT(small_cfg(tie_embeddings=tied), 8).state_dict())
    assert ("output.weight" in ours) and ("tok_embeddings.weight" in ours)  # both keys, tied or not
    theirs = list(transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, tie_word_embeddings=tied))
                  .state_dict())
    assert sorted(hf.raydist_to_hf_name(n) for n in ours) == sorted(theirs)
    assert [hf.hf_to_raydist_name(hf.raydist_to_hf_name(n)) for n in ours] == ours
    assert [hf.raydist_to_hf_name(hf.hf_to_raydist_name(n)) for n in theirs] == theirs
    with pytest.raises(KeyError, match="gate_proj.bias"):
        hf.hf_to_raydist_name("model.layers.0.mlp.gate_proj.bias")


def test_rotary_permutation_is_per_head_and_inverse():
    cfg = small_cfg()  # head_dim 16
    w = torch.arange(64 * 3, dtype=torch.float32).reshape(64, 3)
    for name in ("layers.1.attention.wq.weight", "layers.0.attention.wk.weight"):
        h = hf.to_hf(name, w, cfg)
        assert torch.equal(hf.to_raydist(name, h, cfg), w)
        # head 1 (rows 16..31): the even rows then the odd rows
        assert torch.equal(h[16:32, 0], w[[16 + 2 * i for i in range(8)] + [17 + 2 * i for i in range(8)], 0])
    for name in ("layers.0.attention.wv.weight", "layers.0.attention.wo.weight", "tok_embeddings.weight"):
        assert hf.to_hf(name, w, cfg) is w and hf.to_raydist(name, w, cfg) is w


# ---- Hugging Face -> raydist --------------------------------------------------------------------------


@pytest.mark.parametrize("tied,theta,shard", [(True, 10000.0, False), (False, 500000.0, True),
                                              (True, 500000.0, True), (False, 10000.0, False)])
def test_hf_checkpoint_loads_with_identical_logits(tmp_path, tied, theta, shard):
    ref = hf_llama(tied, theta, seed=1)
    save_pretrained(ref, tmp_path, **({"max_shard_size": SMALL_SHARD} if shard else {}))
    assert (tmp_path / hf.INDEX_FILE).is_file() == shard

    fields = hf.model_config_from_hf(tmp_path)
    assert fields["rope_theta"] == theta and fields["tie_embeddings"] == tied and fields["d_model"] == 64
    model = build_model(ModelConfig(**fields), max_seq_len=64, seed=0)
    hf.load_hf_into(model, tmp_path)
    tokens = torch.randint(0, SHAPE["vocab_size"], (3, T), generator=torch.Generator().manual_seed(0))
    expected, got = hf_logits(ref, tokens), raydist_logits(model, tokens)
    assert expected.abs().max() > 1.0  # logits of order one: the comparison below means something
    diff = (got - expected).abs().max().item()
    print(f"hf->raydist tied={tied} theta={theta:g} shard={shard}: max abs logit diff {diff:.2e} "
          f"(max abs logit {expected.abs().max():.2f})")
    assert diff < 1e-5

    # Negative control: without the rotary permutation the logits are far off.
    with torch.no_grad():
        for layer in model.layers.values():
            layer.attention.wq.weight.copy_(hf.to_hf("layers.0.attention.wq.weight", layer.attention.wq.weight,
                                                     model.cfg))
    assert (raydist_logits(model, tokens) - expected).abs().max() > 1e-2


def test_slice_reads_equal_slices_of_the_converted_tensor(untied_dir):
    full = dict(hf.iter_hf_tensors(untied_dir))
    assert set(full) == set(GPT(small_cfg(tie_embeddings=False), 8).state_dict())
    for name, dim, start, stop in [("layers.1.attention.wq.weight", 0, 16, 48),  # heads 1 and 2
                                   ("layers.0.attention.wk.weight", 0, 16, 32),
                                   ("layers.0.attention.wk.weight", 1, 5, 37),  # columns: no alignment
                                   ("layers.1.feed_forward.w1.weight", 0, 7, 100),
                                   ("output.weight", 1, 0, 32), ("norm.weight", 0, 3, 9)]:
        part = hf.read_hf_slice(untied_dir, name, dim, start, stop)
        assert torch.equal(part, full[name].narrow(dim, start, stop - start)), name
    with pytest.raises(ValueError, match="whole heads"):
        hf.read_hf_slice(untied_dir, "layers.0.attention.wq.weight", 0, 8, 24)


def test_streaming_reads_one_named_tensor_and_tied_head_reads_embedding(tmp_path, untied_dir):
    [(name, tensor)] = list(hf.iter_hf_tensors(untied_dir, names=["layers.1.attention.wk.weight"]))
    assert name == "layers.1.attention.wk.weight" and tensor.shape == (32, 64)
    save_pretrained(hf_llama(tied=True, theta=10000.0), tmp_path)
    assert "output.weight" not in dict(hf.iter_hf_tensors(tmp_path))  # not stored
    [(_, emb), (_, head)] = hf.iter_hf_tensors(tmp_path, names=["tok_embeddings.weight", "output.weight"])
    assert torch.equal(emb, head)
    with pytest.raises(ConfigError, match="missing tensors.*layers.5.*model.layers.5.post_attention"):
        list(hf.iter_hf_tensors(tmp_path, names=["layers.5.ffn_norm.weight"]))


def _rewrite(path, edit) -> None:
    """Apply edit(dict of HF tensors) to a single-file checkpoint."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_load_errors_name_the_tensor(tmp_path):
    save_pretrained(hf_llama(tied=True, theta=10000.0), tmp_path)
    model = build_model(small_cfg(norm_eps=1e-5), 32, seed=0)

    _rewrite(tmp_path, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    hf.load_hf_into(model, tmp_path)  # a stored, equal head is fine
    _rewrite(tmp_path, lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"] + 1))
    with pytest.raises(ConfigError, match="lm_head.weight differs"):
        hf.load_hf_into(model, tmp_path)
    _rewrite(tmp_path, lambda t: t.pop("lm_head.weight"))

    _rewrite(tmp_path, lambda t: t.__setitem__("model.norm.weight", torch.ones(65)))
    with pytest.raises(ConfigError, match=r"model.norm.weight has shape \(65,\), raydist's norm.weight needs"):
        hf.load_hf_into(model, tmp_path)
    _rewrite(tmp_path, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(ConfigError, match=r"missing tensors \['norm.weight'\]"):
        hf.load_hf_into(model, tmp_path)
    _rewrite(tmp_path, lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.bias", torch.zeros(64)))
    with pytest.raises(ConfigError, match=r"unexpected tensors \[.layers.0.attention.wq.bias.\]"):  # a Qwen2 tensor
        hf.load_hf_into(model, tmp_path)
    with pytest.raises(ConfigError, match="model.norm_eps=1e-06 disagrees with .* rms_norm_eps=1e-05"):
        hf.load_hf_into(build_model(small_cfg(norm_eps=1e-6), 32, seed=0), tmp_path)


# ---- raydist -> Hugging Face --------------------------------------------------------------------------


@pytest.mark.parametrize("tied,theta,shard", [(True, 10000.0, False), (False, 500000.0, True),
                                              (True, 500000.0, True)])
def test_export_loads_in_transformers_with_identical_logits(tmp_path, tied, theta, shard):
    cfg = small_cfg(tie_embeddings=tied, rope_theta=theta, norm_eps=1e-6)
    model = build_model(cfg, max_seq_len=64, seed=7)
    randomize(model, seed=7)
    written = hf.save_hf(model.state_dict(), cfg, tmp_path, max_shard_bytes=SMALL_SHARD if shard else 5e9,
                         max_position_embeddings=64)
    assert (hf.INDEX_FILE in written) == shard and len(written) > (3 if shard else 1)
    index = json.loads((tmp_path / hf.INDEX_FILE).read_text()) if shard else None
    if shard:
        assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in model.parameters())
        assert set(index["weight_map"].values()) == {w for w in written if w.startswith("model-")}
    assert not list(tmp_path.glob(".*"))  # no temporary files left

    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    assert ref.config.tie_word_embeddings == tied and ref.config.head_dim == 16
    assert ref.model.rotary_emb.inv_freq[1].item() == pytest.approx(theta ** (-2 / 16))
    tokens = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    expected, got = raydist_logits(model, tokens), hf_logits(ref, tokens)
    assert expected.abs().max() > 1.0
    diff = (got - expected).abs().max().item()
    print(f"raydist->hf tied={tied} theta={theta:g} shard={shard}: max abs logit diff {diff:.2e} "
          f"(max abs logit {expected.abs().max():.2f})")
    assert diff < 1e-5

    # and back: the exported files load into raydist unchanged
    again = build_model(ModelConfig(**hf.model_config_from_hf(tmp_path)), 64, seed=0)
    hf.load_hf_into(again, tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_export_streams_casts_replaces_stale_files_and_copies_tokenizer(tmp_path):
    cfg = small_cfg()
    sd = build_model(cfg, 16, seed=0).state_dict()
    hf.save_hf(iter(sd.items()), cfg, tmp_path, max_shard_bytes=SMALL_SHARD)
    assert (tmp_path / hf.INDEX_FILE).exists()
    tok = tmp_path / "src-tokenizer.json"
    tok.write_text('{"model": {}}')
    written = hf.save_hf(((n, t) for n, t in sd.items()), cfg, tmp_path, dtype=torch.bfloat16,
                         tokenizer_json=tok)
    assert written == ["model.safetensors", "config.json", "tokenizer.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors", "src-tokenizer.json",
                                                         "tokenizer.json"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["architectures"] == ["LlamaForCausalLM"]
    assert {t.dtype for _, t in hf.iter_hf_tensors(tmp_path)} == {torch.bfloat16}
    with pytest.raises(ConfigError, match="output.weight differs"):
        hf.save_hf({**sd, "output.weight": sd["output.weight"] + 1}, cfg, tmp_path / "bad")
    with pytest.raises(ConfigError, match=r"missing tensors \['norm.weight'\]"):
        hf.save_hf({k: v for k, v in sd.items() if k != "norm.weight"}, cfg, tmp_path / "bad", max_shard_bytes=1)
    assert not list((tmp_path / "bad").iterdir())  # the shards written before the error are removed


# ---- config.json ---------------------------------------------------------------------------------------


def llama_json(**over) -> dict:
    base = {"model_type": "llama", **SHAPE, "hidden_act": "silu", "rms_norm_eps": 1e-5}
    return {k: v for k, v in {**base, **over}.items() if v is not ...}


def test_config_reads_transformers_4_and_5_forms(tmp_path):
    v4 = hf.model_config_from_hf(llama_json(rope_theta=500000.0, rope_scaling=None, num_key_value_heads=...))
    assert v4["rope_theta"] == 500000.0 and v4["num_kv_heads"] == 4 and v4["tie_embeddings"] is False
    v5 = hf.model_config_from_hf(llama_json(rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                                            head_dim=16, tie_word_embeddings=True))
    assert v5 == {**v4, "num_kv_heads": 2, "tie_embeddings": True}
    ModelConfig(**v5)  # every key is a ModelConfig field
    (tmp_path / "config.json").write_text(json.dumps(llama_json()))
    assert hf.model_config_from_hf(tmp_path)["rope_theta"] == 10000.0
    mistral = hf.model_config_from_hf(llama_json(model_type="mistral", sliding_window=None))
    assert mistral["d_model"] == 64 and mistral["family"] == "mistral" and v5["family"] == "llama"
    assert v5["head_dim"] == 0  # head_dim 16 = hidden_size / heads: the default
    assert hf.model_config_from_hf(llama_json(head_dim=32))["head_dim"] == 32  # set apart (as Qwen3-0.6B)


@pytest.mark.parametrize("over,match", [
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window=true: .* only qwen2 checkpoints "
                                                          "with use_sliding_window false load"),
    ({"model_type": "qwen3", "use_sliding_window": True}, "use_sliding_window=true"),
    ({"model_type": "gpt2"}, "model_type='gpt2' is not supported; raydist loads model_type 'llama', 'mistral', "
                             "'qwen2', 'qwen3'"),
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window=4096"),
    ({"model_type": "mistral"}, "sliding_window=4096 \\(default\\): .* with sliding_window null load"),
    ({"hidden_size": 66}, "hidden_size=66 is not divisible by num_attention_heads=4 and head_dim is not set"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling has rope_type='llama3'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling has rope_type='linear'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_parameters has rope_type='yarn'"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"intermediate_size": ...}, "intermediate_size=None must be an integer"),
])
def test_config_refusals(tmp_path, over, match):
    (tmp_path / "config.json").write_text(json.dumps(llama_json(**over)))
    with pytest.raises(ConfigError, match=match):
        hf.model_config_from_hf(tmp_path)


def test_explicit_model_keys_must_agree(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(llama_json()))
    from_hf = hf.model_config_from_hf(tmp_path)
    hf.check_explicit_keys({"d_model": 64, "rope_theta": 10000, "init_std": 0.1}, from_hf, f"hf:{tmp_path}")
    with pytest.raises(ConfigError, match=rf"^model.d_model=128 disagrees with hf:{tmp_path} config.json "
                                          r"hidden_size=64; remove model.d_model"):
        hf.check_explicit_keys({"num_layers": 2, "d_model": 128}, from_hf, f"hf:{tmp_path}")
    with pytest.raises(ConfigError, match="model.tie_embeddings=True disagrees .* tie_word_embeddings=False"):
        hf.check_explicit_keys({"tie_embeddings": True}, from_hf)


def test_import_needs_neither_transformers_nor_safetensors():
    code = ("import sys, raydist.models.hf; "
            "assert not {'transformers', 'safetensors'} & set(sys.modules), sorted(sys.modules)")
    root = str(Path(hf.__file__).parents[2])  # this checkout's raydist, whatever is installed
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": root})
