"""DiLoCo and local SGD between live recovery's replicas (raydist.elastic.diloco), under plain torch.distributed
with a real torchft Lighthouse (as tests/unit/test_live_replicas.py): two replicas, each its own gloo world
(FSDP 2 inside, or one worker), against an independent reference.

The reference is a single-process loop written here: the two replicas' model copies, each with its own AdamW,
LR schedule and clipping, trained in turn on their halves of each global batch, and every H steps the outer
step written by hand (Delta = theta_start - mean of the copies; Nesterov: buf <- mu buf + Delta, theta <-
theta_start - lr (Delta + mu buf); local SGD: the mean). With AdamW inside, H = 1 is not synchronous data
parallelism (each copy's AdamW sees only its half's gradient), so the reference models DiLoCo itself. Every
replica's loss and gradient norm at every step and the parameters after the last step must match (1e-4);
planted bugs in the outer step (momentum ignored, the outer gradient's sign flipped) must fail the check."""

from __future__ import annotations

import copy
import json
import os
import queue
import shutil
import time

import pytest
import torch
from torchft.coordination import LighthouseServer  # (the test extra installs it: missing, an error, not a skip)

from raydist.config import Config, ConfigError
from raydist.parallel.runtime import caller_process, spawn, start_method_context
from raydist.testing import LayoutResult, assert_same_steps, run_layout, tiny_config
from test_live_replicas import _all_alive, _replica_store
from test_reference_loop import adamw, hand_step
from workers import patience

STEPS, REPLICAS = 8, 2


SAVE_AT = 4  # the resumed scenario: a checkpoint at step 4, resumed to step 8
KILL_AT, REJOIN_AT = 6, 8  # the killed scenario: replica 1 dies after step 6 (inside the window 5-8); its
# replacement joins at step 8's synchronisation, when replica 0 has redone that window alone


def _worker(replica: int, rank: int, workers: int, port_file: str, lighthouse: str, raw: dict, plant: str | None,
            flags: str | None, ckpt: tuple[str, str] | None, out, done) -> None:
    """One rank of a replica. `flags` (the killed scenario): replica 1 exits after step KILL_AT; replica 0 waits
    at REJOIN_AT until the replacement asks for its first quorum; a replacement says so first. `ckpt` (run
    directory, what): "save" stops after step SAVE_AT, the leader saving a checkpoint there; "resume" (or
    "resume_leaders_moments", a planted bug: without the replicas' own AdamW states) starts from it."""
    import torch.distributed as dist

    from raydist.elastic.diloco import replica_manager
    from raydist.elastic.live import TorchftReplicas
    from raydist.planner.policy import replica_layout
    from raydist.training.trainer import Trainer, TrainerOptions

    torch.set_num_threads(1)
    store = _replica_store(rank, port_file, workers)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCHFT_LIGHTHOUSE=lighthouse)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=workers)
    cfg = Config.from_dict(raw)
    trainer = Trainer(cfg, torch.device("cpu"), replica_layout(cfg), TrainerOptions(record_samples=True))
    if plant == "momentum ignored":
        trainer.outer.momentum = 0.0
    elif plant == "sign flipped":
        step = trainer.outer.step
        trainer.outer.step = lambda starts, deltas: step(starts, [-d for d in deltas])
    replicas = replica_manager(TorchftReplicas(replica, torch.device("cpu"), 60.0, trainer.state_parts,
                                               replicas=REPLICAS, rank=rank, workers=workers), trainer)
    replicas.writes_checkpoints = ckpt is not None  # (as fit sets it: no inner states gathered without a save)
    trainer.replicas = replicas
    replacement = flags is not None and os.path.exists(flags + ".alone")
    if replacement and rank == 0:
        open(flags + ".asks", "w").close()
    healed = replicas.join()
    steps = []
    last = cfg.train.steps
    if ckpt is not None:
        from raydist.checkpoint import CheckpointManager

        manager = CheckpointManager(ckpt[0], keep=1, group=trainer.checkpoint_group, log=lambda *_: None)
        if ckpt[1] == "save":
            last = SAVE_AT
        else:
            parts = trainer.checkpoint_parts() if ckpt[1] == "resume" else trainer.state_parts()
            manager.load(manager.latest(), parts)
            replicas.set_step(trainer.step)

    def samples() -> dict:
        return {step: ids.tolist() for step, ids in zip(trainer._sample_log_steps, trainer.sample_log)}

    while trainer.step < last:
        if flags is not None and replica == 0 and trainer.step == REJOIN_AT:
            open(flags + ".alone", "w").close()
            while not os.path.exists(flags + ".asks"):
                time.sleep(0.1)
            time.sleep(1.0)
        stats = trainer.train_step()
        steps.append({"step": trainer.step, "loss": stats.loss, "grad_norm": stats.grad_norm,
                      "quorum": list(trainer.last_quorum), "span": list(trainer.last_replica_span)})
        if flags is not None and replica == 1 and not replacement and trainer.step == KILL_AT:
            with open(f"{flags}.dead-{rank}.json", "w") as f:  # what it trained in its committed window
                json.dump({s: ids for s, ids in samples().items() if s <= KILL_AT - KILL_AT % cfg.elastic.sync_every}, f)
            os._exit(1)
    if ckpt is not None and ckpt[1] == "save" and replicas.is_leader():
        manager.save(trainer.step, trainer.checkpoint_parts(), blocking=True)
        manager.wait()
    params = {k: v.numpy() for k, v in trainer.full_parameters().items()}
    out.put({"replica": replica, "rank": rank, "steps": steps, "params": params, "sent": replicas.sent_bytes,
             "local_numel": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                for p in trainer.pm.model.parameters() if p.requires_grad),
             "healed": healed, "healed_at": replicas.healed_at, "retried": trainer.retried_steps,
             "samples": samples()})
    done.wait(600)  # every rank reported (so read its last quorum) before this Manager goes
    replicas.shutdown()
    trainer.close()
    dist.destroy_process_group()


def _run(raw: dict, workers: int, tmp, plant: str | None = None, kill: bool = False,
         ckpt: tuple[str, str] | None = None) -> list[dict]:
    """Every rank's result, by (replica, replacement?, rank). `kill`: replica 1 dies inside its second window and
    a replacement starts once replica 0 has redone that window alone."""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    ctx = start_method_context()
    out, done = ctx.Queue(), ctx.Event()
    flags = str(tmp / "flag") if kill else None

    def process(r: int, j: int, port_file: str):
        return caller_process(ctx, _worker, r, j, workers, port_file, lighthouse.address(), raw, plant, flags, ckpt,
                              out, done)

    procs = {(r, j): process(r, j, str(tmp / f"replica-{r}.port")) for r in range(REPLICAS) for j in range(workers)}
    dying = {(1, j) for j in range(workers)} if kill else set()
    try:
        for p in procs.values():
            p.start()
        if kill:  # the replacement starts once replica 0 has redone the failed window alone
            deadline = time.monotonic() + patience(300)
            while not os.path.exists(flags + ".alone"):
                _all_alive({k: p for k, p in procs.items() if k not in dying})
                assert time.monotonic() < deadline, "replica 0 never reached the rejoin step"
                time.sleep(0.1)
            for j in range(workers):
                procs[(2, j)] = process(1, j, str(tmp / "replacement.port"))
                procs[(2, j)].start()
        results, deadline = [], time.monotonic() + patience(400)
        while len(results) < len(procs) - len(dying):
            try:
                results.append(out.get(timeout=5))
            except queue.Empty:
                _all_alive({k: p for k, p in procs.items() if k not in dying})
                assert time.monotonic() < deadline, f"{len(results)} of {len(procs)} ranks reported"
        done.set()  # every rank that stood stepped to the end: the Managers may go
        for key, p in procs.items():
            p.join(60)
            assert p.exitcode == (1 if key in dying else 0), (key, p.exitcode)
        return sorted(results, key=lambda r: (r["replica"], r["healed"], r["rank"]))
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()


# ---- the reference: the replicas' copies in one process -------------------------------------------------

def _reference(raw: dict, every: int, outer_lr: float, momentum: float, counts: tuple[int, ...] | None) -> dict:
    """{"losses": per step, per replica rank; "norms": the same; "spans": per step, the positions each replica
    rank trained; "params": the shared parameters after the last step}. `counts`: the replicas of each window
    (REPLICAS in all by default): a replica that joins receives replica 0's model and AdamW state (healing)."""
    from raydist.elastic.live import live_slice
    from raydist.models.gpt import build_model
    from raydist.training.trainer import Trainer

    cfg = Config.from_dict({**raw, "parallel": {"dp_replicate": 1, "dp_shard": 1}, "ray": {"num_workers": 1},
                            "elastic": {}})
    t = cfg.train
    data = Trainer(cfg, torch.device("cpu"))  # only reads the data: the rows at each position
    windows = -(-t.steps // every)
    counts = counts or (REPLICAS,) * windows

    models = [build_model(cfg.model, cfg.data.seq_len, seed=t.seed)]
    opts = [adamw(models[0], t)]
    start = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    buf = {n: torch.zeros_like(p) for n, p in start.items()}
    losses, norms, spans = [], [], []
    for step in range(t.steps):
        count = counts[step // every]
        while len(models) < count:  # a replica joins: replica 0's state
            models.append(copy.deepcopy(models[0]))
            opts.append(adamw(models[-1], t))
            opts[-1].load_state_dict(copy.deepcopy(opts[0].state_dict()))  # (load_state_dict shares tensors)
        del models[count:], opts[count:]
        position = step * t.global_batch
        losses.append([]), norms.append([]), spans.append([])
        for r, (model, opt) in enumerate(zip(models, opts)):
            span = live_slice(position, t.global_batch, r, count)
            tokens, _ = data.next_batch(span)
            spans[-1].append(list(span))
            loss, norm = hand_step(model, opt, tokens, step, t)
            losses[-1].append(loss)
            norms[-1].append(norm)
        if (step + 1) % every == 0 or step + 1 == t.steps:  # the outer step (and at the run's end)
            with torch.no_grad():
                for name in start:
                    copies = [dict(m.named_parameters())[name] for m in models]
                    delta = sum((span[1] - span[0]) / t.global_batch * (start[name] - c)
                                for span, c in zip(spans[-1], copies))
                    if momentum:
                        buf[name] = momentum * buf[name] + delta
                        delta = delta + momentum * buf[name]
                    start[name] = start[name] - outer_lr * delta
                    for c in copies:
                        c.copy_(start[name])
    data.close()
    return {"losses": losses, "norms": norms, "params": {n: p.clone() for n, p in start.items()}, "spans": spans}


_REFERENCES: dict = {}


def reference(raw: dict, every: int, outer_lr: float, momentum: float, counts: tuple[int, ...] | None = None) -> dict:
    """One reference per (steps, H, outer step, replica counts) for the module (a world of one process, spawned)."""
    key = (raw["train"]["steps"], every, outer_lr, momentum, counts)
    if key not in _REFERENCES:
        [_REFERENCES[key]] = spawn(_reference, 1, raw, every, outer_lr, momentum, counts)
    return _REFERENCES[key]


def _raw(tiny_data: str, sync: str, every: int, dp_shard: int) -> dict:
    raw = tiny_config(tiny_data, train={"steps": STEPS})  # global_batch 8: replicas 4 + 4 rows
    return {**raw, "parallel": {"dp_replicate": REPLICAS, "dp_shard": dp_shard},
            "ray": {"num_workers": REPLICAS * dp_shard},
            "elastic": {"live_recovery": True, "sync": sync, "sync_every": every}}


def _check(results: list[dict], ref: dict, final: bool = True) -> None:
    """Every rank's steps against its replica rank's in the reference (the rows it trained, its loss and
    gradient norm); its parameters after the last step against the reference's shared ones (`final`: the
    rank ran to the reference's last step)."""
    for res in results:
        ran = [rec["step"] - 1 for rec in res["steps"]]
        ranks = [rec["quorum"][0] for rec in res["steps"]]
        assert [rec["quorum"][1] for rec in res["steps"]] == [len(ref["spans"][s]) for s in ran], res["steps"]
        assert [rec["span"] for rec in res["steps"]] == [ref["spans"][s][r] for s, r in zip(ran, ranks)]
        want = LayoutResult([ref["losses"][s][r] for s, r in zip(ran, ranks)],
                            [ref["norms"][s][r] for s, r in zip(ran, ranks)], {}, [])
        got = LayoutResult([rec["loss"] for rec in res["steps"]], [rec["grad_norm"] for rec in res["steps"]], {}, [])
        try:
            assert_same_steps(want, got)
        except AssertionError as exc:
            raise AssertionError(f"replica {res['replica']} rank {res['rank']}: {exc}") from None
        for name, param in res["params"].items() if final else ():
            expected = ref["params"][name]
            error = float((torch.from_numpy(param) - expected).norm() / expected.norm())
            assert error <= 1e-4, f"replica {res['replica']}: parameter {name} differs by {error:.2e}"


SPAWNS = pytest.mark.timeout(600)  # each run ~20 s alone; waits have their own bounds (patience)


@SPAWNS
@pytest.mark.parametrize("every", [1, 4])
def test_diloco_with_fsdp_inside_each_replica_equals_the_reference(tiny_data, tmp_path, every):
    raw = _raw(tiny_data, "diloco", every, dp_shard=2)
    e = Config.from_dict(raw).elastic
    results = _run(raw, 2, tmp_path)
    _check(results, reference(raw, every, e.outer_lr, e.outer_momentum))
    assert {r["replica"] for r in results} == set(range(REPLICAS))
    for res in results:  # the only bytes between replicas: one outer gradient per window, this rank's shards
        assert res["sent"] == STEPS // every * 4 * res["local_numel"], (res["sent"], res["local_numel"])


@SPAWNS
@pytest.mark.parametrize("inside", ["tp", "cp", "pp"])
def test_diloco_with_tp_cp_or_pp_inside_each_replica_equals_the_reference(tiny_data, tmp_path, inside):
    """Each replica's two workers split the model by tensor, context or pipeline parallelism: the outer step
    works on whatever shard each rank holds (a stage's parameters under pp), against the same reference."""
    raw = _raw(tiny_data, "diloco", 4, dp_shard=1)
    raw["parallel"][inside] = 2
    raw["ray"]["num_workers"] = REPLICAS * 2
    e = Config.from_dict(raw).elastic
    results = _run(raw, 2, tmp_path)
    assert {r["replica"] for r in results} == set(range(REPLICAS)) and len(results) == 2 * REPLICAS
    _check(results, reference(raw, 4, e.outer_lr, e.outer_momentum))


@SPAWNS
def test_local_sgd_averages_the_replicas(tiny_data, tmp_path):
    raw = _raw(tiny_data, "local_sgd", 4, dp_shard=1)
    _check(_run(raw, 1, tmp_path), reference(raw, 4, 1.0, 0.0))


@SPAWNS
@pytest.mark.parametrize("plant", ["momentum ignored", "sign flipped"])
def test_a_planted_outer_step_bug_fails_the_check(tiny_data, tmp_path, plant):
    raw = _raw(tiny_data, "diloco", 4, dp_shard=1)
    e = Config.from_dict(raw).elastic
    results = _run(raw, 1, tmp_path, plant)
    with pytest.raises(AssertionError, match="losses differ|gradient norms|parameter"):
        _check(results, reference(raw, 4, e.outer_lr, e.outer_momentum))


@SPAWNS
def test_a_replica_killed_inside_a_window_the_survivor_redoes_it_and_a_replacement_heals(tiny_data, tmp_path):
    """Replica 1 dies after step 6, inside the window of steps 5-8. Replica 0's synchronisation at step 8 fails,
    it rewinds to step 4 and redoes the window alone (the whole global batch of each step); its replacement
    joins at the next window's quorum and heals from it (parameters, AdamW state, outer momentum, position);
    both train steps 9-12. Equal to the reference with windows of 2, 1 and 2 replicas (the replacement holding
    replica 0's state), and every sample of every step trained once by the work that stood."""
    raw = _raw(tiny_data, "diloco", 4, dp_shard=1)
    raw["train"] = {**raw["train"], "steps": 12}
    e = Config.from_dict(raw).elastic
    results = _run(raw, 1, tmp_path, kill=True)
    survivor, replacement = results
    assert (survivor["replica"], survivor["healed"], replacement["replica"], replacement["healed"]) == (0, False, 1, True)
    assert survivor["retried"] == 4 and replacement["healed_at"] == REJOIN_AT
    ref = reference(raw, 4, e.outer_lr, e.outer_momentum, counts=(2, 1, 2))
    # the survivor's steps 5-7 as the loop saw them are the failed window's: the steps that stood are checked
    stood = dict(survivor, steps=[rec for rec in survivor["steps"] if not KILL_AT - 1 <= rec["step"] < REJOIN_AT])
    assert [rec["quorum"][1] for rec in stood["steps"]] == [2] * 4 + [1] + [2] * 4
    _check([stood, replacement], ref)
    with open(tmp_path / "flag.dead-0.json") as f:
        dead = {int(k): v for k, v in json.load(f).items()}
    [single] = run_layout(tiny_config(tiny_data, train={"steps": 12}), 1, steps=12, record_samples=True)
    for step in range(1, 13):
        trained = sorted(i for log in (survivor["samples"], replacement["samples"], dead) for i in log.get(step, []))
        assert trained == sorted(single.sample_ids[step - 1].tolist()), f"step {step}"


@pytest.mark.parametrize("change, message", [
    ({"elastic": {"sync": "diloco"}}, "synchronises live recovery's replicas"),
    ({"elastic": {"live_recovery": True, "sync": "diloco", "sync_every": 3}}, "checkpoint.every_steps=100 is not a multiple"),
    ({"elastic": {"live_recovery": True, "sync": "diloco", "sync_every": 4, "outer_momentum": 1.0}},
     "outer_momentum"),
    ({"elastic": {"live_recovery": True, "sync": "sometimes"}}, "is not one of every_step, diloco, local_sgd"),
])
def test_a_sync_the_run_cannot_keep_is_refused_in_one_line(change, message):
    raw = {"parallel": {"dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1}, "ray": {"num_workers": 2},
           "train": {"steps": 100}}
    for section, values in change.items():
        raw.setdefault(section, {}).update(values)
    with pytest.raises(ConfigError, match=message):
        Config.from_dict(raw)


def test_the_outer_step_is_torch_nesterov_sgd():
    """OuterOptimizer's step on local shards equals torch.optim.SGD(nesterov=True) stepping the parameters from
    their window's start along the outer gradient, over three windows (the momentum carried)."""
    from raydist.elastic.diloco import OuterOptimizer

    torch.manual_seed(0)
    mine, theirs = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    theirs.load_state_dict(mine.state_dict())
    outer = OuterOptimizer(mine, 0.7, 0.9)
    sgd = torch.optim.SGD(theirs.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(3):
        starts = [p.detach().clone() for p in mine.parameters()]
        deltas = [torch.randn_like(p) for p in mine.parameters()]
        outer.step(starts, deltas)
        for p, d in zip(theirs.parameters(), deltas):
            p.grad = d.clone()
        sgd.step()
        for a, b in zip(mine.parameters(), theirs.parameters()):
            torch.testing.assert_close(a, b)
    assert copy.deepcopy(outer.optimizer.state_dict())["state"]  # the momentum is optimizer state (checkpoints)


@pytest.fixture(scope="module")
def saved_at_step_4(tiny_data, tmp_path_factory):
    """Two replicas that saved at step 4 and stopped: (config, run directory, their results), for both resumes
    below (each resumes from its own copy of the run directory)."""
    raw = _raw(tiny_data, "diloco", 4, dp_shard=1)
    raw["checkpoint"] = {"every_steps": 4}
    tmp = tmp_path_factory.mktemp("diloco-saved")
    run_dir = str(tmp / "run")
    (tmp / "save").mkdir()
    saved = _run(raw, 1, tmp / "save", ckpt=(run_dir, "save"))
    return raw, run_dir, saved


@SPAWNS
@pytest.mark.parametrize("resume", ["resume", "resume_leaders_moments"])
def test_a_resumed_run_equals_the_uninterrupted_one(saved_at_step_4, tmp_path, resume):
    """Two replicas save at step 4 (the leader writes the checkpoint, with every replica's inner AdamW state
    gathered at that synchronisation) and stop; two new ones resume from it and train to step 8: every step
    and the final parameters equal the uninterrupted reference. Resuming every replica with the leader's
    moments only (the checkpoint's model_optim, a planted bug) fails the check. (One save serves both.)"""
    raw, saved_dir, saved = saved_at_step_4
    e = Config.from_dict(raw).elastic
    run_dir = str(tmp_path / "run")
    shutil.copytree(saved_dir, run_dir)
    assert [rec["step"] for r in saved for rec in r["steps"]] == [1, 2, 3, 4] * 2
    (tmp_path / "resume").mkdir()
    resumed = _run(raw, 1, tmp_path / "resume", ckpt=(run_dir, resume))
    assert all([rec["step"] for rec in r["steps"]] == [5, 6, 7, 8] for r in resumed)
    ref = reference(raw, 4, e.outer_lr, e.outer_momentum)
    if resume == "resume":
        _check(saved, ref, final=False)
        _check(resumed, ref)
    else:
        with pytest.raises(AssertionError, match="losses differ|gradient norms|parameter"):
            _check(resumed, ref)


def _outer_trainer(raw: dict, run_dir: str):
    from raydist.checkpoint import CheckpointManager
    from raydist.planner.policy import replica_layout
    from raydist.training.trainer import Trainer

    cfg = Config.from_dict(raw)
    trainer = Trainer(cfg, torch.device("cpu"), replica_layout(cfg))
    return trainer, CheckpointManager(run_dir, keep=1, group=trainer.checkpoint_group, log=lambda *_: None)


def _momentum(trainer) -> dict[str, torch.Tensor]:
    state = trainer.outer.optimizer.state
    return {name: (lambda b: b.full_tensor() if hasattr(b, "full_tensor") else b)(state[p]["momentum_buffer"]).clone()
            for name, p in trainer.pm.model.named_parameters() if p in state}


def _save_outer(raw: dict, run_dir: str) -> dict:
    from raydist.parallel.clip import local_shard

    trainer, manager = _outer_trainer(raw, run_dir)
    try:
        trainer.train_step()
        for scale in (0.01, -0.02):  # two outer steps: the momentum holds both
            starts = [local_shard(p).detach().clone() for p in trainer.outer.params]
            trainer.outer.step(starts, [scale * s for s in starts])
        manager.save(trainer.step, trainer.state_parts(), blocking=True)
        manager.wait()
        return _momentum(trainer)
    finally:
        trainer.close()


def _load_outer(raw: dict, run_dir: str) -> dict:
    trainer, manager = _outer_trainer(raw, run_dir)
    try:
        manager.load(manager.latest(), trainer.state_parts())
        return _momentum(trainer)
    finally:
        trainer.close()


def test_the_outer_momentum_is_checkpointed_and_resharded(tiny_data, tmp_path):
    """A replica of FSDP 2 saves DiLoCo's outer momentum with its checkpoint; a replica of one worker loads it
    whole (resharded like AdamW's moments)."""
    run_dir = str(tmp_path / "run")
    saved = spawn(_save_outer, 2, _raw(tiny_data, "diloco", 4, dp_shard=2), run_dir)[0]
    [loaded] = spawn(_load_outer, 1, _raw(tiny_data, "diloco", 4, dp_shard=1), run_dir)
    assert saved and saved.keys() == loaded.keys()
    for name, buf in saved.items():
        assert buf.abs().sum() > 0, name
        torch.testing.assert_close(loaded[name], buf, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_replicas_are_placed_by_node_label():
    """ray.replica_labels: one selector per replica, expanded to each worker's (Ray Train's per-bundle
    label_selector) in replica order; bad lists are one error line."""
    from raydist.driver.launcher import worker_label_selectors

    raw = {"parallel": {"dp_replicate": 3, "dp_shard": 2, "cp": 1, "tp": 1, "pp": 1}, "ray": {"num_workers": 6},
           "elastic": {"live_recovery": True, "sync": "diloco"},
           "train": {"steps": 100}}
    cfg = Config.from_dict({**raw, "ray": {**raw["ray"], "replica_labels": "zone=a; zone=a; zone=b, gpu=in(h100,h200)"}})
    assert worker_label_selectors(cfg) == [{"zone": "a"}] * 4 + [{"zone": "b", "gpu": "in(h100,h200)"}] * 2
    assert worker_label_selectors(Config.from_dict(raw)) == []
    for labels, message in [("zone=a; zone=b", "2 selectors for parallel.dp_replicate=3"),
                            ("zone=a; zone=b; zone=a", "must be next to each other"),
                            ("zone=a; zone; zone=b", "'zone' is not key=value")]:
        with pytest.raises(ConfigError, match=message):
            Config.from_dict({**raw, "ray": {**raw["ray"], "replica_labels": labels}})
    with pytest.raises(ConfigError, match="places live recovery's replicas"):
        Config.from_dict({"ray": {"replica_labels": "zone=a"}})


def _save_plain(raw: dict, run_dir: str) -> None:
    trainer, manager = _outer_trainer(raw, run_dir)
    try:
        trainer.train_step()
        manager.save(trainer.step, trainer.state_parts(), blocking=True)
        manager.wait()
    finally:
        trainer.close()


def test_a_diloco_run_resumes_a_checkpoint_saved_with_every_step_sync(tiny_data, tmp_path):
    """Switching elastic.sync to diloco on resume: the checkpoint has no outer momentum; it starts at zero."""
    run_dir = str(tmp_path / "run")
    every_step = _raw(tiny_data, "every_step", 4, dp_shard=1)
    spawn(_save_plain, 1, every_step, run_dir)
    [loaded] = spawn(_load_outer_step, 1, _raw(tiny_data, "diloco", 4, dp_shard=1), run_dir)
    assert loaded == (1, {})


def _load_outer_step(raw: dict, run_dir: str) -> tuple[int, dict]:
    trainer, manager = _outer_trainer(raw, run_dir)
    try:
        manager.load(manager.latest(), trainer.checkpoint_parts())
        return trainer.step, _momentum(trainer)
    finally:
        trainer.close()
