"""The user's Config is the run's record and what every worker receives, unchanged: the driver's resolutions
(the storage made absolute, a new run name, the prepared data's path) are run facts of their own
(raydist.config.RunFacts, RUN_DIR/run.json), not rewrites of the config."""

from __future__ import annotations

import dataclasses
import json

import pytest

from raydist.config import RUN_FACTS, Config, RunFacts


def test_workers_and_config_toml_get_the_users_config_and_the_facts_apart(tiny_data, tmp_path, monkeypatch,
                                                                         launch_without_ray):
    from raydist.driver import launcher
    from raydist.testing import tiny_config

    monkeypatch.chdir(tmp_path)  # a relative storage: the driver resolves it, the config keeps it
    cfg = Config.from_dict(tiny_config(tiny_data, train={"steps": 2, "log_every": 1}, ray={"num_workers": 1},
                                       checkpoint={"storage": "runs", "every_steps": 2, "keep": 1}))
    assert cfg.train.run_name == "" and cfg.checkpoint.storage == "runs"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.run_name = "rewritten"  # type: ignore[misc]
    payloads = []
    build = launcher.build_trainer  # (the fixture's stand-in, which trains with run_fit's processes)
    monkeypatch.setattr(launcher, "build_trainer", lambda lp, use_gpu, start, record=False: (
        payloads.append(launcher.worker_payload(lp, use_gpu, start, record)), build(lp, use_gpu, start, record))[1])
    summary = launcher.launch(cfg, log=lambda *_: None)
    assert summary["steps"] == 2
    [payload] = payloads
    assert Config.from_dict(payload["config"]) == cfg  # what a worker builds: the user's config, as given
    facts = RunFacts.from_dict(payload["facts"])
    assert facts.storage == str(tmp_path / "runs") and facts.run_name.startswith("run-")
    assert facts.run_dir == f"{facts.storage}/{facts.run_name}" and facts.data_path == tiny_data
    run_dir = tmp_path / "runs" / facts.run_name
    assert Config.load(run_dir / "config.toml") == cfg  # the record: as given (relative storage, no run name)
    assert RunFacts.from_dict(json.loads((run_dir / RUN_FACTS).read_text())) == facts
    assert (run_dir / "checkpoints" / "step_00000002" / "COMMIT.json").exists()  # the run used the facts


def test_a_run_directory_without_run_json_reads_its_data_path_from_config_toml(tmp_path):
    from raydist.inference.load import read_run_facts

    assert read_run_facts(str(tmp_path)) is None  # (written before run.json: generate reads config.toml's)
    facts = RunFacts("r", str(tmp_path), "/data")
    (tmp_path / RUN_FACTS).write_text(json.dumps(facts.to_dict()))
    assert read_run_facts(str(tmp_path)) == facts
