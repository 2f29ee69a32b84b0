import dataclasses
from pathlib import Path

import pytest

from raydist.config import SECTIONS, Config, ConfigError, field_docs, parse_override

ROOT = Path(__file__).resolve().parents[2]


def test_default_workload_file_equals_builtin_defaults():
    # `raydist train` outside the repo falls back to the built-in defaults: they must be the workload.
    assert Config.load(ROOT / "workloads/gpt_tiny.toml") == Config()


def test_every_field_has_a_docstring():
    docs = field_docs()
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert docs.get(f"{name}.{f.name}"), f"{name}.{f.name} has no docstring"


def test_overrides_are_typed_and_applied():
    cfg = Config.load(None, ["train.steps=7", "train.lr=0.5", "model.tie_embeddings=false",
                             "checkpoint.storage=/tmp/x", "train.run_name=abc"])
    assert (cfg.train.steps, cfg.train.lr, cfg.model.tie_embeddings) == (7, 0.5, False)
    assert cfg.checkpoint.storage == "/tmp/x" and cfg.train.run_name == "abc"
    assert parse_override("data.path=s3://b/p") == ("data", "path", "s3://b/p")


def test_toml_roundtrip(tmp_path):
    cfg = Config.load(None, ["train.steps=9", "data.path=/a \"b\""])
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    assert Config.load(path) == cfg


@pytest.mark.parametrize("overrides, message", [
    (["train.stepz=3"], "unknown key train.stepz; did you mean train.steps?"),
    (["trainer.steps=3"], "unknown section [trainer]"),
    (["train.steps='many'"], "train.steps='many' has the wrong type: expected int"),
    (["model.tie_embeddings=3"], "model.tie_embeddings=3 has the wrong type: expected bool"),
    (["train.steps=0"], "train.steps=0 must be a positive integer"),
    (["model.d_model=-8"], "model.d_model=-8 must be a positive integer"),
    (["train.global_batch=-1"], "train.global_batch=-1 must be a positive integer"),
    (["model.num_kv_heads=3"], "model.num_heads=4 is not divisible by model.num_kv_heads=3"),
    (["model.num_heads=5"], "model.d_model=128 is not divisible by model.num_heads=5"),
    (["train.activation_checkpoint=some"], "train.activation_checkpoint='some' is not one of"),
    (["parallel.tp=-1", "parallel.pp=-1"], "only one parallel degree may be -1"),
    (["parallel.tp=0"], "parallel.tp=0 must be a positive degree"),
    (["train.micro_batch=3"], "train.global_batch=16 is not divisible by train.micro_batch=3"),
    (["elastic.min_workers=2"], "set both"),
    (["parallel.sequence_parallel=true"], "needs parallel.tp > 1"),
    (["steps=3"], "must look like section.key=value"),
])
def test_bad_values_name_the_value_and_fix(overrides, message):
    with pytest.raises(ConfigError) as exc:
        Config.load(None, overrides)
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="config file 'nope.toml' not found"):
        Config.load("nope.toml")


def test_readme_reference_is_current():
    from raydist.config import reference_markdown

    text = (ROOT / "README.md").read_text()
    start = text.index("<!-- config-reference:start -->\n") + len("<!-- config-reference:start -->\n")
    end = text.index("<!-- config-reference:end -->")
    assert text[start:end].strip() == reference_markdown().strip(), "regenerate: python -m raydist.config"
