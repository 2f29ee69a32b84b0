"""Autoscaling from zero: cluster_configs/local_fake.yaml (a head with no CPUs, no worker nodes), an
elastic job (2 to 4 workers) submitted with `ray job submit`. The driver's pending demand makes the
autoscaler launch fake nodes, training can only run on them (the head offers no CPU), the job succeeds,
and the scale-up time is in the job's logs.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml

from cluster_harness import LocalHead, job_status

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(400)]  # 50-80 s here, the default 180 s is tight on CI

ROOT = Path(__file__).resolve().parents[2]
SCALE_UP = re.compile(r"^scale-up: the cluster holds (\d+) workers after (\d+\.\d)s$", re.M)


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


def test_elastic_job_scales_a_fake_cluster_up_from_zero_workers(tiny_data, tmp_path, record_property):
    config = yaml.safe_load((ROOT / "cluster_configs" / "local_fake.yaml").read_text())
    storage = tmp_path / "runs"
    with LocalHead(num_cpus=0, autoscaling_config=config) as head:
        assert active_nodes(head) == {"ray.head.default": 1}

        start = time.monotonic()
        result = head.ray("job", "submit", "--submission-id", "rd-elastic", "--working-dir", ".", "--",
                          "raydist", "train", "workloads/elastic_tiny.toml", "--set", f"data.path={tiny_data}",
                          "--set", f"checkpoint.storage={storage}", "--set", "train.run_name=elastic",
                          # Start at whatever size the live nodes allow (2 to 4 workers) and stay there: a
                          # resize in the middle of this short run would depend on timing (resizes are
                          # the subject of the elastic tests).
                          "--set", "elastic.resize_check_interval_s=3600", timeout_s=500)
        job_s = time.monotonic() - start
        assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
        assert job_status(head, "rd-elastic") == "SUCCEEDED"
        nodes = active_nodes(head)
        logs = head.ray("job", "logs", "rd-elastic", timeout_s=60).stdout
    assert not head.leftover_processes()

    # The autoscaler launched worker nodes (the head alone holds no worker).
    assert nodes.get("ray.worker.cpu2", 0) >= 1, nodes
    assert "waiting up to 240s for the cluster to hold 2 workers (now 0)" in logs, logs[-3000:]
    scale_up = SCALE_UP.search(logs)
    assert scale_up and int(scale_up.group(1)) >= 2, logs[-3000:]
    scale_up_s = float(scale_up.group(2))

    run = storage / "elastic"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 16
    assert all(2 <= r["world_size"] <= 4 for r in records)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_val_loss"] < summary["first_val_loss"]
    started = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()
               if json.loads(line)["kind"] == "start"]
    workers_up_s = started[0]["elapsed_s"]

    record_property("scale_up_s", scale_up_s)
    record_property("first_worker_group_s", workers_up_s)
    print(f"\nscale-up to {scale_up.group(1)} workers: {scale_up_s:.1f}s after the driver asked; training "
          f"started {workers_up_s:.1f}s after the driver started, on {started[0]['world_size']} workers; "
          f"job {job_s:.1f}s end to end; nodes at the end: {nodes}")
