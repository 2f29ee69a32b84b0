"""A step's loss and gradient norm stay on the device until read: no collective or host sync per step.

Reading any step's `loss` settles every step still pending with one all-reduce; the values equal what
reading every step gives (and the equivalence tests compare those with one process)."""

import torch.distributed as dist

from raydist.config import Config
from raydist.parallel.runtime import spawn
from raydist.testing import tiny_config


def _steps(raw: dict, steps: int, read_each: bool):
    from raydist.elastic.session import LocalSession
    from raydist.parallel.runtime import pick_device
    from raydist.training.trainer import Trainer

    cfg = Config.from_dict(raw)
    trainer = Trainer(cfg, pick_device(), LocalSession().start(cfg))
    calls = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tuple(tensor.shape))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        stats, losses = [], []
        for _ in range(steps):
            stats.append(trainer.train_step())
            if read_each:
                losses.append(stats[-1].loss)
        during = list(calls)
        last = stats[-1].loss  # settles every pending step
        losses = losses or [s.loss for s in stats]
        norms = [s.grad_norm for s in stats]
    finally:
        dist.all_reduce = real
        trainer.close()
    return {"during": during, "after": calls[len(during):], "losses": losses, "norms": norms, "last": last}


def test_losses_are_reduced_once_when_read(tiny_data):
    raw = tiny_config(tiny_data, train={"steps": 4, "global_batch": 4, "micro_batch": 1},
                      parallel={"dp_replicate": 2})
    lazy = spawn(_steps, 2, raw, 4, False)
    eager = spawn(_steps, 2, raw, 4, True)
    for rank in range(2):
        # DDP's gradient all-reduces go through its reducer, not dist.all_reduce: the only calls counted
        # are the loss means, none of them while stepping, one for all four steps at the first read
        assert lazy[rank]["during"] == [] and lazy[rank]["after"] == [(4,)]
        assert eager[rank]["during"] == [(1,)] * 4
        assert lazy[rank]["losses"] == eager[rank]["losses"]
        assert lazy[rank]["norms"] == eager[rank]["norms"]
        assert lazy[rank]["last"] == lazy[rank]["losses"][-1]
    assert lazy[0]["losses"] == lazy[1]["losses"]
