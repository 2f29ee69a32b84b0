"""The equivalence harness (raydist.testing.assert_equivalent) proven by the bugs it catches.

Each case runs a two-rank layout with one planted bug, against the single process without it, and the
harness must fail; the same layouts without a bug must pass (so the failure is the bug's). The bugs are
the ones a parallel trainer really makes:
- gradients x4 (a sum over 4 data-parallel ranks where a mean belongs) and x0.5: the losses of a short
  run and AdamW's updates barely react to a uniform scale, the gradient norms do;
- one micro-batch's gradient dropped from the accumulation (its loss still reported);
- one rank that keeps its own gradients instead of the data-parallel mean (the all-reduce still runs: a
  rank that skipped the collective would hang, which the strict-collectives mode reports);
- the learning-rate schedule one step ahead;
- a parameter frozen by mistake (a norm weight: the loss barely notices, the gradient check does);
- clipping by each rank's own shard's norm instead of the whole model's (the norm after clipping shows it).
"""

from __future__ import annotations

import pytest

from raydist.parallel.runtime import harness_device, spawn
from raydist.testing import assert_equivalent, run_layout, tiny_config

STEPS = 4
FROZEN = "layers.1.ffn_norm.weight"

# bug -> (the layout it is planted in, what the harness's failure says)
CASES = {
    "gradients x4": ({"dp_shard": 2}, "gradient norms before clipping differ"),
    "gradients x0.5": ({"dp_replicate": 2}, "gradient norms before clipping differ"),
    "micro-batch dropped": ({"dp_replicate": 2}, "differ"),
    "one rank keeps its own gradients": ({"dp_replicate": 2}, "differ"),
    "lr schedule one step ahead": ({"tp": 2}, "losses differ"),
    "parameter frozen": ({"tp": 2}, f"received no gradient in the last step: \\['{FROZEN}'\\]"),
    # clipping by each rank's own shard's norm: AdamW's update is nearly blind to a per-element scale
    "clipped by the shard's own norm": ({"dp_shard": 2}, "gradient norms (before|after) clipping differ"),
}
CLIPPING = 1.0  # the clipping case clips every step (the tiny config's 2.5 lets half of them through)


def scale_gradients(factor: float) -> None:
    """Plant in this process: every gradient scaled by `factor` after each step's backward (a sum over
    `factor` data-parallel ranks where a mean belongs). Also planted by test_reference_loop and
    test_fsdp_bf16."""
    from raydist.training.runners import AccumulationRunner

    step = AccumulationRunner.step

    def scaled(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        for param in self.params:
            param.grad.mul_(factor)
        return out

    AccumulationRunner.step = scaled


def _plant(bug: str) -> None:
    """Patch this process's raydist with `bug` (each rank is a fresh process: nothing leaks out)."""
    import torch.distributed as dist

    import raydist.parallel.data_parallel as data_parallel
    import raydist.training.trainer as trainer_module
    from raydist.training.runners import AccumulationRunner

    if bug.startswith("gradients x"):
        scale_gradients(float(bug.removeprefix("gradients x")))
    elif bug == "micro-batch dropped":
        forward_loss, step = AccumulationRunner.forward_loss, AccumulationRunner.step

        def counting_step(self, *args, **kwargs):
            self.planted_count = 0
            return step(self, *args, **kwargs)

        def dropping_forward_loss(self, micro):
            loss = forward_loss(self, micro)
            self.planted_count += 1
            # the first micro-batch's loss counts, its gradient does not (a leaf: backward reaches no weight)
            return loss.detach().requires_grad_() if self.planted_count == 1 else loss

        AccumulationRunner.step, AccumulationRunner.forward_loss = counting_step, dropping_forward_loss
    elif bug == "one rank keeps its own gradients":
        apply_ddp = data_parallel.apply_ddp

        def keep_local(group, bucket):
            buffer = bucket.buffer()
            local = buffer.clone()
            buffer.div_(dist.get_world_size(group))  # rank 0 still gets the right mean
            return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda _: local)

        def planted_ddp(module, group, device):
            wrapped = apply_ddp(module, group, device)
            if dist.get_rank() == 1:
                wrapped.register_comm_hook(group, keep_local)
            return wrapped

        data_parallel.apply_ddp = planted_ddp
    elif bug == "clipped by the shard's own norm":
        clip = AccumulationRunner.clip

        def local_clip(self, max_norm):
            total = clip(self, 0.0)  # the right norm is reported
            if max_norm > 0:
                grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in self.params]
                local = float(sum(g.pow(2).sum() for g in grads)) ** 0.5
                for grad in grads:
                    grad.mul_(min(1.0, max_norm / (local + 1e-6)))
            return total

        AccumulationRunner.clip = local_clip
    elif bug == "lr schedule one step ahead":
        lr_lambda = trainer_module.lr_lambda
        trainer_module.lr_lambda = lambda cfg: (lambda step, f=lr_lambda(cfg): f(step + 1))
    elif bug == "parameter frozen":
        apply_peft = trainer_module.apply_peft

        def freezing(model, *args):
            apply_peft(model, *args)
            model.get_parameter(FROZEN).requires_grad_(False)

        trainer_module.apply_peft = freezing
    else:
        raise ValueError(bug)


def _planted_run(bug: str | None, raw: dict, steps: int):
    from raydist.testing import _run

    if bug is not None:
        _plant(bug)
    return _run(raw, steps, False, True)


def _layout_results(raw: dict, parallel: dict, bug: str | None):
    raw = {**raw, "parallel": {"dp_replicate": 1, "dp_shard": 1, **parallel}}
    return spawn(_planted_run, 2, bug, raw, STEPS, device=harness_device(2))


def _raw(data: str, grad_clip: float | None = None) -> dict:
    return tiny_config(data, train={"steps": STEPS, **({"grad_clip": grad_clip} if grad_clip else {})})


@pytest.fixture(scope="module")
def raw(tiny_data):
    return _raw(tiny_data)


@pytest.fixture(scope="module")
def single(raw):
    [ref] = run_layout(raw, 1, steps=STEPS)
    return ref


@pytest.fixture(scope="module")
def clipping(tiny_data):
    """(config, single-process run) clipping every step."""
    raw = _raw(tiny_data, CLIPPING)
    [ref] = run_layout(raw, 1, steps=STEPS)
    assert min(ref.grad_norms) > CLIPPING
    return raw, ref


def _equivalent(single, ranks) -> None:
    for rank in ranks:
        assert_equivalent(single, rank)


@pytest.mark.parametrize("parallel", [{"dp_shard": 2}, {"dp_replicate": 2}, {"tp": 2}],
                         ids=["fsdp2", "ddp2", "tp2"])
def test_the_layouts_without_a_bug_pass(raw, single, parallel):
    _equivalent(single, _layout_results(raw, parallel, None))


@pytest.mark.parametrize("bug", list(CASES))
def test_the_harness_catches_a_planted_bug(raw, single, clipping, bug):
    parallel, says = CASES[bug]
    if bug == "clipped by the shard's own norm":
        raw, single = clipping
        _equivalent(single, _layout_results(raw, parallel, None))  # the layout clipping, without the bug
    ranks = _layout_results(raw, parallel, bug)
    with pytest.raises(AssertionError, match=says):
        _equivalent(single, ranks)
