"""Credentials in a storage URI never reach config.toml, events, logs or printed lines; the I/O still uses
the real URI (the credfile:// test storage refuses every request without them)."""

import os

import pytest

from faults_fs import KEY, SECRET
from raydist.store.redact import redact


@pytest.mark.parametrize("text, expected", [
    ("s3://AKIA:abc/def+g@bucket/runs", "s3://***@bucket/runs"),
    ("ftp://user:pw@host:21/x", "ftp://***@host:21/x"),
    ("gs://ya29.tok@bucket/a", "gs://***@bucket/a"),
    ("https://h/x?token=abc&n=1", "https://h/x?token=***&n=1"),
    ("s3://b/k?X-Amz-Algorithm=A&X-Amz-Credential=AKIA/2025&X-Amz-Signature=f00&X-Amz-Security-Token=t",
     "s3://b/k?X-Amz-Algorithm=A&X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Security-Token=***"),
    ("abfs://c@acct.dfs.core.windows.net/p?sv=2022&sig=zz%2B#f", "abfs://***@acct.dfs.core.windows.net/p?sv=2022&sig=***#f"),
    ('storage = "s3://K:S@b/r"\npath = "/data"', 'storage = "s3://***@b/r"\npath = "/data"'),
    ("checkpoint s3://K:S@b/r/step_5 is unusable (x); trying", "checkpoint s3://***@b/r/step_5 is unusable (x); trying"),
    ("(see https://h/x?token=abc)", "(see https://h/x?token=***)"),
    ("/plain/local/path and file:///tmp/a@b", "/plain/local/path and file:///tmp/a@b"),
])
def test_redact(text, expected):
    assert redact(text) == expected


def test_a_run_on_storage_with_credentials_writes_and_prints_none(tiny_data, tmp_path, capfd, launch_without_ray):
    from raydist.cli import main
    from raydist.config import dump_toml
    from raydist.metrics.goodput import read_events
    from raydist.testing import tiny_config

    storage = f"credfile://{KEY}:{SECRET}@store{tmp_path}/runs"
    config = tmp_path / "run.toml"
    config.write_text(dump_toml(tiny_config(tiny_data, train={"steps": 4, "log_every": 2}, ray={"num_workers": 1},
                                            checkpoint={"every_steps": 2, "keep": 1})))
    assert main(["train", str(config), "--set", f"checkpoint.storage={storage}", "--set", "train.run_name=cred"]) == 0
    out, err = capfd.readouterr()
    run_dir = tmp_path / "runs" / "cred"
    assert "run directory credfile://***@store" in out and "done: 4 steps" in out
    toml = (run_dir / "config.toml").read_text()
    assert f'storage = "credfile://***@store{tmp_path}/runs"' in toml
    events = read_events(f"{storage}/cred")  # the real URI reads them back
    checkpoints = [e for e in events if e["kind"] == "checkpoint"]
    assert checkpoints and checkpoints[-1]["path"] == f"credfile://***@store{tmp_path}/runs/cred/checkpoints/step_00000004"
    for text, where in [(out, "stdout"), (err, "stderr")] + [
            (open(os.path.join(d, f), "rb").read().decode("latin-1"), os.path.join(d, f))
            for d, _, names in os.walk(tmp_path / "runs") for f in names]:
        assert SECRET not in text and KEY not in text, where  # every file: config, events, .metadata, ...
    assert not (run_dir / "lease.json").exists()
