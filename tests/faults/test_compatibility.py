"""Resume refuses a checkpoint of another model or data, on the driver before any worker starts, with one
`error:` line naming the field; what may change (layout, worker count, lr, steps) resumes. The worker checks
too (a checkpoint committed after the driver looked)."""

import json

import pytest

from fault_runs import files_under, small_config
from raydist.config import Config, dump_toml
from raydist.testing import run_fit


@pytest.fixture(scope="module")
def stopped(tiny_data, tmp_path_factory):
    """A 5-step run checkpointed at step 5 (its config as TOML): a run that a new attempt resumes."""
    root = tmp_path_factory.mktemp("stopped")
    raw = small_config(tiny_data, steps=5)
    run_fit(raw, 1, str(root / "runs" / "run"))
    (root / "run.toml").write_text(dump_toml(raw))
    return root


def _train(root, *overrides) -> list[str]:
    return ["train", str(root / "run.toml"), "--set", f"checkpoint.storage={root}/runs", "--set", "train.run_name=run",
            "--set", "ray.num_workers=1", *[item for o in overrides for item in ("--set", o)]]


@pytest.mark.parametrize("override, field", [
    ("model.num_layers=4", "model.num_layers: the checkpoint has 2, the config 4"),
    ("model.d_model=128", "model.d_model: the checkpoint has 64, the config 128"),
    ("train.seed=1", "train.seed differs (the checkpoint has 0, the config 1)"),
])
def test_a_different_model_is_refused_before_workers_start(stopped, capsys, no_ray, override, field):
    from raydist.cli import main

    before = files_under(stopped / "runs")
    assert main(_train(stopped, override, "train.steps=10")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {field}: the run directory"), err
    assert "pick another train.run_name" in err[0]
    assert files_under(stopped / "runs") == before  # nothing written, no lease, no Ray


def test_other_data_is_refused(stopped, tmp_path, capsys, no_ray):
    from raydist.cli import main
    from raydist.config import DataConfig
    from raydist.data.prepare import prepare

    other = str(tmp_path / "other-data")
    prepare(DataConfig(corpus="stdlib", seq_len=32, max_corpus_mb=0.3, shard_rows=512, val_fraction=0.15), other,
            log=lambda *_: None)
    assert main(_train(stopped, f"data.path={other}", "train.steps=10")) == 2
    assert "the training data (shards, rows or window) differs" in capsys.readouterr().err


def test_what_may_change_resumes(stopped, tmp_path, launch_without_ray):
    """lr, steps and the layout (1 -> 2 workers) may change: the run resumes at step 5 and finishes."""
    from raydist.driver.launcher import launch

    raw = Config.load(stopped / "run.toml", [f"checkpoint.storage={stopped}/runs", "train.run_name=run",
                                            "train.steps=8", "train.lr=0.001", "ray.num_workers=2",
                                            "parallel.dp_replicate=-1"])
    summary = launch(raw, log=lambda *_: None)
    assert summary["steps"] == 8 and summary["world_size"] == 2


def test_the_worker_refuses_too(stopped, tiny_data, tmp_path):
    """Without the driver (run_fit), the worker's own check stops the resume with the same message."""
    import shutil

    run_dir = tmp_path / "copy"
    shutil.copytree(stopped / "runs" / "run", run_dir)
    raw = small_config(tiny_data, steps=10)
    raw["model"]["num_layers"] = 3
    with pytest.raises(RuntimeError, match="ConfigError: model.num_layers: the checkpoint has 2, the config 3"):
        run_fit(raw, 1, str(run_dir))


@pytest.fixture(scope="module")
def stopped_lora(tiny_data, tmp_path_factory):
    """A 5-step LoRA run (rank 4, attention adapters) checkpointed at step 5, its config as TOML."""
    root = tmp_path_factory.mktemp("stopped-lora")
    raw = small_config(tiny_data, steps=5)
    raw["peft"] = {"method": "lora", "lora_rank": 4, "lora_alpha": 8.0, "lora_targets": "attention"}
    run_fit(raw, 1, str(root / "runs" / "run"))
    (root / "run.toml").write_text(dump_toml(raw))
    return root


@pytest.mark.parametrize("overrides, field", [
    (["peft.lora_rank=8"], "peft.lora_rank: the checkpoint has 4, the config 8"),
    (["peft.lora_targets=all"], "peft.lora_targets: the checkpoint has 'attention', the config 'all'"),
    (["peft.lora_alpha=16.0"], "peft.lora_alpha: the checkpoint has 8.0, the config 16.0"),
    (["peft.method=freeze"], "peft.method: the checkpoint has 'lora', the config 'freeze'"),
    (["peft.method=none"], "peft.method: the checkpoint has 'lora', the config 'none'"),
])
def test_other_peft_settings_are_refused(stopped_lora, capsys, no_ray, overrides, field):
    from raydist.cli import main

    before = files_under(stopped_lora / "runs")
    assert main(_train(stopped_lora, *overrides, "train.steps=10")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {field}: the run directory"), err
    assert files_under(stopped_lora / "runs") == before


def test_a_full_run_is_not_resumed_as_lora(stopped, capsys, no_ray):
    from raydist.cli import main

    assert main(_train(stopped, "peft.method=lora", "train.steps=10")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: peft.method: the checkpoint has 'none', the config 'lora'"), err


def test_unused_peft_settings_may_change(stopped_lora, launch_without_ray):
    """trainable_last_layers means nothing to a LoRA run: changing it resumes at step 5."""
    from raydist.driver.launcher import launch

    raw = Config.load(stopped_lora / "run.toml", [f"checkpoint.storage={stopped_lora}/runs", "train.run_name=run",
                                                 "train.steps=6", "peft.trainable_last_layers=2",
                                                 "ray.num_workers=1"])
    summary = launch(raw, log=lambda *_: None)
    assert summary["steps"] == 6
    events = [json.loads(line) for line in (stopped_lora / "runs" / "run" / "events.jsonl").read_text().splitlines()]
    starts = [e for e in events if e["kind"] in ("start", "restart")]
    assert starts[-1]["step"] == 5, starts[-1]  # resumed from the checkpoint, not started afresh
