"""`raydist train` through Ray Train V2 on a local Ray the test process started: a Qwen3 directory trained and
generated from, and driver checks. (The run directory contract of a plain data-parallel run:
tests/ray/test_job_submit.py's submitted job.)"""

import json
import time

import pytest

from raydist.config import Config, ConfigError
from raydist.driver.launcher import launch
from ray_runs import ray_4cpu  # noqa: F401  (the Ray files' shared local cluster: a fixture)

pytestmark = pytest.mark.ray


def small(tiny_data, tmp_path, *extra):
    return Config.load(None, [
        f"data.path={tiny_data}", "data.seq_len=32", "model.num_layers=2", "model.d_model=64",
        "model.ffn_hidden=128", "train.global_batch=8", "train.micro_batch=2", "train.steps=12",
        "train.eval_every=6", "train.log_every=3", "train.eval_batches=2", f"checkpoint.storage={tmp_path}/runs",
        "train.run_name=r1", *extra])


def test_a_qwen3_directory_trains_through_ray_train_and_generates_from_its_run(ray_4cpu, tiny_data, tmp_path,
                                                                                 capsys):
    """Another family through the whole job: a Qwen3 `save_pretrained` directory (untied, heads of 32 on a
    64-wide model, per-head q/k norms) trained by Ray Train workers under FSDP 2 from `model.init_from`, its
    checkpoint then read by `raydist generate` with the run's tokenizer and the family from the checkpoint."""
    from raydist.cli import main
    from raydist.inference.generate import generate_ids
    from raydist.inference.load import load_model
    from raydist.testing import save_tiny_hf

    save_tiny_hf(tmp_path / "qwen3", family="qwen3", tied=False, seed=3, head_dim=32)
    cfg = small(tiny_data, tmp_path, f"model.init_from=hf:{tmp_path / 'qwen3'}", "parallel.dp_replicate=1",
                "parallel.dp_shard=2", "train.lr=1e-3", "train.steps=6", "train.eval_every=6")
    earlier = set(ray_4cpu._private.state.actors())  # (the shared cluster's earlier runs' actors)
    summary = launch(cfg, log=lambda *_: None)
    run = tmp_path / "runs" / "r1"
    assert summary["status"] == "completed" and summary["steps"] == 6
    assert summary == json.loads((run / "summary.json").read_text())
    assert summary["final_val_loss"] < summary["first_val_loss"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["world_size"] == 2 and records[-1]["mesh"]["dp_shard"] == 2
    loaded = load_model(str(run), 32)
    assert loaded.model.cfg.family == "qwen3" and loaded.model.cfg.head_dim == 32
    assert any(name.endswith("q_norm.weight") for name, _ in loaded.model.named_parameters())
    # the run's worker group started Ray Train's SynchronizationActor but no DatasetManager (raydist passes no
    # datasets), and on this cluster, started here without a dashboard, the run had no PlacementGroupCleaner
    # (raydist.driver.ray_trainer); GCS's actor table holds ended actors too (no dashboard for the state API),
    # the ones of earlier tests on the shared cluster as well: only this run's count
    classes = {actor["ActorClassName"] for key, actor in ray_4cpu._private.state.actors().items() if key not in earlier}
    assert "SynchronizationActor" in classes and not {"DatasetManager", "PlacementGroupCleaner"} & classes, classes

    capsys.readouterr()
    code = main(["generate", str(run), "--prompt", "import os\n", "--max-new-tokens", "8", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    got = json.loads(out.strip().splitlines()[-1])
    assert got["step"] == 6 and got["prompt_ids"] == list(b"import os\n")  # the data's byte tokenizer
    assert got["completion_ids"] == generate_ids(loaded.model, list(b"import os\n"), 8, eos_ids=(256,))


def test_more_workers_than_the_cluster_can_hold_fails_in_bounded_time(ray_4cpu, tiny_data, tmp_path):
    cfg = small(tiny_data, tmp_path, "ray.num_workers=8", "ray.max_pending_s=3", "train.global_batch=16")
    start = time.monotonic()
    with pytest.raises(ConfigError, match="ray.num_workers=8 needs 8 workers of 1 CPU each but the cluster can hold 4"):
        launch(cfg, log=lambda *_: None)
    assert time.monotonic() - start < 60
