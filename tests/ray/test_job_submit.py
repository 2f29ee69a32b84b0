"""`ray job submit --working-dir . -- raydist train ...` against a real `ray start --head` (dashboard on, token
authentication on) with autoscaling from zero: cluster_configs/local_fake.yaml, a head with no CPUs and no worker
nodes. An elastic job (elastic_tiny.toml, here 2 workers at most) finds the cluster through RAY_ADDRESS; its
pending demand makes the autoscaler launch a fake node, training can only run there (the head offers no CPU),
the job succeeds, the scale-up time is in its logs, it writes its run directory and shows its progress in
`ray job logs`. A bad config fails before any worker starts with its `error:` line in the logs; a client
without the token is refused.

One head for the module (a head's start and stop, and a submitted job, cost 8-10 s of a core each): the
submitted-job and autoscaling checks were two modules, each with its own head and job, until 2026-11-30. The
bad config and the refused client launch no node, so in any order the training job finds the head alone.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml

from cluster_harness import LocalHead, job_status
from raydist.config import Config
from raydist.metrics.flops import NO_CPU_PEAK

# a job's own wait is `submit`'s 400 s; the training job takes 50-80 s here
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(500)]

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = {"step", "loss", "tokens_per_s", "world_size", "mesh", "elapsed_s"}  # in every metrics record
PROGRESS = re.compile(r"^step (\d+)/(\d+) \| loss \d+\.\d+", re.M)
SCALE_UP = re.compile(r"^scale-up: the cluster holds (\d+) workers after (\d+\.\d)s$", re.M)


@pytest.fixture(scope="module")
def head():
    config = yaml.safe_load((ROOT / "cluster_configs" / "local_fake.yaml").read_text())
    with LocalHead(num_cpus=0, autoscaling_config=config) as h:
        yield h
    assert not h.leftover_processes()


def submit(head: LocalHead, job_id: str, *train_args: str, timeout_s: float = 400):
    """The user's command, run from the repository root; blocks until the job ends (it tails the logs)."""
    start = time.monotonic()
    result = head.ray("job", "submit", "--submission-id", job_id, "--working-dir", ".", "--",
                      "raydist", "train", *train_args, timeout_s=timeout_s)
    return result, time.monotonic() - start


def active_nodes(head: LocalHead, timeout_s: float = 60) -> dict[str, int]:
    """{node type: count} from `ray status` (the autoscaler's view)."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = head.ray("status", "--address", head.gcs_address, timeout_s=60).stdout
        block = re.search(r"Active:\n((?: \d+ \S+\n)+)", out)
        if block:
            return {name: int(count) for count, name in re.findall(r" (\d+) (\S+)\n", block.group(1))}
        if time.monotonic() > deadline:
            raise AssertionError(f"no autoscaler status after {timeout_s:.0f}s:\n{out[-2000:]}")
        time.sleep(2)


def test_elastic_job_scales_a_fake_cluster_up_from_zero_and_writes_its_run_directory(head, tiny_data, tmp_path,
                                                                                    record_property):
    assert active_nodes(head) == {"ray.head.default": 1}
    storage = tmp_path / "runs"
    result, job_s = submit(head, "rd-elastic", "workloads/elastic_tiny.toml", "--set", f"data.path={tiny_data}",
                           "--set", f"checkpoint.storage={storage}", "--set", "train.run_name=elastic",
                           # Start at whatever size the live nodes allow and stay there: a resize in the
                           # middle of this short run would depend on timing (resizes are the subject of the
                           # elastic tests). At most 2 workers: one fake node of 2 CPUs shows the scale-up from
                           # zero as well as two would, with two cold worker processes and one node's raylet and
                           # agents less (up to 4, the autoscaler launched both nodes).
                           "--set", "elastic.resize_check_interval_s=3600", "--set", "elastic.max_workers=2",
                           timeout_s=400)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert job_status(head, "rd-elastic") == "SUCCEEDED"
    nodes = active_nodes(head)
    logs = head.ray("job", "logs", "rd-elastic", timeout_s=60).stdout

    # The autoscaler launched worker nodes (the head alone holds no worker).
    assert nodes.get("ray.worker.cpu2", 0) >= 1, nodes
    assert "waiting up to 240s for the cluster to hold 2 workers (now 0)" in logs, logs[-3000:]
    scale_up = SCALE_UP.search(logs)
    assert scale_up and int(scale_up.group(1)) >= 2, logs[-3000:]
    scale_up_s = float(scale_up.group(2))

    # the run directory contract (elastic_tiny.toml: 16 steps, logged every 2, evaluated every 8)
    run = storage / "elastic"
    assert Config.load(run / "config.toml").data.path == tiny_data
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(0, 17, 2))
    assert {r["world_size"] for r in records} == {2}
    for r in records:
        assert REQUIRED <= r.keys(), r.keys()
        assert r["mesh"]["dp_replicate"] == r["world_size"]
    assert [r["step"] for r in records if "val_loss" in r] == [0, 8, 16]
    assert records[-1]["mfu"] is None and records[-1]["mfu_peak_source"] == NO_CPU_PEAK  # (metrics/flops.py)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 16
    assert summary["final_val_loss"] < summary["first_val_loss"]
    assert (run / "checkpoints" / "step_00000016" / "COMMIT.json").exists()
    started = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()
               if json.loads(line)["kind"] == "start"]
    workers_up_s = started[0]["elapsed_s"]
    # its progress in `ray job logs`: a line per logged step, and the end with the run directory
    assert [int(m.group(1)) for m in PROGRESS.finditer(logs)] == list(range(0, 17, 2)), logs[-3000:]
    assert "done: 16 steps" in logs and str(run) in logs

    record_property("scale_up_s", scale_up_s)
    record_property("first_worker_group_s", workers_up_s)
    print(f"\nscale-up to {scale_up.group(1)} workers: {scale_up_s:.1f}s after the driver asked; training "
          f"started {workers_up_s:.1f}s after the driver started, on {started[0]['world_size']} workers; "
          f"job {job_s:.1f}s end to end; nodes at the end: {nodes}")


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
