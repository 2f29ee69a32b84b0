"""Experiment tracking, all written by the driver's Follower (raydist.metrics.tracking):

- MLflow against a real local `mlflow server` (127.0.0.1, a free port, started and stopped here): a run's
  params are the flattened config, its loss history is metrics.jsonl's, its events are there, a rerun of
  the run name resumes the same MLflow run, and an unreachable server is one `error:` line;
- Weights & Biases offline (WANDB_MODE=offline, WANDB_DIR in tmp_path, no network): what W&B wrote is read
  back from its run file (`run-<id>.wandb`, a LevelDB-style log of wandb's own protobuf records) and holds
  metrics.jsonl's numbers at their steps, the events, the config and the end status; planted tracker bugs
  (a step off by one, a dropped metric) fail that check; a W&B without an API key is one `error:` line;
- TensorBoard: the driver's process writes RUN_DIR/tensorboard/ (the workers write no event files)."""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
import time
import urllib.request

import mlflow
import pytest
import wandb
from google.protobuf.message import DecodeError
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb.proto import wandb_internal_pb2

from fault_runs import small_config
from raydist.cli import main
from raydist.config import Config, dump_toml
from raydist.driver.follow import Follower
from raydist.metrics.wandb_tracker import WandbTracker
from raydist.parallel.runtime import free_port
from workers import patience


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = open(root / "server.log", "w")
    # Without MLflow 3's job execution (its GenAI jobs): with it the server starts a job runner and seven huey
    # consumers, each importing mlflow, 21 s of CPU to the first /health here against 8.5 s; raydist's
    # tracking uses none of it.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
                             "--artifacts-destination", str(root / "artifacts"), "--workers", "1"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + patience(180)
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
    with open(path) as f:
        return [json.loads(line) for line in f.read().splitlines()]


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


# ---- Weights & Biases, offline -------------------------------------------------------------------


def wandb_records(path: str):
    """The records of a W&B run file: a 7-byte header (`:W&B`, magic, version), then LevelDB log blocks of
    32 KiB whose chunks (crc32c, length, type: 1 whole, 2 first, 3 middle, 4 last) hold serialized
    `wandb_internal_pb2.Record`s (wandb 0.31 ships no Python reader for its own file)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", path
    pos, chunk, block = 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is zero padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding to the block's end
            pos += block - pos % block
            continue
        if pos + 7 + length > len(data):  # a chunk still being written: the records before it
            return
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(chunk)
            except DecodeError:  # torn while being written
                return
            chunk = b""
            yield record


def read_wandb_run(path: str, timeout_s: float = 30.0) -> dict:
    """What one W&B run file holds: history rows, the config, the summary's last values, the exit code.
    Read once its exit record is there: wandb-core may still be writing the file after `finish()` returns
    (its process's exit waits for it; a reader in the same process must)."""
    deadline = time.monotonic() + timeout_s
    while True:
        run = _read_wandb_run(path)
        if run["exit_code"] is not None or time.monotonic() > deadline:
            return run
        time.sleep(0.1)


def _read_wandb_run(path: str) -> dict:
    out = {"history": [], "config": {}, "summary": {}, "exit_code": None, "run_id": None}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["run_id"] = record.run.run_id
            out["config"].update({u.key: json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "config":
            out["config"].update({u.key: json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":
            out["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                   for i in record.history.item})
        elif kind == "summary":
            out["summary"].update({u.key or "/".join(u.nested_key): json.loads(u.value_json)
                                   for u in record.summary.update})
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
    return out


def offline_run_files(wandb_dir) -> list[str]:
    """The W&B run files under WANDB_DIR, oldest first."""
    return sorted(glob.glob(os.path.join(str(wandb_dir), "wandb", "offline-run-*", "run-*.wandb")))


def check_wandb_run(run: dict, metrics: list[dict], events: list[dict], status: str, exit_code: int) -> None:
    """The W&B run holds every metrics.jsonl record's numbers at its step, each event kind's count, and the
    end status (raises AssertionError naming what differs)."""
    rows = [row for row in run["history"] if "loss" in row or "tokens_per_s" in row]
    assert [(row["step"], row.get("loss")) for row in rows] == [(r["step"], r["loss"]) for r in metrics]
    for key in ("lr", "tokens_per_s", "world_size", "tokens"):
        assert [row.get(key) for row in rows] == [r.get(key) for r in metrics], key
    for kind in {e["kind"] for e in events}:
        counted = [(row["step"], row[f"event.{kind}"]) for row in run["history"] if f"event.{kind}" in row]
        expected = [e["step"] or 0 for e in events if e["kind"] == kind]
        assert counted == list(zip(expected, range(1, len(expected) + 1))), kind
    assert run["summary"]["raydist.status"] == status and run["exit_code"] == exit_code


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B with no network: offline mode, its files in tmp_path, no API key, no user settings."""
    for name in ("WANDB_API_KEY", "WANDB_ENTITY", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb-dir").mkdir()
    wandb.teardown()  # wandb reads its environment once per setup: this test's, not an earlier test's
    yield tmp_path / "wandb-dir"
    wandb.teardown()


def test_wandb_offline_gets_the_config_the_metrics_the_events_and_the_end(tiny_data, tmp_path, wandb_offline,
                                                                            capsys, launch_without_ray):
    sets = ("tracking.wandb_project=raydist-test", "tracking.wandb_mode=offline")
    assert train_with(tmp_path, tiny_data, "wb", 6, *sets) == 0
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "wb" / "wandb.json").read_text())
    assert record["project"] == "raydist-test" and f"tracking: W&B run {record['run_id']} in project" in out
    [path] = offline_run_files(wandb_offline)
    run = read_wandb_run(path)
    assert run["run_id"] == record["run_id"]
    metrics, events = jsonl(tmp_path / "wb" / "metrics.jsonl"), jsonl(tmp_path / "wb" / "events.jsonl")
    assert [r["step"] for r in metrics] == [0, 1, 2, 3, 4, 5, 6]
    check_wandb_run(run, metrics, events, "FINISHED", 0)
    assert run["config"]["model.num_layers"] == "2" and run["config"]["train.steps"] == "6"
    assert run["summary"]["summary.steps"] == 6
    assert [e["kind"] for e in jsonl(os.path.join(os.path.dirname(path), "files", "events.jsonl"))] == \
        [e["kind"] for e in events]

    # the same run name again, with more steps: the same W&B run goes on (a second offline directory of it)
    assert train_with(tmp_path, tiny_data, "wb", 10, *sets) == 0
    first, second = offline_run_files(wandb_offline)
    rerun = read_wandb_run(second)
    assert first == path and rerun["run_id"] == record["run_id"] and rerun["config"]["train.steps"] == "10"
    assert [row["step"] for row in rerun["history"] if "loss" in row] == [7, 8, 9, 10]
    assert rerun["summary"]["summary.steps"] == 10 and rerun["exit_code"] == 0


class _StepOffByOne(WandbTracker):
    def metric(self, record):
        super().metric({**record, "step": record["step"] + 1})


class _DropsLr(WandbTracker):
    def metric(self, record):
        super().metric({k: v for k, v in record.items() if k != "lr"})


@pytest.mark.parametrize("tracker, caught", [(WandbTracker, False), (_StepOffByOne, True), (_DropsLr, True)],
                         ids=["real", "step+1", "drops-lr"])
def test_the_wandb_check_catches_a_planted_tracker_bug(tiny_data, tmp_path, wandb_offline, launch_without_ray,
                                                       tracker, caught):
    """The Follower drives a tracker over a real run directory's files; the check above passes for the
    real tracker and fails for each planted bug."""
    assert train_with(tmp_path, tiny_data, "plain", 3) == 0
    run_dir = str(tmp_path / "plain")
    cfg = Config.from_dict({**small_config(tiny_data, steps=3),
                            "tracking": {"wandb_project": "raydist-test", "wandb_mode": "offline"}})
    lines = []
    wb = tracker(cfg, run_dir, "plain", log=lines.append)
    wb.start()
    with Follower(run_dir, [wb], interval_s=0.05, from_end=False):
        pass
    wb.end("FAILED", {})
    assert [line for line in lines if not line.startswith("tracking: W&B run")] == []
    [path] = offline_run_files(wandb_offline)
    metrics, events = jsonl(tmp_path / "plain" / "metrics.jsonl"), jsonl(tmp_path / "plain" / "events.jsonl")
    if caught:
        with pytest.raises(AssertionError):
            check_wandb_run(read_wandb_run(path), metrics, events, "FAILED", 1)
    else:
        check_wandb_run(read_wandb_run(path), metrics, events, "FAILED", 1)


def test_wandb_without_an_api_key_is_one_error_line(tiny_data, tmp_path, wandb_offline, monkeypatch, capsys,
                                                    launch_without_ray):
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    assert train_with(tmp_path, tiny_data, "nokey", 3, "tracking.wandb_project=raydist-test") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: tracking.wandb_project=raydist-test cannot be used"), err
    assert launch_without_ray["trainers"] == 0  # failed before any worker
    assert not offline_run_files(wandb_offline)


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
