"""Live recovery with a mesh inside each replica, under plain torch.distributed (no Ray): two replicas of two
workers each (FSDP: dp_shard 2; TP: tp 2; CP: cp 2; PP: pp 2), each replica its own gloo world whose TCP
store its torchft Managers share (what Ray Train's process group per replica group gives), meeting through
a real torchft Lighthouse.

- Two replicas from the first step (tp 2 inside): every step's loss and gradient norms equal the
  single-process run's, and a parameter left without its gradient in the last step fails the check below.
- Replica 1 joins after replica 0 stepped alone: each of its ranks receives its shards (FSDP's, TP's, a
  pipeline stage's, or whole parameters under CP), optimizer state and data position from replica 0's rank
  of the same mesh coordinates (torchft's PGTransport), then both step on; the losses, gradients and final
  parameters of both replicas still equal the single-process run's (raydist.testing.assert_equivalent: 1e-4
  relative, every parameter with a gradient, each replica's ranks together holding the whole model), and
  each step trained exactly its samples."""

from __future__ import annotations

import os
import queue
import time

import numpy as np
import pytest
import torch
from torchft.coordination import LighthouseServer  # (the test extra installs it: missing, an error, not a skip)

from raydist.config import Config, ConfigError
from raydist.parallel.runtime import caller_process, start_method_context
from raydist.testing import LayoutResult, assert_equivalent, assert_same_steps, run_layout, tiny_config
from workers import patience

STEPS, ALONE_STEPS = 6, 3
WORKERS = 2  # per replica
INSIDE = {"fsdp": {"dp_shard": 2}, "tp": {"tp": 2}, "cp": {"cp": 2}, "pp": {"pp": 2},  # each replica's mesh
          "ep": {"dp_shard": 2, "ep": 2}}  # (a mixture of experts, its experts split over the replica's 2 ranks)
MOE = dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, ffn_hidden=128, vocab_size=320,
           moe_experts=4, moe_top_k=2, moe_ffn_hidden=48, moe_aux_coef=0.5)
DROPPED = "layers.0.attention.wq.weight"  # (a tensor-parallel shard under tp)


def _replica_store(rank: int, port_file: str, workers: int = WORKERS):
    """The replica's TCP store (what Ray Train's process group gives): rank 0 listens on a port the OS picks
    and writes it to `port_file`, the other ranks read it there. A port picked by the test before starting the
    late replica was taken by then in a clean-clone CI run (EADDRINUSE: replica 1 starts minutes later)."""
    from datetime import timedelta

    import torch.distributed as dist

    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, workers, is_master=True, timeout=timedelta(seconds=600),
                              wait_for_workers=False)  # (the others learn its port from the file below)
        with open(port_file + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(port_file + ".tmp", port_file)
        return store
    deadline = time.monotonic() + 600
    while not os.path.exists(port_file):
        assert time.monotonic() < deadline, f"no {port_file} from the replica's rank 0"
        time.sleep(0.05)
    with open(port_file) as f:
        port = int(f.read())
    return dist.TCPStore("127.0.0.1", port, workers, is_master=False, timeout=timedelta(seconds=600))


def _worker(replica: int, rank: int, port_file: str, lighthouse: str, raw: dict, expected: int, flag: str | None,
            drop: str | None, out, done) -> None:
    import torch.distributed as dist

    from raydist.elastic.live import TorchftReplicas
    from raydist.planner.policy import replica_layout
    from raydist.training.trainer import Trainer, TrainerOptions

    torch.set_num_threads(1)
    store = _replica_store(rank, port_file)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCHFT_LIGHTHOUSE=lighthouse)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORKERS)
    cfg = Config.from_dict(raw)
    trainer = Trainer(cfg, torch.device("cpu"), replica_layout(cfg),
                      TrainerOptions(record_samples=True, capture_grads=True))
    replicas = TorchftReplicas(replica, torch.device("cpu"), 60.0, trainer.state_parts, replicas=expected,
                               rank=rank, workers=WORKERS)
    trainer.replicas = replicas
    # The cross-replica sum gives a parameter without a gradient zeros: record which ones had none before it
    # (those received no gradient), and with `drop` take one's away in the last step (the check must fail)
    named = [(trainer.pm.aliases.get(n, n), p) for n, p in trainer.pm.model.named_parameters() if p.requires_grad]
    no_grad: set[str] = set()
    reduce = replicas.reduce

    def reduce_recording(*args):
        if drop is not None and trainer.step == STEPS - 1:
            for name, param in named:
                if name == drop:
                    param.grad = None
        no_grad.clear()
        no_grad.update(name for name, param in named if param.grad is None)
        return reduce(*args)

    replicas.reduce = reduce_recording
    if flag is not None and replica == 1 and rank == 0:
        open(flag, "w").close()  # replica 1 is about to ask for its first quorum
    healed = replicas.join()
    steps = []
    while trainer.step < STEPS:
        if flag is not None and replica == 0 and trainer.step == ALONE_STEPS:
            open(flag + ".alone", "w").close()  # replica 0 stepped alone: replica 1 may start
            while not os.path.exists(flag):  # replica 0 stepped alone so far; replica 1 comes now
                time.sleep(0.1)
            time.sleep(1.0)
        stats = trainer.train_step()
        ids = None if stats.sample_ids is None else stats.sample_ids.tolist()  # (batch leaders only)
        steps.append({"step": trainer.step, "loss": stats.loss, "grad_norm": stats.grad_norm,
                      "count": stats.replicas, "ids": ids})
    # a collective in the replica; under a pipeline each rank holds its stages' parameters only
    params = {k: v.numpy() for k, v in trainer.full_parameters().items()}
    grads = {k: v.numpy() for k, v in trainer.last_grads.items() if k not in no_grad}
    out.put({"replica": replica, "rank": rank, "healed": healed, "healed_at": replicas.healed_at, "steps": steps,
             "params": params, "grads": grads, "retried": trainer.retried_steps, "mesh": trainer.layout.degrees()})
    done.wait(600)  # every rank reported (so read its last quorum) before this Manager goes
    replicas.shutdown()
    trainer.close()
    dist.destroy_process_group()


def _run(raw: dict, late: bool, tmp, drop: str | None = None) -> list[dict]:
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    flag = str(tmp / "replica-1-asks") if late else None
    ctx = start_method_context()
    out, done = ctx.Queue(), ctx.Event()
    port_files = [str(tmp / f"replica-{r}.port") for r in (0, 1)]  # (each replica's rank 0 writes its store's)
    # late: replica 0 starts stepping without waiting for a second replica (expected 1)
    procs = {(r, j): caller_process(ctx, _worker, r, j, port_files[r], lighthouse.address(), raw,
                                    1 if late and r == 0 else 2, flag, drop, out, done)
             for r in (0, 1) for j in range(WORKERS)}
    try:
        for (r, _), p in procs.items():
            if r == 0 or not late:
                p.start()
        if late:  # replica 1 starts once replica 0 has stepped alone (a fixed wait was too short on a loaded machine)
            deadline = time.monotonic() + patience(300)
            while not os.path.exists(flag + ".alone") and time.monotonic() < deadline:
                _all_alive(procs)
                time.sleep(0.1)
            for (r, _), p in procs.items():
                if r == 1:
                    p.start()
        results = []
        deadline = time.monotonic() + patience(400)
        while len(results) < len(procs):
            try:
                results.append(out.get(timeout=5))
            except queue.Empty:
                _all_alive(procs)
                assert time.monotonic() < deadline, f"{len(results)} of {len(procs)} ranks reported"
        done.set()  # every rank stepped to the end: the Managers may go
        for p in procs.values():
            p.join(60)
            assert p.exitcode == 0
        return sorted(results, key=lambda r: (r["replica"], r["rank"]))
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()


def _all_alive(procs: dict) -> None:
    """A rank that exited before reporting fails the test now, not when the wait for its result runs out."""
    dead = {key: p.exitcode for key, p in procs.items() if p.exitcode not in (None, 0)}
    assert not dead, f"(replica, rank): exit code {dead}"


def _check(results: list[dict], single: LayoutResult) -> None:
    """Every rank against the single-process run over the steps it ran (raydist.testing.assert_equivalent),
    and every step's samples, over the batch leaders of the replicas that committed it, the single-process
    step's, each once."""
    for res in results:
        held = frozenset(name for other in results if other["replica"] == res["replica"] for name in other["params"])
        ran = [rec["step"] for rec in res["steps"]]
        reference = LayoutResult([single.losses[s - 1] for s in ran], [single.grad_norms[s - 1] for s in ran],
                                 single.grads, [], single.params)
        candidate = LayoutResult([rec["loss"] for rec in res["steps"]], [rec["grad_norm"] for rec in res["steps"]],
                                 {k: torch.from_numpy(v) for k, v in res["grads"].items()}, [],
                                 {k: torch.from_numpy(v) for k, v in res["params"].items()}, held)
        try:
            assert_equivalent(reference, candidate)
        except AssertionError as exc:
            raise AssertionError(f"replica {res['replica']} rank {res['rank']}: {exc}") from None
    for step in range(1, STEPS + 1):
        trained = sorted(i for res in results for rec in res["steps"] if rec["step"] == step and rec["ids"] is not None
                         for i in rec["ids"])
        assert trained == sorted(single.sample_ids[step - 1].tolist()), f"step {step}"


@pytest.fixture(scope="module")
def reference(tiny_data):
    raw = tiny_config(tiny_data, train={"steps": STEPS})  # global_batch 8: replicas 4 + 4 rows
    [single] = run_layout(raw, 1, steps=STEPS, record_samples=True)
    return raw, single


def _live(raw: dict, inside: str) -> dict:
    return {**raw, "parallel": {"dp_replicate": 2, **INSIDE[inside]}, "ray": {"num_workers": 2 * WORKERS},
            "elastic": {"live_recovery": True}}


SPAWNS = pytest.mark.timeout(600)  # ~20 s alone; a loaded CI run took over 180 s to bring replica 0 to step 3
# (its waits have their own bounds: 300 s for replica 0 alone, 400 s for every rank's result, each x3 when niced
# under xdist, tests/workers.py)


@SPAWNS
def test_two_replicas_from_the_first_step_and_a_parameter_without_its_gradient_fails_the_check(reference, tmp_path):
    """Both replicas (tp 2 inside) step together from step 1; the check passes on every step but the last,
    where one parameter's gradient was taken away and the check names it. (Two replicas stepping together
    under each mesh are also the late-replica cases below from the step replica 1 heals at.)"""
    raw, single = reference
    results = _run(_live(raw, "tp"), late=False, tmp=tmp_path, drop=DROPPED)
    assert all(r["mesh"]["tp"] == 2 and r["mesh"]["dp_replicate"] == 1 for r in results), results[0]["mesh"]
    assert all(not r["healed"] and r["retried"] == 0 for r in results)
    assert {rec["count"] for r in results for rec in r["steps"]} == {2}  # every step on both replicas
    assert all(len(r["steps"]) == STEPS for r in results)
    assert all(DROPPED not in r["grads"] and DROPPED in r["params"] for r in results)
    for res in results:  # every step's loss and gradient norms are the single process's
        ran = [rec["step"] for rec in res["steps"]]
        want = LayoutResult([single.losses[s - 1] for s in ran], [single.grad_norms[s - 1] for s in ran], {}, [], {})
        got = LayoutResult([r["loss"] for r in res["steps"]], [r["grad_norm"] for r in res["steps"]], {}, [], {})
        assert_same_steps(want, got)
    with pytest.raises(AssertionError, match=f"received no gradient in the last step: \\['{DROPPED}'\\]"):
        _check(results, single)


@SPAWNS
@pytest.mark.parametrize("inside", ["fsdp", "tp", "cp", "pp"])
def test_a_late_replica_heals_rank_by_rank_and_the_run_stays_exact(reference, tmp_path, inside):
    _late_replica_heals(*reference, tmp_path, inside)


@SPAWNS
def test_a_late_replica_of_a_mixture_of_experts_heals_its_expert_parallel_shards(tiny_data, tmp_path):
    """Replicas of 2 ranks each holding half of every MoE block's experts (ep 2): the late replica receives
    its ranks' experts from the ranks at the same coordinates, and the run stays the single process's."""
    raw = tiny_config(tiny_data, model=MOE, train={"steps": STEPS})
    [single] = run_layout(raw, 1, steps=STEPS, record_samples=True)
    _late_replica_heals(raw, single, tmp_path, "ep")


def _late_replica_heals(raw: dict, single: LayoutResult, tmp_path, inside: str) -> None:
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


# ---- which meshes a replica may hold ------------------------------------------------------------------

def _config(**parallel) -> Config:
    workers = parallel.pop("num_workers", None)
    p = {"dp_replicate": 2, **parallel}
    size = p["dp_replicate"] * p.get("dp_shard", 1) * p.get("tp", 1) * p.get("cp", 1) * p.get("pp", 1)
    return Config.from_dict(tiny_config("unused", parallel=p, ray={"num_workers": workers or size},
                                        elastic={"live_recovery": True}))


def test_a_replica_may_hold_fsdp_tp_cp_and_pp():
    from raydist.elastic.live import workers_per_replica
    from raydist.planner.policy import replica_layout

    cfg = _config(dp_shard=2, tp=2, cp=2, pp=2)
    assert workers_per_replica(cfg) == 16
    one = replica_layout(cfg)
    assert one.degrees() == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 2}
    assert one.world_size == 16 and cfg.parallel.dp_replicate == 2  # (the config stays as given)


def test_a_pipeline_replica_runs_the_whole_runs_micro_batches():
    from raydist.planner.policy import replica_layout

    # the whole run: dp 2, 4 rows per rank in 2 micro-batches of 2; one replica holds all 8 rows: 4 of 2
    layout = replica_layout(_config(pp=2, num_microbatches=2))
    assert (layout.dp, layout.micro_batch, layout.num_microbatches) == (1, 2, 4)
    # without a pipeline the whole run's layout need not exist: 3 replicas share a global batch of 8
    assert replica_layout(_config(dp_replicate=3)).dp_replicate == 1
    with pytest.raises(ConfigError, match=r"train.global_batch=8 must be divisible by dp \(3\)"):
        replica_layout(_config(dp_replicate=3, pp=2))


@pytest.mark.parametrize("parallel, message", [
    ({"tp": 2, "num_workers": 2}, r"needs dp_replicate x \(dp_shard x cp x tp x pp\) workers: ray.num_workers=2 "
                                  r"but .* = 4; set ray.num_workers=4"),
    ({"dp_shard": -1, "num_workers": 4}, r"needs an explicit parallel.dp_shard \(got -1\)"),
    ({"dp_replicate": 1, "tp": 2}, r"needs parallel.dp_replicate >= 2 replicas \(got 1\)"),
])
def test_a_replica_mesh_live_recovery_cannot_run_is_refused_in_one_line(parallel, message):
    with pytest.raises(ConfigError, match=message) as err:
        _config(**parallel)
    assert "\n" not in str(err.value)
