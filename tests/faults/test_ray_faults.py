"""Faults on a real local Ray cluster: a deterministic failure in a worker ends the run after one attempt with
its own message instead of being retried `max_failures` times. (A stopped worker, rank 0 or rank 1:
test_stopped_rank_hang.py.)"""

from __future__ import annotations

import os

import pytest

from raydist.config import Config, ConfigError, DataConfig
from ray_runs import Background, ray_4cpu, records, wait_for  # noqa: F401  (ray_4cpu: a fixture)

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(400)]  # 55-74 s in CI, 2-3x its time here


def small(data: str, root, *extra) -> Config:
    return Config.load(None, [
        f"data.path={data}", "data.seq_len=32", "data.reader=arrow", "model.num_layers=2", "model.d_model=64",
        "model.ffn_hidden=128", "train.global_batch=8", "train.micro_batch=2", "train.eval_every=0",
        "train.log_every=2", "checkpoint.every_steps=10", "checkpoint.async_save=false",
        f"checkpoint.storage={root}", "ray.num_workers=2", "ray.max_pending_s=60", *extra])


def test_a_deterministic_failure_ends_the_run_after_one_attempt(ray_4cpu, tmp_path):
    """The data directory disappears after the driver checked it: every attempt would fail the same way."""
    from raydist.data.prepare import prepare

    data = str(tmp_path / "data")
    prepare(DataConfig(corpus="stdlib", seq_len=32, max_corpus_mb=0.3, shard_rows=16, val_fraction=0.1), data,
            log=lambda *_: None)
    run_dir = tmp_path / "gone"
    job = Background(small(data, tmp_path, "train.steps=40", "train.run_name=gone", "elastic.max_failures=-1",
                           "data.prefetch_shards=1"))
    wait_for(lambda: any(e["kind"] == "start" for e in records(run_dir, "events.jsonl")), 240, "the start")
    os.rename(data, data + ".moved")
    job.join(300)
    assert isinstance(job.error, ConfigError), job.error
    assert "shard listed in the manifest is missing" in str(job.error) and "not retried" in str(job.error)
    events = records(run_dir, "events.jsonl")
    errors = [e for e in events if e["kind"] == "worker_error"]
    assert errors and all(e["deterministic"] for e in errors)
    assert sum(e["kind"] == "launch" for e in events) <= 2  # the failed attempt and the one that stops at once
