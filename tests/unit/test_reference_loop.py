"""An independent reference for every equivalence test: the world-size-1 Trainer against a hand-written
training loop (plain model, AdamW, warmup + cosine, clipping, one batch per step). Every layout is compared
with the world-size-1 Trainer, so a bug in the Trainer itself would be shared by all of them; this test is
where such a bug shows."""

import math

import pytest
import torch
import torch.nn.functional as F

from raydist.config import Config
from raydist.parallel.runtime import spawn
from raydist.testing import tiny_config

STEPS = 8


def _train_both(raw: dict, plant: float | None = None) -> tuple[list[float], list[float], list[float], list[float],
                                                                 dict, dict]:
    """(the loop's losses, the Trainer's, the loop's gradient norms before clipping, the Trainer's, the loop's
    parameters after the last step, the Trainer's). `plant`: a planted bug, the Trainer's gradients scaled by
    it after backward."""
    from raydist.models.gpt import build_model
    from raydist.training.trainer import Trainer
    from test_harness_mutations import scale_gradients

    if plant is not None:
        scale_gradients(plant)
    cfg = Config.from_dict(raw)
    t = cfg.train
    trainer = Trainer(cfg, torch.device("cpu"))
    assert trainer.layout.num_microbatches == 4  # the Trainer accumulates; the loop below does not

    # ---- the hand-written loop ----
    model = build_model(cfg.model, cfg.data.seq_len, seed=t.seed)
    opt = adamw(model, t)
    mine, theirs, my_norms, their_norms = [], [], [], []
    for step in range(STEPS):
        tokens, ids = trainer.next_batch()
        stats = trainer.train_step((tokens, ids))
        theirs.append(stats.loss)
        their_norms.append(stats.grad_norm)
        loss, norm = hand_step(model, opt, tokens, step, t)
        mine.append(loss)
        my_norms.append(norm)
    trainer.close()
    return (mine, theirs, my_norms, their_norms, {n: p.detach().clone() for n, p in model.named_parameters()},
            trainer.full_parameters())


def adamw(model: torch.nn.Module, t) -> torch.optim.AdamW:
    """torch's AdamW as raydist configures it from `t` (the config's [train]): weight decay on matrices only."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": t.weight_decay},
                              {"params": vectors, "weight_decay": 0.0}], lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8)


def lr_at(t, step: int) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio at the last step, written out."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def hand_step(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, step: int, t
              ) -> tuple[float, float]:
    """One step of the hand-written loop on `tokens` (one batch, no accumulation): (loss, gradient norm before
    clipping)."""
    for group in opt.param_groups:
        group["lr"] = lr_at(t, step)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    opt.zero_grad()
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip))
    opt.step()
    return loss.item(), norm


def _compare(raw: dict, plant: float | None = None) -> None:
    [(mine, theirs, my_norms, their_norms, reference, trained)] = spawn(_train_both, 1, raw, plant)
    assert len(mine) == len(theirs) == STEPS and mine[0] > mine[-1]  # it trained
    for step, (a, b) in enumerate(zip(mine, theirs)):
        assert abs(a - b) / a < 1e-4, ("losses", step, mine, theirs)
    for step, (a, b) in enumerate(zip(my_norms, their_norms)):  # clip_grad_norm_'s return: before clipping
        assert abs(a - b) / a < 1e-4, ("gradient norms", step, my_norms, their_norms)
    assert set(reference) == set(trained)
    for name, param in reference.items():
        error = float((trained[name] - param).norm() / param.norm())
        assert error < 1e-4, (name, error)


# clipping at 1.5 acts on some steps (norms 1.8-4.2) and, late in the run, not on others
RAW = dict(train={"steps": STEPS, "global_batch": 8, "micro_batch": 2, "grad_clip": 1.5, "warmup_steps": 3})


def test_trainer_equals_a_hand_written_loop(tiny_data):
    _compare(tiny_config(tiny_data, **RAW))


@pytest.mark.parametrize("plant", [4.0, 0.5])
def test_a_trainer_whose_gradients_are_scaled_differs_from_the_loop(tiny_data, plant):
    """A planted bug (what a sum over 4 ranks instead of a mean does, or a halved gradient) fails the comparison."""
    with pytest.raises(AssertionError, match="gradient norms|losses"):
        _compare(tiny_config(tiny_data, **RAW), plant)
