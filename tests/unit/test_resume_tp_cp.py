"""Resuming a tensor-parallel or context-parallel run, then training on: a TP 2 (+ SP) or CP 2 run's step-3
checkpoint (a copy of the 6-step run without its final checkpoint: as if killed before writing it) resumes in
the same layout or another and trains steps 4..6 with the uninterrupted run's losses (1e-4 relative) to its
final parameters (1e-4, relative norm per tensor). A crash itself is tests/unit/test_checkpoint_resume.py's. The
logits right after a load are tests/unit/test_tensor_parallel_checkpoint.py's; this adds the optimizer
state, the scheduler, the data position and the RNG, which only training after the load shows."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from raydist.config import Config
from raydist.testing import run_fit, tiny_config

STEPS, EVERY = 6, 3
LAYOUTS = {  # name: (parallel section, world size)
    "tp2": ({"tp": 2, "sequence_parallel": True}, 2),
    "cp2": ({"cp": 2}, 2),
    "dp2": ({"dp_replicate": 2}, 2),
    "single": ({}, 1),
}


def config(data: str, layout: str) -> dict:
    return tiny_config(data, train={"steps": STEPS}, parallel=LAYOUTS[layout][0],
                       checkpoint={"every_steps": EVERY, "keep": 3, "async_save": False})


def final_parameters(raw: dict, run_dir: str) -> dict[str, torch.Tensor]:
    """The parameters of the run's newest checkpoint (which must be the last step's), read in this process."""
    from raydist.inference.load import find_checkpoint, load_checkpoint_model
    from raydist.models.gpt import build_model

    cfg = Config.from_dict(raw)
    step, uri, commit = find_checkpoint(run_dir)
    assert step == STEPS, step
    model = build_model(cfg.model, cfg.data.seq_len, cfg.train.seed)
    load_checkpoint_model(model, uri, commit)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def saved(tiny_data, tmp_path_factory):
    """Per saving layout, made once: (its uninterrupted run's rank-0 losses, final parameters, run directory)."""
    made = {}

    def get(layout: str):
        if layout not in made:
            raw, world = config(tiny_data, layout), LAYOUTS[layout][1]
            root = tmp_path_factory.mktemp(f"saved-{layout}")
            reference = run_fit(raw, world, str(root / "run"))
            assert len(reference[0].losses) == STEPS
            made[layout] = (reference[0].losses, final_parameters(raw, str(root / "run")), root / "run")
        return made[layout]

    return get


@pytest.mark.parametrize("before, after", [("tp2", "tp2"), ("tp2", "dp2"), ("cp2", "cp2"), ("cp2", "single")])
def test_resume_then_train_equals_the_uninterrupted_run(tiny_data, tmp_path, saved, before, after):
    ref_losses, ref_params, ref_dir = saved(before)
    run_dir = str(tmp_path / "run")
    shutil.copytree(ref_dir, run_dir)
    shutil.rmtree(f"{run_dir}/checkpoints/step_{STEPS:08d}")  # the step-3 checkpoint is the newest
    raw = config(tiny_data, after)
    [first, *_] = run_fit(raw, LAYOUTS[after][1], run_dir)

    assert first.summary["restarts"] == 1 and first.summary["steps"] == STEPS
    got, want = np.array(first.losses), np.array(ref_losses[EVERY:])
    assert len(got) == STEPS - EVERY, first.losses  # resumed at the checkpoint: steps 4..6 again
    rel = np.abs(got - want) / want
    params = final_parameters(raw, run_dir)
    assert params.keys() == ref_params.keys()
    errors = {n: float((params[n] - ref_params[n]).norm() / ref_params[n].norm()) for n in params}
    worst = max(errors, key=errors.get)
    print(f"\n{before} -> {after}: largest loss difference {rel.max():.1e}, parameters {errors[worst]:.1e} ({worst})")
    assert (rel <= 1e-4).all(), f"losses after the resume {got.tolist()}, uninterrupted {want.tolist()}"
    assert errors[worst] <= 1e-4, f"parameter {worst} differs by {errors[worst]:.2e} (relative norm)"
