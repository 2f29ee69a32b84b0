"""A checkpoint saved in one layout (FSDP 4) loads into others (FSDP 2, DDP 2, TP 2) with identical model
outputs, and the whole checkpoint/resume path works against S3 (a local moto server through s3fs)."""


import pytest
import torch

from raydist.parallel.runtime import free_port, spawn
from raydist.testing import logits_after_load, run_fit, tiny_config


@pytest.fixture(scope="module")
def fsdp4_checkpoint(tiny_data, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("fsdp4") / "run")
    raw = tiny_config(tiny_data, train={"steps": 3}, parallel={"dp_shard": 4},
                      checkpoint={"every_steps": 0, "async_save": False})
    run_fit(raw, 4, run_dir)
    return run_dir


TOKENS = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def reference_logits(tiny_data, fsdp4_checkpoint):
    """The checkpoint loaded into one process; it must differ from the untrained model's output."""
    reference = spawn(logits_after_load, 1, tiny_config(tiny_data), fsdp4_checkpoint, TOKENS, 3)[0]
    untrained = spawn(logits_after_load, 1, tiny_config(tiny_data), None, TOKENS)[0]
    assert (reference - untrained).abs().max() > 1e-3  # the load changed the weights
    return reference


@pytest.mark.parametrize("layout, world", [
    ({"dp_replicate": 1, "dp_shard": 2}, 2),
    ({"dp_replicate": 2, "dp_shard": 1}, 2),
    ({"dp_replicate": 1, "tp": 2}, 2),
], ids=["fsdp2", "ddp2", "tp2"])
def test_fsdp4_checkpoint_loads_into_other_layouts(tiny_data, fsdp4_checkpoint, reference_logits, layout, world):
    got = spawn(logits_after_load, world, tiny_config(tiny_data, parallel=layout), fsdp4_checkpoint, TOKENS, 3)
    reference = reference_logits
    for rank_logits in got:
        torch.testing.assert_close(rank_logits, reference, rtol=1e-6, atol=1e-6)


@pytest.fixture
def s3_server(monkeypatch):
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"}.items():
        monkeypatch.setenv(key, value)
    import fsspec.config
    import s3fs

    fsspec.config.set_conf_env(fsspec.config.conf)
    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir("raydist-test")
    yield "s3://raydist-test"
    server.stop()


def test_checkpoint_save_and_resume_on_s3(tiny_data, s3_server):
    import s3fs

    run_dir = f"{s3_server}/runs/r1"
    raw = tiny_config(tiny_data, train={"steps": 6, "global_batch": 8}, parallel={"dp_replicate": 2},
                      checkpoint={"every_steps": 3, "async_save": False})
    reference = run_fit(tiny_config(tiny_data, train={"steps": 6, "global_batch": 8}, parallel={"dp_replicate": 2}),
                        2, None)
    assert run_fit(raw, 2, run_dir, crash_after_step=5) is None
    fs = s3fs.S3FileSystem()
    assert fs.exists(f"{run_dir}/checkpoints/step_00000003/COMMIT.json")
    resumed = run_fit(raw, 2, run_dir)
    assert resumed[0].losses == pytest.approx(reference[0].losses[3:], rel=1e-6)
    assert fs.exists(f"{run_dir}/checkpoints/step_00000006/COMMIT.json")
    from raydist.metrics.logger import read_metrics

    # object stores: one metrics part per writer (metrics.jsonl.d/), merged by the reader
    assert fs.exists(f"{run_dir}/summary.json") and [r["step"] for r in read_metrics(run_dir)][-1] == 6
