"""Live recovery's step without Ray or torchft: the global batch re-split over the replicas of each step's
quorum, gradients and loss weighted by each replica's share, a step that fails inside the all-reduce redone
by the survivors. Three replica processes (each its own world of one, as under Ray Train's replica groups)
meet through a plain gloo group per quorum; replica 2 is lost inside step 4. The losses of every step and
the parameters after the last equal the single-process run's, and the committed steps trained exactly the
single-process run's samples."""

from __future__ import annotations

import os
from datetime import timedelta

import numpy as np
import pytest
import torch

from raydist.elastic.live import Membership, Replicas, live_slice
from raydist.schedule.batch import largest_divisor
from raydist.testing import run_layout, tiny_config
from raydist.parallel.runtime import caller_process, start_method_context
from workers import patience

STEPS, LOST_AT_STEP = 6, 4


def test_live_slice_partitions_the_global_batch():
    for count in range(1, 9):
        spans = [live_slice(80, 8, rank, count) for rank in range(count)]
        assert spans[0][0] == 80 and spans[-1][1] == 88
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        sizes = [b - a for a, b in spans]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    with pytest.raises(ValueError):
        live_slice(0, 8, 2, 2)
    assert largest_divisor(6, 4) == 3 and largest_divisor(5, 2) == 1 and largest_divisor(8, 8) == 8


def test_membership_events_and_time_to_rejoin():
    m = Membership()
    assert m.update([0], 1.0) == []  # the start: replica 1 not seen yet is no event
    assert m.update([0, 1], 2.0) == []
    assert m.update([0], 3.0) == [("replica_lost", {"replica": 1, "replicas": 1})]
    moved = Membership()
    moved.load_state_dict(m.state_dict())  # a replacement receives it with the live state
    assert moved.update([0, 1], 10.5) == [("replica_joined", {"replica": 1, "replicas": 2, "time_to_rejoin_s": 7.5})]


class ScriptedReplicas(Replicas):
    """Quorums by attempt: three replicas for steps 1-3 and the first try of step 4, which fails (replica 2
    dies after its all-reduce); replicas 0 and 1 from then on. One gloo group per quorum, over a file store."""

    def __init__(self, replica: int, store_dir: str):
        self.replica, self.store_dir = replica, store_dir
        self.attempt, self.groups = 0, {}

    def members(self) -> tuple[int, ...]:
        return (0, 1, 2) if self.attempt < LOST_AT_STEP else (0, 1)

    def begin_step(self) -> tuple[int, int]:
        members = self.members()
        return members.index(self.replica), len(members)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        members = self.members()
        if members not in self.groups:
            store = torch.distributed.FileStore(os.path.join(self.store_dir, "-".join(map(str, members))), len(members))
            self.groups[members] = torch.distributed.ProcessGroupGloo(store, members.index(self.replica), len(members),
                                                                      timedelta(seconds=60))
        self.groups[members].allreduce([tensor]).wait()

    def should_commit(self) -> bool:
        failed = self.attempt == LOST_AT_STEP - 1  # replica 2 is lost inside this attempt's step
        self.attempt += 1
        if failed and self.replica == 2:
            raise SystemExit  # this replica dies
        return not failed


def _replica(replica: int, raw: dict, tmp: str, out) -> None:
    import torch.distributed as dist

    from raydist.config import Config
    from raydist.planner.policy import replica_layout
    from raydist.training.trainer import Trainer, TrainerOptions

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/world-{replica}", rank=0, world_size=1)
    cfg = Config.from_dict(raw)
    trainer = Trainer(cfg, torch.device("cpu"), replica_layout(cfg), TrainerOptions(record_samples=True))
    trainer.replicas = ScriptedReplicas(replica, tmp)
    losses, spans = [], []
    try:
        for _ in range(STEPS):
            stats = trainer.train_step()
            losses.append(stats.loss)
            spans.append(trainer.last_span)
    except SystemExit:
        pass
    params = {k: v.numpy() for k, v in trainer.full_parameters().items()} if trainer.step == STEPS else {}
    out.put((replica, losses, spans, [ids.tolist() for ids in trainer.sample_log], params, trainer.retried_steps))
    trainer.close()


def test_resplit_over_the_live_replicas_equals_the_single_process_step(tiny_data, tmp_path):
    raw = tiny_config(tiny_data)  # global_batch 8: 3 replicas take 3 + 3 + 2 rows, 2 replicas 4 + 4
    [reference] = run_layout(raw, 1, steps=STEPS, record_samples=True)
    live_raw = {**raw, "parallel": {"dp_replicate": 3, "dp_shard": 1}, "ray": {"num_workers": 3},
                "elastic": {"live_recovery": True}}
    ctx = start_method_context()  # forks of the fork server, torch and raydist imported once
    out = ctx.Queue()
    procs = [caller_process(ctx, _replica, r, live_raw, str(tmp_path), out) for r in range(3)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        replica, *rest = out.get(timeout=patience(300))
        results[replica] = rest
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for replica in (0, 1):
        losses, _, _, params, retried = results[replica]
        assert retried == 1  # the step replica 2 died in was redone
        rel = np.abs(np.asarray(losses) - reference.losses) / np.asarray(reference.losses)
        assert (rel <= 1e-4).all(), (losses, reference.losses)
        for name, want in reference.params.items():
            error = float((torch.from_numpy(params[name]) - want).norm() / want.norm())
            assert error <= 1e-4, f"{name} differs by {error:.2e} on replica {replica}"
    assert len(results[2][0]) == LOST_AT_STEP - 1  # replica 2 committed steps 1-3 only
    # every committed step's samples, over its replicas, are the single-process step's, each once
    for step in range(STEPS):
        trained = sorted(i for r in results.values() if step < len(r[2]) for i in r[2][step])
        assert trained == sorted(reference.sample_ids[step].tolist()), f"step {step + 1}"
    assert [s for s in (results[0][1][LOST_AT_STEP - 1], results[1][1][LOST_AT_STEP - 1])] == \
           [((LOST_AT_STEP - 1) * 8, (LOST_AT_STEP - 1) * 8 + 4), ((LOST_AT_STEP - 1) * 8 + 4, LOST_AT_STEP * 8)]
