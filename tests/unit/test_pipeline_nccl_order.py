"""The pipeline's transfers against NCCL's rules: the plan the executor used to follow deadlocks on NCCL,
caught twice (the validator's replay, and a real step under the strict-collectives mode), and today's plan
passes both for every schedule.

The old plan, rebuilt here: before any compute a rank posted the receive of its first receiving action
(rank 0's first backward's gradient), and after each action one batch of its send and the receive of the
next action that receives ("early"); the variant that posts only the next action's receive ("one ahead")
fixes GPipe and 1F1B but not the interleaved and V schedules.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from raydist import strict
from raydist.parallel.runtime import spawn
from raydist.schedule import nccl_model
from raydist.schedule.registry import make_schedule
from raydist.schedule.progress import ScheduleError
from raydist.schedule.transfer_plan import Posting, TransferPlan
from raydist.schedule.validate import validate


def old_plan(schedule, rank: int, lookahead: str) -> TransferPlan:
    plan = TransferPlan.of(schedule, rank)
    acts = plan.of_action
    receiving = [i for i, a in enumerate(acts) if a.recv is not None and not a.recv.local]
    posted: set[int] = set()
    points = []
    for p in range(len(acts) + 1):
        send = p - 1 if p > 0 and acts[p - 1].send is not None and not acts[p - 1].send.local else None
        due = next((i for i in receiving if i >= p), None) if lookahead == "early" else (p if p in receiving else None)
        recvs = () if due is None or due in posted else (due,)
        posted.update(recvs)
        points.append(Posting(((send, recvs),) if send is not None or recvs else ()))
    plan.postings = tuple(points)
    return plan


def _replay(schedule, lookahead: str | None) -> None:
    plans = None if lookahead is None else [old_plan(schedule, r, lookahead) for r in range(schedule.num_ranks)]
    nccl_model.replay(schedule, plans)


OLD_DEADLOCKS = [("gpipe", 2, 4, 1, "early"), ("1f1b", 2, 4, 1, "early"), ("1f1b", 4, 8, 1, "early"),
                 ("interleaved", 2, 4, 2, "early"), ("zbh1", 2, 4, 1, "early"), ("zbv", 2, 4, 2, "early"),
                 ("interleaved", 2, 4, 2, "one ahead"), ("interleaved", 4, 8, 2, "one ahead"),
                 ("zbv", 4, 8, 2, "one ahead")]


@pytest.mark.parametrize("kind, p, m, v, lookahead", OLD_DEADLOCKS, ids=lambda x: str(x))
def test_the_old_plans_deadlock_on_nccl(kind, p, m, v, lookahead):
    schedule = make_schedule(kind, p, m, v)
    with pytest.raises(ScheduleError, match="would deadlock on NCCL.*rank 0 waits for"):
        _replay(schedule, lookahead)


def test_one_ahead_was_enough_for_gpipe_and_1f1b_only():
    for kind, p, m in itertools.product(("gpipe", "1f1b"), (2, 4), (2, 4, 8)):
        _replay(make_schedule(kind, p, m), "one ahead")


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved", "zbh1", "zbv"])
def test_the_plan_cannot_deadlock_on_nccl(kind):
    for p, m in itertools.product((1, 2, 3, 4, 8), (1, 2, 3, 4, 5, 8, 16)):
        v = 2 if kind in ("interleaved", "zbv") else 1
        if kind == "interleaved" and m % p or kind in ("zbh1", "zbv") and m < p:
            continue  # schedules make_schedule refuses
        schedule = make_schedule(kind, p, m, v)
        validate(schedule)  # includes the NCCL replay of the executor's plan
        _replay(schedule, None)


def test_the_replay_catches_messages_out_of_order():
    schedule = make_schedule("1f1b", 2, 4)
    plans = [TransferPlan.of(schedule, r) for r in range(2)]
    receiving = [i for i, a in enumerate(plans[1].of_action) if a.recv is not None and a.recv.what == "activation"]
    first, second = receiving[:2]
    # rank 1 posts the receive of its second activation before its first's: NCCL would swap the tensors
    moved = tuple(Posting(tuple((send, tuple(i for i in recvs if i not in (first, second)))
                                for send, recvs in posting.batches)) for posting in plans[1].postings)
    plans[1].postings = (Posting(((None, (second,)), (None, (first,))) + moved[0].batches),) + moved[1:]
    with pytest.raises(ScheduleError, match="NCCL matches messages by order: rank 0's send to rank 1 #0 \\(activation "
                                            "of micro-batch 0 .* meets rank 1's recv from rank 0 #0 \\(activation "
                                            "of micro-batch 1"):
        nccl_model.replay(schedule, plans)


# ---- a real step under the strict mode ------------------------------------------------------------------


def _step(kind: str, virtual: int, lookahead: str | None) -> float:
    from raydist.parallel.pipeline_executor import PipelineExecutor

    torch.manual_seed(0)
    p, m, width = dist.get_world_size(), 4, 8
    schedule = make_schedule(kind, p, m, virtual)
    chunks = [torch.nn.Linear(width, width) for _ in range(schedule.virtual_stages)]
    executor = PipelineExecutor(chunks, schedule, dist.get_rank(), None, activation_shape=(2, width),
                                loss_fn=lambda out, y: ((out - y) ** 2).mean())
    if lookahead is not None:  # the executor as it was: its transfer plan
        for plan in (executor._train_plan,):
            plan.transfers.postings = old_plan(schedule, dist.get_rank(), lookahead).postings
    inputs = [torch.randn(2, width) for _ in range(m)]
    targets = [torch.randn(2, width) for _ in range(m)]
    stats = executor.step(inputs, targets)
    return float(stats.loss)


@pytest.fixture
def strict_mode(monkeypatch):
    monkeypatch.setenv(strict.ENV, "1")


@pytest.mark.parametrize("kind, virtual", [("1f1b", 1), ("zbv", 2)])
def test_the_old_transfer_order_deadlocks_under_the_strict_mode(strict_mode, kind, virtual):
    with pytest.raises(RuntimeError) as info:
        spawn(_step, 2, kind, virtual, "early", timeout_s=60)
    error = str(info.value)
    assert "strict collectives: deadlock" in error and "rank 0 on group '0' (ranks [0, 1]) runs" in error, error


@pytest.mark.parametrize("kind, virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zbh1", 1), ("zbv", 2)])
def test_the_executor_passes_under_the_strict_mode(strict_mode, kind, virtual):
    losses = spawn(_step, 2, kind, virtual, None, timeout_s=60)
    assert losses[0] == losses[1] and losses[0] > 0
