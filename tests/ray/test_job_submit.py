"""`ray job submit --working-dir . -- raydist train ...` against a real local head (dashboard on, token
authentication on): the job finds the cluster through RAY_ADDRESS, writes its run directory, shows its
progress in `ray job logs`; a bad config fails before any worker starts with its `error:` line in the
logs; a client without the token is refused.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from cluster_harness import LocalHead, job_status
from raydist.config import Config
from raydist.metrics.flops import NO_CPU_PEAK

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(400)]  # as `submit`'s own wait; 58-88 s in CI

REQUIRED = {"step", "loss", "tokens_per_s", "world_size", "mesh", "elapsed_s"}  # in every metrics record
PROGRESS = re.compile(r"^step (\d+)/(\d+) \| loss \d+\.\d+", re.M)


@pytest.fixture(scope="module")
def head():
    # 4 CPUs: 2 training workers and room for the Ray Data read tasks the default reader starts in them.
    with LocalHead(num_cpus=4) as h:
        yield h
    assert not h.leftover_processes()


def submit(head: LocalHead, job_id: str, *train_args: str, timeout_s: float = 400):
    """The user's command, run from the repository root; blocks until the job ends (it tails the logs)."""
    start = time.monotonic()
    result = head.ray("job", "submit", "--submission-id", job_id, "--working-dir", ".", "--",
                      "raydist", "train", *train_args, timeout_s=timeout_s)
    return result, time.monotonic() - start


def test_submitted_job_trains_and_writes_its_run_directory(head, tiny_data, tmp_path):
    storage = tmp_path / "runs"
    result, seconds = submit(head, "rd-train", "workloads/gpt_tiny_short.toml", "--set", f"data.path={tiny_data}",
                             "--set", f"checkpoint.storage={storage}", "--set", "train.run_name=submitted")
    print(f"job submit -> SUCCEEDED in {seconds:.1f}s")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert job_status(head, "rd-train") == "SUCCEEDED"

    # the run directory contract (this 2-worker, 12-step run was also test_train_ray.py's first test, which
    # ran `launch` in the test process on a Ray it had started: that path is its Qwen3 test's)
    run = storage / "submitted"
    assert Config.load(run / "config.toml").data.path == tiny_data
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 3, 6, 9, 12]
    for r in records:
        assert REQUIRED <= r.keys(), r.keys()
        assert r["world_size"] == 2 and r["mesh"]["dp_replicate"] == 2
    assert [r["step"] for r in records if "val_loss" in r] == [0, 6, 12]
    assert records[-1]["mfu"] is None and records[-1]["mfu_peak_source"] == NO_CPU_PEAK  # (metrics/flops.py)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 12
    assert summary["final_val_loss"] < summary["first_val_loss"]
    assert (run / "checkpoints").is_dir()

    logs = head.ray("job", "logs", "rd-train", timeout_s=60).stdout
    steps = [int(m.group(1)) for m in PROGRESS.finditer(logs)]
    assert steps == [0, 3, 6, 9, 12], logs[-3000:]
    assert "done: 12 steps" in logs and str(run) in logs


def test_bad_config_fails_fast_with_its_error_line_in_the_job_logs(head, tiny_data, tmp_path):
    storage = tmp_path / "runs"
    result, seconds = submit(head, "rd-bad", "workloads/gpt_tiny_short.toml", "--set", f"data.path={tiny_data}",
                             "--set", f"checkpoint.storage={storage}", "--set", "parallel.tp=3", timeout_s=120)
    print(f"bad config -> FAILED in {seconds:.1f}s")
    assert result.returncode != 0
    assert job_status(head, "rd-bad") == "FAILED"
    logs = head.ray("job", "logs", "rd-bad", timeout_s=60).stdout
    errors = [line for line in logs.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "tp=3" in errors[0], logs[-2000:]
    # Failed on the driver: no worker started, no run directory, exit status 2 (bad input).
    assert "RayTrainWorker" not in logs and "Started training worker group" not in logs
    assert not storage.exists()
    assert "exit code 2" in head.ray("job", "status", "rd-bad", timeout_s=60).stdout


def test_token_authentication_stays_on(head):
    refused = head.ray("job", "list", token=False, timeout_s=60)
    assert refused.returncode != 0
    assert "Unauthorized" in refused.stderr or "Authentication" in refused.stderr, refused.stderr[-1000:]
    allowed = head.ray("job", "list", timeout_s=60)
    assert allowed.returncode == 0, allowed.stderr[-1000:]
