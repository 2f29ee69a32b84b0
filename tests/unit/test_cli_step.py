"""`--step N` of `raydist eval`, `export`, `generate` and `verify`: a run directory with committed checkpoints
at steps 2 and 4. `--step 2` reads step 2, not the newest: each command gives with it what it gives without
it on a copy of the run whose step-4 checkpoint was removed (step 2 is then the newest), and something else
than the newest; a step the run does not hold is one `error:` line and exit status 2."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from raydist.config import Config
from raydist.testing import run_fit, tiny_config

PROMPT = ["--prompt", "import os\n", "--max-new-tokens", "24", "--temperature", "1.0", "--seed", "3", "--json"]


@pytest.fixture(scope="module")
def eval_data(tmp_path_factory) -> str:
    """176 rows of byte-level text (the training data's tokenizer and seq_len): `raydist eval` reads a whole
    split, and the shared data's validation split takes a minute on a loaded machine."""
    from pathlib import Path

    import raydist.config
    from raydist.config import DataConfig
    from raydist.data.prepare import prepare

    root = tmp_path_factory.mktemp("eval-data")
    (root / "text.txt").write_text(Path(raydist.config.__file__).read_text()[:6000])
    prepare(DataConfig(corpus=str(root / "text.txt"), seq_len=32, val_fraction=0.0), str(root / "data"),
            log=lambda *_: None)
    return str(root / "data")


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory) -> tuple[str, str]:
    """(a 4-step run with checkpoints 2 and 4, a copy of it without checkpoint 4)."""
    root = tmp_path_factory.mktemp("cli-step")
    run_dir, only_2 = str(root / "run"), str(root / "only-2")
    raw = tiny_config(tiny_data, train={"steps": 4, "lr": 1e-2, "warmup_steps": 0},
                      checkpoint={"every_steps": 2, "keep": 3, "async_save": False})
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "config.toml"), "w") as f:  # what the launcher writes (run_fit does not)
        f.write(Config.from_dict(raw).to_toml())
    run_fit(raw, 1, run_dir)
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["step_00000002", "step_00000004"]
    shutil.copytree(run_dir, only_2)
    shutil.rmtree(os.path.join(only_2, "checkpoints", "step_00000004"))
    return run_dir, only_2


def cli(capsys, *argv) -> tuple[int, str, str]:
    from raydist.cli import main

    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def ok(capsys, *argv) -> dict:
    code, out, err = cli(capsys, *argv)
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_eval_step(runs, eval_data, capsys):
    run_dir, only_2 = runs
    data = ["--data", eval_data, "--split", "train"]
    at_2 = ok(capsys, "eval", run_dir, *data, "--step", 2)
    newest = ok(capsys, "eval", run_dir, *data)
    alone = ok(capsys, "eval", only_2, *data)
    assert (at_2["step"], newest["step"], alone["step"]) == (2, 4, 2)
    assert at_2["loss"] == alone["loss"]
    assert abs(at_2["loss"] - newest["loss"]) > 1e-3 * newest["loss"], (at_2, newest)  # two steps apart


def test_export_step(runs, tmp_path, capsys):
    from safetensors.torch import load_file

    run_dir, only_2 = runs
    exported = {}
    for name, argv in {"at_2": [run_dir, "--step", 2], "newest": [run_dir], "alone": [only_2]}.items():
        got = ok(capsys, "export", *argv, "--hf", tmp_path / name)
        exported[name] = (got["step"], load_file(str(tmp_path / name / "model.safetensors")))
    assert {name: step for name, (step, _) in exported.items()} == {"at_2": 2, "newest": 4, "alone": 2}
    at_2, newest, alone = (tensors for _, tensors in exported.values())
    assert at_2.keys() == alone.keys() == newest.keys()
    for name in at_2:
        assert torch.equal(at_2[name], alone[name]), name
    assert [n for n in at_2 if not torch.equal(at_2[n], newest[n])], "step 2 exported the newest weights"


def test_generate_step(runs, capsys):
    run_dir, only_2 = runs
    at_2 = ok(capsys, "generate", run_dir, "--step", 2, *PROMPT)
    newest = ok(capsys, "generate", run_dir, *PROMPT)
    alone = ok(capsys, "generate", only_2, *PROMPT)
    assert (at_2["step"], newest["step"], alone["step"]) == (2, 4, 2)
    assert at_2["completion_ids"] == alone["completion_ids"]
    assert at_2["completion_ids"] != newest["completion_ids"]  # (sampled: the two models' draws part early)


def test_verify_step(runs, tmp_path, capsys):
    run_dir, _ = runs
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    # one byte of a step-2 shard changed, its size kept: only reading it in full finds it
    step_2 = copy / "checkpoints" / "step_00000002"
    shard = step_2 / sorted(f for f in os.listdir(step_2) if f.endswith(".raw"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    code, out, err = cli(capsys, "verify", copy, "--step", 2, "--json")
    [result] = json.loads(out)
    assert code == 1 and result["step"] == 2 and result["status"] == "corrupt", (out, err)
    code, out, err = cli(capsys, "verify", copy, "--step", 4, "--json")
    [result] = json.loads(out)
    assert code == 0 and result["step"] == 4 and result["status"] == "ok", (out, err)


@pytest.mark.parametrize("command", ["eval", "export", "generate", "verify"])
def test_a_step_the_run_lacks_is_one_error_line(runs, tiny_data, tmp_path, capsys, command):
    run_dir, _ = runs
    argv = {"eval": ["--data", tiny_data], "export": ["--hf", tmp_path / "out"], "generate": ["--prompt", "x"],
            "verify": []}[command]
    code, out, err = cli(capsys, command, run_dir, *argv, "--step", 3)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "step 3" in lines[0] and "[2, 4]" in lines[0], lines[0]  # names the step and the ones there are
    assert out == "" and not (tmp_path / "out").exists()
