"""Live recovery with FSDP inside each replica, under plain torch.distributed (no Ray): replicas of two
workers (parallel.dp_shard 2), each replica its own gloo world whose TCP store its torchft Managers share
(what Ray Train's process group per replica group gives), meeting through a real torchft Lighthouse.

- Two replicas from the first step: the loss of every step and the parameters after the last equal the
  single-process run's (1e-4 relative), and each step trained exactly its samples.
- Replica 1 joins after replica 0 stepped alone: each of its ranks receives its FSDP shards, optimizer state
  and data position from replica 0's same rank (torchft's PGTransport), then both step on; the losses and
  the final parameters of both replicas still equal the single-process run's."""

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


def _worker(replica: int, rank: int, port: int, lighthouse: str, raw: dict, expected: int, flag: str | None,
            out) -> None:
    import torch.distributed as dist

    from raydist.config import Config
    from raydist.elastic.live import TorchftReplicas, replica_config
    from raydist.elastic.policy import plan_layout
    from raydist.trainer import Trainer, TrainerOptions

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHFT_LIGHTHOUSE=lighthouse)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cfg = replica_config(Config.from_dict(raw))
    trainer = Trainer(cfg, torch.device("cpu"), plan_layout(cfg, 2), TrainerOptions(record_samples=True))
    replicas = TorchftReplicas(replica, torch.device("cpu"), 60.0, trainer.state_parts, replicas=expected,
                               rank=rank, workers=2)
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
        steps.append({"step": trainer.step, "loss": stats.loss, "count": stats.replicas,
                      "ids": stats.sample_ids.tolist()})
    params = {k: v.numpy() for k, v in trainer.full_parameters().items()}  # a collective in the replica
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
             for r in (0, 1) for j in (0, 1)}
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
        for name, want in reference.params.items():
            error = float((torch.from_numpy(res["params"][name]) - want).norm() / want.norm())
            assert error <= 1e-4, f"{name} differs by {error:.2e} on replica {res['replica']} rank {res['rank']}"
    # every step's samples, over the workers of the replicas that committed it, are the single-process step's
    for step in range(1, STEPS + 1):
        trained = sorted(i for res in results for rec in res["steps"] if rec["step"] == step for i in rec["ids"])
        assert trained == sorted(reference.sample_ids[step - 1].tolist()), f"step {step}"


@pytest.fixture(scope="module")
def setup(tiny_data):
    raw = tiny_config(tiny_data, train={"steps": STEPS})  # global_batch 8: replicas 4 + 4 rows, ranks 2 + 2
    [reference] = run_layout(raw, 1, steps=STEPS, record_samples=True)
    live = {**raw, "parallel": {"dp_replicate": 2, "dp_shard": 2}, "ray": {"num_workers": 4},
            "elastic": {"live_recovery": True}}
    return live, reference


def test_two_fsdp_replicas_equal_the_single_process_run(setup, tmp_path):
    live, reference = setup
    results = _run(live, late=False, tmp=tmp_path)
    assert all(not r["healed"] and r["retried"] == 0 for r in results)
    assert {rec["count"] for r in results for rec in r["steps"]} == {2}  # every step on both replicas
    assert all(len(r["steps"]) == STEPS for r in results)
    _check(results, reference)


def test_a_late_fsdp_replica_heals_from_the_same_ranks_and_the_run_stays_exact(setup, tmp_path):
    live, reference = setup
    results = _run(live, late=True, tmp=tmp_path)
    first, late = results[:2], results[2:]
    assert all(not r["healed"] for r in first) and all(r["healed"] for r in late)
    [healed_at] = {r["healed_at"] for r in late}  # both ranks of replica 1 healed to the same step
    assert ALONE_STEPS <= healed_at < STEPS
    counts = [rec["count"] for rec in first[0]["steps"]]
    assert counts[:ALONE_STEPS] == [1] * ALONE_STEPS and counts[-1] == 2, counts  # alone, then with replica 1
    assert [rec["step"] for rec in late[0]["steps"]] == list(range(healed_at + 1, STEPS + 1))
    _check(results, reference)
    for name in reference.params:  # the healed replica's shards are its peer's, rank by rank
        for a, b in zip(first, late):
            assert np.allclose(a["params"][name], b["params"][name], rtol=1e-6, atol=0)
