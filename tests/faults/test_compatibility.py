"""Resume refuses a checkpoint of another model or data, on the driver before any worker starts, with one
`error:` line naming the field; what may change (layout, worker count, lr, steps) resumes. The worker checks
too (a checkpoint committed after the driver looked)."""

import pytest

from fault_runs import files_under, small_config
from raydist.config import Config, ConfigError, dump_toml
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
    from raydist.launcher import launch

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
