"""An independent reference for every equivalence test: the world-size-1 Trainer against a hand-written
training loop (plain model, AdamW, warmup + cosine, clipping, one batch per step). Every layout is compared
with the world-size-1 Trainer, so a bug in the Trainer itself would be shared by all of them; this test is
where such a bug shows."""

import math

import torch
import torch.nn.functional as F

from raydist.config import Config
from raydist.runtime import spawn
from raydist.testing import tiny_config

STEPS = 8


def _train_both(raw: dict) -> tuple[list[float], list[float], dict, dict]:
    from raydist.models.gpt import build_model
    from raydist.trainer import Trainer

    cfg = Config.from_dict(raw)
    t = cfg.train
    trainer = Trainer(cfg, torch.device("cpu"))
    assert trainer.layout.num_microbatches == 4  # the Trainer accumulates; the loop below does not

    # ---- the hand-written loop (20 lines) ----
    model = build_model(cfg.model, cfg.data.seq_len, seed=t.seed)
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": t.weight_decay},
                             {"params": vectors, "weight_decay": 0.0}], lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8)

    def lr_at(step: int) -> float:
        if step < t.warmup_steps:
            return t.lr * (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    mine, theirs = [], []
    for step in range(STEPS):
        tokens, ids = trainer.next_batch()
        theirs.append(trainer.train_step((tokens, ids)).loss)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        mine.append(loss.item())
    trainer.close()
    return mine, theirs, {n: p.detach().clone() for n, p in model.named_parameters()}, trainer.full_parameters()


def test_trainer_equals_a_hand_written_loop(tiny_data):
    raw = tiny_config(tiny_data, train={"steps": STEPS, "global_batch": 8, "micro_batch": 2, "grad_clip": 0.5,
                                        "warmup_steps": 3})
    [(mine, theirs, reference, trained)] = spawn(_train_both, 1, raw)
    assert len(mine) == len(theirs) == STEPS and mine[0] > mine[-1]  # it trained
    for step, (a, b) in enumerate(zip(mine, theirs)):
        assert abs(a - b) / a < 1e-4, (step, mine, theirs)
    assert set(reference) == set(trained)
    for name, param in reference.items():
        error = float((trained[name] - param).norm() / param.norm())
        assert error < 1e-4, (name, error)
