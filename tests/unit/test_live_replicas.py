"""Live recovery with a mesh inside each replica, under plain torch.distributed (no Ray): two replicas of two
workers each (FSDP: dp_shard 2; TP: tp 2; CP: cp 2), each replica its own gloo world whose TCP store its
torchft Managers share (what Ray Train's process group per replica group gives), meeting through a real
torchft Lighthouse.

- Two replicas from the first step: the loss of every step and the parameters after the last equal the
  single-process run's (1e-4 relative), and each step trained exactly its samples.
- Replica 1 joins after replica 0 stepped alone: each of its ranks receives its shards (FSDP's, TP's, or
  whole parameters under CP), optimizer state and data position from replica 0's same rank (torchft's
  PGTransport), then both step on; the losses and the final parameters of both replicas still equal the
  single-process run's."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
import pytest
import torch

from raydist.runtime import free_port
from raydist.testing import run_layout, tiny_config

pytest.importorskip("torchft")

STEPS, ALONE_STEPS = 6, 3
WORKERS = 2  # per replica
INSIDE = {"fsdp": {"dp_shard": 2}, "tp": {"tp": 2}, "cp": {"cp": 2}}  # each replica's mesh


def _worker(replica: int, rank: int, port: int, lighthouse: str, raw: dict, expected: int, flag: str | None,
            out) -> None:
    import torch.distributed as dist

    from raydist.config import Config
    from raydist.elastic.live import TorchftReplicas, replica_config
    from raydist.elastic.policy import plan_layout
    from raydist.trainer import Trainer, TrainerOptions

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHFT_LIGHTHOUSE=lighthouse)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORKERS)
    cfg = replica_config(Config.from_dict(raw))
    trainer = Trainer(cfg, torch.device("cpu"), plan_layout(cfg, WORKERS), TrainerOptions(record_samples=True))
    replicas = TorchftReplicas(replica, torch.device("cpu"), 60.0, trainer.state_parts, replicas=expected,
                               rank=rank, workers=WORKERS)
    trainer.replicas = replicas
    if flag is not None and replica == 1 and rank == 0:
        open(flag, "w").close()  # replica 1 is about to ask for its first quorum
    healed = replicas.join()
    steps = []
    while trainer.step < STEPS:
        if flag is not None and replica == 0 and trainer.step == ALONE_STEPS:
            while not os.path.exists(flag):  # replica 0 stepped alone so far; replica 1 comes now
                time.sleep(0.1)
            time.sleep(1.0)
        stats = trainer.train_step()
        ids = None if stats.sample_ids is None else stats.sample_ids.tolist()  # (batch leaders only)
        steps.append({"step": trainer.step, "loss": stats.loss, "count": stats.replicas, "ids": ids})
    # a collective in the replica; under a pipeline each rank holds its stages' parameters only
    params = {k: v.numpy() for k, v in trainer.full_parameters().items()}
    out.put({"replica": replica, "rank": rank, "healed": healed, "healed_at": replicas.healed_at, "steps": steps,
             "params": params, "retried": trainer.retried_steps})
    time.sleep(1.0)  # the peer replica reads its last quorum before this Manager goes
    replicas.shutdown()
    trainer.close()
    dist.destroy_process_group()


def _run(raw: dict, late: bool, tmp) -> list[dict]:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    flag = str(tmp / "replica-1-asks") if late else None
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ports = [free_port(), free_port()]
    # late: replica 0 starts stepping without waiting for a second replica (expected 1)
    procs = {(r, j): ctx.Process(target=_worker, args=(r, j, ports[r], lighthouse.address(), raw,
                                                       1 if late and r == 0 else 2, flag, out))
             for r in (0, 1) for j in range(WORKERS)}
    try:
        for (r, _), p in procs.items():
            if r == 0 or not late:
                p.start()
        if late:  # replica 1 starts once replica 0 has stepped alone
            time.sleep(5.0)
            for (r, _), p in procs.items():
                if r == 1:
                    p.start()
        results = [out.get(timeout=400) for _ in procs]
        for p in procs.values():
            p.join(60)
            assert p.exitcode == 0
        return sorted(results, key=lambda r: (r["replica"], r["rank"]))
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()


def _check(results: list[dict], reference) -> None:
    for res in results:
        for rec in res["steps"]:
            want = reference.losses[rec["step"] - 1]
            assert abs(rec["loss"] - want) / want <= 1e-4, (res["replica"], res["rank"], rec["step"], rec["loss"], want)
        for name, got in res["params"].items():
            want = reference.params[name]
            error = float((torch.from_numpy(got) - want).norm() / want.norm())
            assert error <= 1e-4, f"{name} differs by {error:.2e} on replica {res['replica']} rank {res['rank']}"
    for replica in (0, 1):  # each replica's ranks together hold the whole model
        held = {name for res in results if res["replica"] == replica for name in res["params"]}
        assert held == set(reference.params), (replica, sorted(held ^ set(reference.params)))
    # every step's samples, over the batch leaders of the replicas that committed it, are the single-process
    # step's, each once
    for step in range(1, STEPS + 1):
        trained = sorted(i for res in results for rec in res["steps"] if rec["step"] == step and rec["ids"] is not None
                         for i in rec["ids"])
        assert trained == sorted(reference.sample_ids[step - 1].tolist()), f"step {step}"


@pytest.fixture(scope="module")
def reference(tiny_data):
    raw = tiny_config(tiny_data, train={"steps": STEPS})  # global_batch 8: replicas 4 + 4 rows
    [single] = run_layout(raw, 1, steps=STEPS, record_samples=True)
    return raw, single


def _live(raw: dict, inside: str) -> dict:
    return {**raw, "parallel": {"dp_replicate": 2, **INSIDE[inside]}, "ray": {"num_workers": 2 * WORKERS},
            "elastic": {"live_recovery": True}}


@pytest.mark.parametrize("inside", list(INSIDE))
def test_two_replicas_equal_the_single_process_run(reference, tmp_path, inside):
    raw, single = reference
    results = _run(_live(raw, inside), late=False, tmp=tmp_path)
    assert all(not r["healed"] and r["retried"] == 0 for r in results)
    assert {rec["count"] for r in results for rec in r["steps"]} == {2}  # every step on both replicas
    assert all(len(r["steps"]) == STEPS for r in results)
    _check(results, single)


@pytest.mark.parametrize("inside", list(INSIDE))
def test_a_late_replica_heals_rank_by_rank_and_the_run_stays_exact(reference, tmp_path, inside):
    raw, single = reference
    results = _run(_live(raw, inside), late=True, tmp=tmp_path)
    first, late = results[:WORKERS], results[WORKERS:]
    assert all(not r["healed"] for r in first) and all(r["healed"] for r in late)
    [healed_at] = {r["healed_at"] for r in late}  # every rank of replica 1 healed to the same step
    assert ALONE_STEPS <= healed_at < STEPS
    counts = [rec["count"] for rec in first[0]["steps"]]
    assert counts[:ALONE_STEPS] == [1] * ALONE_STEPS and counts[-1] == 2, counts  # alone, then with replica 1
    assert [rec["step"] for rec in late[0]["steps"]] == list(range(healed_at + 1, STEPS + 1))
    _check(results, single)
    for a, b in zip(first, late):  # the healed replica's shards are its peer's, rank by rank
        assert a["params"].keys() == b["params"].keys()
        for name in a["params"]:
            assert np.allclose(a["params"][name], b["params"][name], rtol=1e-6, atol=0), (name, a["rank"])
