"""A real `raydist train` (a subprocess on an embedded local Ray, Ray Data reading the shards): the console
holds raydist's own lines only, Ray's driver and worker output is in RUN_DIR/logs/."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(400)]  # 89-106 s in CI against the default 180 s

REPO = Path(__file__).resolve().parents[2]
RAY_INTERNALS = ("(raylet)", "(TrainController", "(RayTrainWorker", "core_worker", "UserWarning")
# raydist's straggler warning is its own line too; on a loaded machine (CI's two cores, shared with another
# test's ranks) one rank can be twice the median's busy time, as a clean-clone run saw.
OWN_LINE = re.compile(r"^(run quiet: |Ray's own output goes to |started \d+ workers |step \d+/\d+ \| |"
                      r"warning: straggler: rank \d+ |done: )")


def test_the_console_shows_only_raydist_lines_and_logs_hold_ray_output(tiny_data, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "raydist", "train", "--set", f"data.path={tiny_data}", "--set", "data.seq_len=32",
         "--set", "data.reader=ray", "--set", "model.num_layers=2", "--set", "model.d_model=64",
         "--set", "model.ffn_hidden=128", "--set", "train.global_batch=8", "--set", "train.steps=12",
         "--set", "train.log_every=4", "--set", "train.eval_every=6", "--set", "train.eval_batches=1",
         "--set", f"checkpoint.storage={tmp_path}", "--set", "train.run_name=quiet"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-3000:]
    for marker in RAY_INTERNALS:
        assert marker not in console, f"{marker!r} on the console:\n{console}"
    lines = console.strip().splitlines()
    assert all(OWN_LINE.match(line) for line in lines), console
    assert [int(m.group(1)) for m in re.finditer(r"^step (\d+)/12 ", console, re.M)] == [0, 4, 6, 8, 12]
    done = lines[-1]
    assert re.match(r"done: 12 steps in \S+, loss \d+\.\d{3}, val loss \d+\.\d{3} -> \d+\.\d{3}, "
                    r"\d+(\.\d+)?k? tok/s; ", done), done  # rounded figures
    logs = tmp_path / "quiet" / "logs"
    workers = (logs / "workers.log").read_text()
    assert (logs / "driver.log").is_file()
    assert "(TrainController pid=" in workers and "(RayTrainWorker pid=" in workers
    assert "Reporting training result" in workers
    # Ray's other output (raylet lines, token authentication notes, warnings) varies from run to run: what
    # comes lands in these two files, never on the console (checked above)
