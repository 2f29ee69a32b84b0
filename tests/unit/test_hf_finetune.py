"""Fine-tuning real models: `model.init_from = "hf:DIR"` loads into every layout's shards, `raydist eval`
equals transformers' loss, and exports from FSDP / TP / PP runs load in transformers with equal logits."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from raydist.config import Config, ConfigError
from raydist.parallel.runtime import spawn
from raydist.testing import save_tiny_hf, tiny_config
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def hf_data(tmp_path_factory) -> str:
    """Prepared data for this file (byte-level, seq_len 32): conftest's tiny_data without its validation
    split of 229,120 tokens (one 229 KB document, _pydecimal.py), which every `raydist eval` here and its
    transformers reference read whole, twice per test. The first 0.72 MB of the stdlib with 10% held out:
    a validation split of 18,176 tokens (568 rows, _threading_local.py and asynchat.py) in 5 shards, still
    over the 10,000 tokens the eval test requires; training reads the 694,016 tokens of its train split."""
    from raydist.config import DataConfig
    from raydist.data.prepare import prepare

    out = str(tmp_path_factory.mktemp("data") / "stdlib-s32-val18k")
    prepare(DataConfig(corpus="stdlib", seq_len=32, max_corpus_mb=0.72, shard_rows=128, val_fraction=0.1),
            out, log=lambda *_: None)
    return out


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    """transformers directories of the tiny shape: Llama tied, and untied saved in several shards; Qwen3
    untied with heads of 32 on the 64-wide model (its q_norm/k_norm vectors of 32 split under FSDP 2 into
    halves the rotary permutation mixes: read widened to the whole head); Qwen2 tied (q/k/v biases)."""
    tied = tmp_path_factory.mktemp("llama-tied")
    untied = tmp_path_factory.mktemp("llama-untied")
    save_tiny_hf(tied, tied=True, seed=1)
    model = save_tiny_hf(untied, tied=False, seed=2)
    model.save_pretrained(str(untied), max_shard_size="100KB")  # several files with an index
    assert (untied / "model.safetensors.index.json").is_file()
    qwen3, qwen2 = tmp_path_factory.mktemp("qwen3"), tmp_path_factory.mktemp("qwen2")
    save_tiny_hf(qwen3, family="qwen3", tied=False, seed=8, head_dim=32)
    save_tiny_hf(qwen2, family="qwen2", tied=True, seed=9)
    return {"tied": str(tied), "untied": str(untied), "qwen3": str(qwen3), "qwen2": str(qwen2)}


def _full_parameters(raw: dict) -> dict[str, torch.Tensor]:
    from raydist.parallel.runtime import pick_device
    from raydist.training.trainer import Trainer

    trainer = Trainer(Config.from_dict(raw), pick_device())
    try:
        return trainer.full_parameters()
    finally:
        trainer.close()


@pytest.mark.parametrize("parallel, world", [({}, 1), ({"dp_shard": 2}, 2), ({"tp": 2}, 2), ({"pp": 2}, 2)],
                         ids=["single", "fsdp2", "tp2", "pp2"])
@pytest.mark.parametrize("kind", ["tied", "untied", "qwen3"])
def test_init_from_loads_every_layout_exactly(hf_data, llama_dirs, parallel, world, kind):
    from raydist.models.hf import iter_hf_tensors

    raw = tiny_config(hf_data, model={"init_from": f"hf:{llama_dirs[kind]}"}, parallel=parallel)
    expected = dict(iter_hf_tensors(llama_dirs[kind]))
    for rank_params in spawn(_full_parameters, world, raw):
        assert rank_params
        for name, tensor in rank_params.items():
            source = "tok_embeddings.weight" if kind in ("tied", "qwen2") and name == "output.weight" else name
            assert torch.equal(tensor, expected[source]), name


# ---- raydist eval ------------------------------------------------------------------------------------


def _split_rows(data_path: str, split: str = "val") -> torch.Tensor:
    from raydist.data.stream import Split, read_shard

    data = Split.open(data_path, split)
    return torch.cat([torch.from_numpy(read_shard(data, i).tokens) for i in range(len(data.shards))])


def transformers_loss(model_dir: str, rows: torch.Tensor) -> float:
    """Mean next-token cross-entropy of transformers' model on `rows` (N, T + 1), summed in float64."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager",
                                                              dtype=torch.float32).eval()
    total = 0.0
    with torch.no_grad():
        for chunk in rows.split(32):
            logits = model(input_ids=chunk[:, :-1], use_cache=False).logits
            total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), chunk[:, 1:].flatten(),
                                                             reduction="sum"))
    return total / rows[:, 1:].numel()


def run_cli(capsys, *argv) -> dict:
    from raydist.cli import main

    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["tied", "untied", "qwen3", "qwen2"])
def test_eval_of_hf_dir_equals_transformers_loss(hf_data, llama_dirs, capsys, kind):
    rows = _split_rows(hf_data)
    got = run_cli(capsys, "eval", f"hf:{llama_dirs[kind]}", "--data", hf_data)
    expected = transformers_loss(llama_dirs[kind], rows)
    print(f"eval hf:{kind}: raydist {got['loss']:.6f} transformers {expected:.6f} over {got['tokens']} tokens")
    assert got["tokens"] == rows[:, 1:].numel() > 10_000
    assert abs(got["loss"] - expected) / expected < 1e-4
    assert got["loss"] > 3.0  # random order-one weights: far from a trained model, so the check is not vacuous


def _val_loss(raw: dict) -> float:
    from raydist.parallel.runtime import pick_device
    from raydist.training.trainer import Trainer

    trainer = Trainer(Config.from_dict(raw), pick_device())
    try:
        return trainer.evaluate()
    finally:
        trainer.close()


@pytest.mark.parametrize("parallel", [{"dp_shard": 2}, {"tp": 2}], ids=["fsdp2", "tp2"])
def test_loading_under_fsdp_and_tp_gives_transformers_loss(hf_data, llama_dirs, parallel):
    raw = tiny_config(hf_data, model={"init_from": f"hf:{llama_dirs['untied']}"}, parallel=parallel,
                      train={"eval_every": 1, "eval_batches": 2, "global_batch": 8})
    rows = _split_rows(hf_data)[:16]  # eval_batches x global_batch rows, in file order
    expected = transformers_loss(llama_dirs["untied"], rows)
    for loss in spawn(_val_loss, 2, raw):
        assert abs(loss - expected) / expected < 1e-4, (loss, expected)


def test_init_from_errors(tmp_path, llama_dirs, hf_data):
    d = llama_dirs["tied"]
    with pytest.raises(ConfigError, match=r"model.d_model=128 disagrees with hf:.* hidden_size=64"):
        Config.from_dict(tiny_config(hf_data, model={"init_from": f"hf:{d}", "d_model": 128}))
    with pytest.raises(ConfigError, match="must be 'hf:DIR'"):
        Config.from_dict({"model": {"init_from": d}})
    with pytest.raises(ConfigError, match="is not a directory"):
        Config.from_dict({"model": {"init_from": f"hf:{tmp_path}/nope"}})
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type='gpt2' is not supported"):
        Config.from_dict({"model": {"init_from": f"hf:{tmp_path}/gpt2"}})
    cfg = Config.from_dict(tiny_config(hf_data, model={"init_from": f"hf:{d}"}))
    assert cfg.model.tie_embeddings and cfg.model.d_model == 64 and cfg.model.init_from == f"hf:{d}"


def _with_own_tokenizer(path) -> None:
    """A tiny Llama directory whose tokenizer.json (a word-level vocabulary of the model's 320 ids, </s>
    last) is not the byte tokenizer hf_data was made with, though both fit the model's vocabulary."""
    from tokenizers import Tokenizer, models

    save_tiny_hf(path)
    vocab = {f"w{i}": i for i in range(319)} | {"</s>": 319}
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(path / "tokenizer.json"))


def test_cli_init_from_errors_before_workers(tmp_path, llama_dirs, hf_data, capsys):
    """One `error:` line, exit 2, from the driver's checks: no safetensors, not a Llama model, a mismatched
    vocabulary (larger than the model's, or another tokenizer than the directory's tokenizer.json)."""
    import shutil

    from raydist.cli import main

    empty = tmp_path / "no-weights"
    empty.mkdir()
    shutil.copy(os.path.join(llama_dirs["tied"], "config.json"), empty / "config.json")
    small = tmp_path / "small-vocab"
    save_tiny_hf(small, vocab_size=128)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 320, "n_embd": 64}))
    own = tmp_path / "own-tokenizer"
    _with_own_tokenizer(own)
    for init, match in [(empty, "no \\*.safetensors files"), (small, "tokenized with a vocabulary of 257 but"),
                        (gpt2, "model_type='gpt2' is not supported"),
                        (tmp_path, "config.json not found; a Hugging Face model directory holds"),
                        (own, ("tokenized with byte \\(vocabulary of 257, end-of-sequence id 256\\) but .* "
                               "tokenizer.json \\(vocabulary of 320, end-of-sequence id 319\\)"))]:
        config = tmp_path / "finetune.toml"  # only the pretrained directory: its config.json gives the shape
        config.write_text(f'[model]\ninit_from = "hf:{init}"\n[data]\npath = "{hf_data}"\nseq_len = 32\n'
                          f'[checkpoint]\nstorage = "{tmp_path}/runs"\n')
        capsys.readouterr()
        code = main(["train", str(config)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
        assert __import__("re").search(match, err[0]), err[0]

    # `raydist eval hf:DIR` refuses data made with another tokenizer than DIR's the same way
    code = main(["eval", f"hf:{own}", "--data", hf_data])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "tokenized with byte" in err[0] and "hf:" in err[0], err


# ---- raydist export ------------------------------------------------------------------------------


TOKENS = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(3))


def _write_run_config(raw: dict, run_dir: str) -> None:
    """What the launcher writes into a run directory (run_fit, as the tests drive it, does not)."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.toml"), "w") as f:
        f.write(Config.from_dict(raw).to_toml())


def _trained_run(hf_data, hf_dir: str, run_dir: str, parallel: dict, steps: int = 3, **sections) -> dict:
    from raydist.testing import run_fit

    raw = tiny_config(hf_data, model={"init_from": f"hf:{hf_dir}"}, parallel=parallel,
                      train={"steps": steps, "lr": 1e-2, "warmup_steps": 0},
                      checkpoint={"every_steps": 0, "async_save": False}, **sections)
    _write_run_config(raw, run_dir)
    run_fit(raw, 2 if parallel else 1, run_dir)
    return raw


@pytest.mark.parametrize("kind, parallel", [("tied", {"dp_shard": 2}), ("tied", {"tp": 2}), ("tied", {"pp": 2}),
                                            ("qwen3", {"dp_shard": 2}), ("qwen2", {"tp": 2})],
                         ids=["fsdp2", "tp2", "pp2", "qwen3-fsdp2", "qwen2-tp2"])
def test_export_after_training_loads_in_transformers(hf_data, llama_dirs, tmp_path, capsys, kind, parallel):
    from raydist.testing import logits_after_load

    run_dir, out = str(tmp_path / "run"), str(tmp_path / "hf-out")
    raw = _trained_run(hf_data, llama_dirs[kind], run_dir, parallel)
    written = run_cli(capsys, "export", run_dir, "--hf", out, "--max-shard-size-mb", "0.1")
    assert written["step"] == 3 and "model.safetensors.index.json" in written["files"]

    # raydist's logits: the checkpoint loaded by the layout that wrote it (PP: one process, resharded by DCP)
    layout_raw, world = (raw, 2) if "pp" not in parallel else (tiny_config(hf_data, model=raw["model"]), 1)
    ours = spawn(logits_after_load, world, layout_raw, run_dir, TOKENS, 3)[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = model(input_ids=TOKENS, use_cache=False).logits
        original = transformers.AutoModelForCausalLM.from_pretrained(llama_dirs[kind]).eval()(
            input_ids=TOKENS, use_cache=False).logits
    assert model.config.model_type == {"tied": "llama"}.get(kind, kind)  # exported as the family it came from
    assert (theirs - original).abs().max() > 1e-2  # training moved the weights
    diff = (theirs - ours).abs().max().item()
    print(f"export {parallel}: max abs logit diff {diff:.2e} (max abs logit {ours.abs().max():.1f})")
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)

    # `raydist eval` of the run equals transformers' loss on the export
    got = run_cli(capsys, "eval", run_dir, "--data", hf_data)
    expected = transformers_loss(out, _split_rows(hf_data))
    assert abs(got["loss"] - expected) / expected < 1e-4 and got["step"] == 3
