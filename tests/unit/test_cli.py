"""Bad input to `raydist train`: one `error:` line, exit status 2, before Ray or any worker starts."""

import subprocess
import sys

import pytest

from raydist.cli import main


@pytest.mark.parametrize("args, message", [
    (["--set", "train.bogus=1"], "error: unknown key train.bogus"),
    (["--set", "model.d_model=wide"], "error: model.d_model='wide' has the wrong type: expected int"),
    (["--set", "train.global_batch=0"], "error: train.global_batch=0 must be a positive integer"),
    (["--set", "model.num_layers=-2"], "error: model.num_layers=-2 must be a positive integer"),
    (["--set", "model.num_kv_heads=3"], "error: model.num_heads=4 is not divisible by model.num_kv_heads=3"),
    (["--set", "data.corpus=/nonexistent/dir/*.txt"], "error: data.corpus='/nonexistent/dir/*.txt' matches no files"),
    (["--set", "data.path=/nonexistent/prepared"], "error: /nonexistent/prepared: no manifest.json"),
    (["--set", "ray.num_workers=3"], "error: train.global_batch=16 must be divisible by dp (3); change"),
    (["no-such.toml"], "error: config file 'no-such.toml' not found"),
])
def test_bad_input_is_one_error_line(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("RAYDIST_CACHE", str(tmp_path / "cache"))
    assert main(["train", *args, "--set", f"checkpoint.storage={tmp_path}/runs"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(message), err
    assert len([line for line in err if line.startswith("error:")]) == 1
    assert not (tmp_path / "runs").exists()  # nothing written, no worker started


def test_console_script_exit_status(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "raydist", "train", "--set", "train.steps=-1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: train.steps=-1 must be a positive integer"
