"""A checkpoint carries the parameters and AdamW's whole state (exp_avg, exp_avg_sq and step, per parameter)
exactly, across a change of layout: saved by FSDP2 over 2 ranks after 3 steps, loaded into one process, on
the CPU (tests/gpu/test_training_cuda.py checks the same in GPU memory, in one process and one layout)."""

from __future__ import annotations

import torch

from raydist.parallel.runtime import spawn
from raydist.testing import tiny_config

STEPS = 3
ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")


def _full_state(trainer) -> dict[tuple[str, str], torch.Tensor]:
    """{("param", name) and (AdamW's key, name): the full (unsharded) tensor on the CPU}; a collective for
    sharded tensors, so every rank calls it (in one order: the model's parameters, then each one's keys)."""
    out = {}
    for name, param in trainer.pm.model.named_parameters():
        for key, value in [("param", param), *trainer.optimizer.state.get(param, {}).items()]:
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            out[(key, name)] = full.detach().cpu().clone()
    return out


def _trainer(raw: dict, run_dir: str):
    from raydist.checkpoint import CheckpointManager
    from raydist.config import Config
    from raydist.parallel.runtime import pick_device
    from raydist.training.trainer import Trainer

    trainer = Trainer(Config.from_dict(raw), pick_device())
    return trainer, CheckpointManager(run_dir, keep=1, group=trainer.checkpoint_group, log=lambda *_: None)


def _train_and_save(raw: dict, run_dir: str) -> tuple[int, dict]:
    trainer, manager = _trainer(raw, run_dir)
    try:
        for _ in range(STEPS):
            trainer.train_step()
        manager.save(trainer.step, trainer.state_parts(), blocking=True)
        manager.wait()
        return trainer.step, _full_state(trainer)
    finally:
        trainer.close()


def _load(raw: dict, run_dir: str) -> tuple[int, dict]:
    trainer, manager = _trainer(raw, run_dir)  # untrained: step 0, no optimizer state yet
    try:
        manager.load(manager.latest(), trainer.state_parts())
        return trainer.step, _full_state(trainer)
    finally:
        trainer.close()


def test_fsdp2_checkpoint_loads_parameters_and_adam_moments_exactly_into_one_process(tiny_data, tmp_path):
    run_dir = str(tmp_path / "run")
    saved = spawn(_train_and_save, 2, tiny_config(tiny_data, parallel={"dp_shard": 2}), run_dir)
    assert saved[0][0] == STEPS and saved[0][1].keys() == saved[1][1].keys()
    [(step, loaded)] = spawn(_load, 1, tiny_config(tiny_data), run_dir)
    step_saved, state = saved[0]
    assert step == step_saved == STEPS

    names = {name for key, name in state if key == "param"}
    assert state.keys() == {(key, name) for key in ("param", *ADAM_KEYS) for name in names}  # nothing missing
    assert loaded.keys() == state.keys()
    for key in state:
        assert torch.equal(loaded[key], state[key]), f"{key} differs after the load"
    # not a vacuous match: every parameter took 3 steps, and the moments are those of real gradients
    assert all(float(state[("step", name)]) == STEPS for name in names)
    assert all(state[("exp_avg_sq", name)].abs().sum() > 0 for name in names)
