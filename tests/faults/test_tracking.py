"""Experiment tracking, all written by the driver's Follower (raydist.metrics.tracking):

- MLflow against a real local `mlflow server` (127.0.0.1, a free port, started and stopped here): a run's
  params are the flattened config, its loss history is metrics.jsonl's, its events are there, a rerun of
  the run name resumes the same MLflow run, and an unreachable server is one `error:` line;
- TensorBoard: the driver's process writes RUN_DIR/tensorboard/ (the workers write no event files)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import mlflow
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fault_runs import small_config
from raydist.cli import main
from raydist.config import dump_toml
from raydist.parallel.runtime import free_port


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = open(root / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
                             "--artifacts-destination", str(root / "artifacts"), "--workers", "1"],
                            stdout=log, stderr=subprocess.STDOUT)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("mlflow server did not start:\n" + (root / "server.log").read_text()[-3000:])
        time.sleep(0.5)
    yield uri
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


def train(tmp_path, data, name, uri, steps=10):
    return train_with(tmp_path, data, name, steps, f"tracking.mlflow_uri={uri}",
                      "tracking.mlflow_experiment=raydist-test")


def train_with(tmp_path, data, name, steps, *settings):
    config = tmp_path / f"{name}.toml"
    config.write_text(dump_toml(small_config(data, steps=steps)))
    sets = [arg for setting in settings for arg in ("--set", setting)]
    return main(["train", str(config), "--set", f"checkpoint.storage={tmp_path}", "--set", f"train.run_name={name}",
                 "--set", "ray.num_workers=1", *sets])


def jsonl(path) -> list[dict]:
    return [json.loads(line) for line in open(path).read().splitlines()]


def test_mlflow_gets_the_params_the_loss_history_and_the_events(tiny_data, tmp_path, mlflow_server, capsys,
                                                                  launch_without_ray):
    from mlflow.tracking import MlflowClient

    assert train(tmp_path, tiny_data, "tracked", mlflow_server, steps=6) == 0
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "tracked" / "mlflow.json").read_text())
    assert f"tracking: MLflow run {record['run_id']}" in out
    client = MlflowClient(tracking_uri=mlflow_server)
    run = client.get_run(record["run_id"])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    params = run.data.params
    assert params["model.num_layers"] == "2" and params["train.steps"] == "6"
    assert params["checkpoint.storage"] == str(tmp_path) and params["tracking.mlflow_experiment"] == "raydist-test"
    logged = [json.loads(line) for line in (tmp_path / "tracked" / "metrics.jsonl").read_text().splitlines()]
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == \
        [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in logged]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "tokens_per_s")] == [r["step"] for r in logged]
    assert client.get_metric_history(run.info.run_id, "event.checkpoint")[-1].value == 2  # steps 5 and 6
    assert run.data.metrics["summary.steps"] == 6
    events = client.download_artifacts(run.info.run_id, "events.jsonl", str(tmp_path / "dl"))
    kinds = [json.loads(line)["kind"] for line in open(events)]
    assert kinds[0] == "start" and kinds[-1] == "end"

    # the same run name again, with more steps: the same MLflow run goes on
    assert train(tmp_path, tiny_data, "tracked", mlflow_server, steps=10) == 0
    run = client.get_run(record["run_id"])
    assert run.info.status == "FINISHED" and run.data.metrics["summary.steps"] == 10
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss"))
    assert steps[-1] == 10 and 6 in steps
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_an_unreachable_tracking_server_is_one_error_line(tiny_data, tmp_path, capsys, launch_without_ray):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert train(tmp_path, tiny_data, "untracked", uri) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: tracking.mlflow_uri={uri} cannot be used"), err
    assert launch_without_ray["trainers"] == 0  # failed before any worker


# ---- TensorBoard -----------------------------------------------------------------------------------


def test_tensorboard_is_written_by_the_driver(tiny_data, tmp_path, launch_without_ray):
    """RUN_DIR/tensorboard/ holds metrics.jsonl's loss at each step and the checkpoint events, in event
    files of the driver's process (their names end in the writer's host and pid)."""
    assert train_with(tmp_path, tiny_data, "tb", 6) == 0
    files = sorted(os.listdir(tmp_path / "tb" / "tensorboard"))
    assert files and all(name.split(".")[-2] == str(os.getpid()) for name in files), files
    acc = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    acc.Reload()
    metrics = jsonl(tmp_path / "tb" / "metrics.jsonl")
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("train/loss")] == \
        [(r["step"], round(r["loss"], 4)) for r in metrics]
    assert [e.step for e in acc.Scalars("events/checkpoint")] == [5, 6]
