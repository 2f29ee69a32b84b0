"""The strict-collectives mode (raydist.strict) is proven by the bugs it catches: each test plants one thing
NCCL would hang on or reject, which plain gloo lets pass, and sees the mode name it within a bounded time;
and the correct counterpart passes under the mode."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from raydist import strict
from raydist.parallel.runtime import spawn
from raydist.strict import deadlock


@pytest.fixture
def strict_mode(monkeypatch):
    monkeypatch.setenv(strict.ENV, "1")


def _expect(fn, world=2, timeout_s=60.0, *args, **kwargs):
    """Run `fn` under the mode; return (seconds, error text) of the failure it must end in."""
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        spawn(fn, world, *args, timeout_s=timeout_s, **kwargs)
    return time.monotonic() - start, str(info.value)


# ---- the stream: one unit at a time, in issue order; sends do not buffer ------------------------------


def _early_receive() -> str:
    """The pipeline's first step as the executor posted it: rank 0 posts the receive of its first
    backward's gradient before its first activation goes out."""
    if dist.get_rank() == 0:
        grad = torch.empty(4)
        pending = dist.batch_isend_irecv([dist.P2POp(c10d.irecv, grad, 1)])
        pending += dist.batch_isend_irecv([dist.P2POp(c10d.isend, torch.ones(4), 1)])
        for work in pending:
            work.wait()
    else:
        act = torch.empty(4)
        for work in dist.batch_isend_irecv([dist.P2POp(c10d.irecv, act, 0)]):
            work.wait()
        for work in dist.batch_isend_irecv([dist.P2POp(c10d.isend, act * 2, 0)]):
            work.wait()
    return "finished"


def test_a_receive_posted_before_the_send_it_waits_for_is_a_named_deadlock(strict_mode):
    seconds, error = _expect(_early_receive)
    assert "deadlock" in error and "rank 0 on group '0' (ranks [0, 1]) runs irecv from rank 1" in error, error
    assert "queued behind its irecv from rank 1" in error or "queued behind" in error, error
    assert seconds < 30, seconds


def test_gloo_lets_the_early_receive_pass(monkeypatch):
    monkeypatch.setenv(strict.ENV, "0")
    assert spawn(_early_receive, 2, timeout_s=60) == ["finished", "finished"]


def _sends_first() -> str:
    """Both ranks send, then receive, each as its own operation: NCCL's sends wait for their receive."""
    peer = 1 - dist.get_rank()
    out = torch.empty(2)
    send = dist.isend(torch.ones(2), peer)
    recv = dist.irecv(out, peer)
    send.wait()
    recv.wait()
    return "finished"


def test_sends_do_not_buffer(strict_mode):
    _, error = _expect(_sends_first)
    assert "deadlock" in error and "isend to rank 1 (message 0 of the pair)" in error, error


def _sendrecv_batched() -> list[float]:
    peer = 1 - dist.get_rank()
    out = torch.empty(2)
    ops = [dist.P2POp(c10d.isend, torch.full((2,), float(dist.get_rank())), peer), dist.P2POp(c10d.irecv, out, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out.tolist()


def test_a_batch_is_one_unit_whose_operations_do_not_wait_for_each_other(strict_mode):
    assert spawn(_sendrecv_batched, 2, timeout_s=60) == [[1.0, 1.0], [0.0, 0.0]]


# ---- matching: by issue order per pair, tags ignored; same collective everywhere --------------------------


def _out_of_order() -> str:
    if dist.get_rank() == 0:
        first, second = dist.isend(torch.zeros(3), 1, tag=1), dist.isend(torch.zeros(3), 1, tag=2)
        first.wait()
        second.wait()
    else:
        a, b = torch.empty(3), torch.empty(3)
        w2 = dist.irecv(b, 0, tag=2)  # gloo matches by tag: fine there; NCCL by order: b gets message 0
        w1 = dist.irecv(a, 0, tag=1)
        w2.wait()
        w1.wait()
    return "finished"


def test_messages_match_by_issue_order_not_tag(strict_mode):
    _, error = _expect(_out_of_order)
    assert "matched by rank 0's message 0 to it, sent with tag 1" in error and "not by tag" in error, error


def _mismatched_collectives() -> str:
    t = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=0)
    return "finished"


def test_members_issuing_different_collectives_fail_naming_both(strict_mode):
    _, error = _expect(_mismatched_collectives)
    assert "issued all_reduce #1" in error and "issued broadcast #1" in error, error


def _mismatched_sizes() -> str:
    dist.all_reduce(torch.ones(4 + dist.get_rank()))
    return "finished"


def test_a_collective_of_different_sizes_fails(strict_mode):
    _, error = _expect(_mismatched_sizes)
    assert "4 elements" in error and "5 elements" in error, error


def _silent_mismatch_later() -> str:
    from raydist.strict.fingerprints import CHECK_EACH_UNTIL, CHECK_EVERY

    t = torch.ones(4)
    for _ in range(CHECK_EACH_UNTIL + 3):
        dist.all_reduce(t)
    # gloo completes this (same size), each rank reducing differently: the data is silently wrong
    dist.all_reduce(t, op=dist.ReduceOp.SUM if dist.get_rank() == 0 else dist.ReduceOp.MAX)
    for _ in range(CHECK_EVERY):
        dist.all_reduce(t)
    return "finished"


def test_a_mismatch_that_completes_is_named_at_the_next_check(strict_mode):
    from raydist.strict.fingerprints import CHECK_EACH_UNTIL

    _, error = _expect(_silent_mismatch_later)
    assert f"issued all_reduce #{CHECK_EACH_UNTIL + 4}" in error and "reduction 0" in error and "reduction 4" in error, error


def _bitwise() -> str:
    dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.BAND)
    return "finished"


def test_reductions_nccl_lacks_fail(strict_mode):
    _, error = _expect(_bitwise)
    assert "NCCL has no bitwise reductions" in error, error


def _host_tensor() -> str:
    from raydist.strict.audit import CollectiveAudit

    with CollectiveAudit():
        dist.all_reduce(torch.tensor([3], dtype=torch.int64))  # made without a device: a host tensor
    return "finished"


def test_a_host_tensor_on_a_device_group_fails(strict_mode):
    _, error = _expect(_host_tensor)
    assert "all_reduce of a host tensor (1,) torch.int64 on device group '0'" in error, error


# ---- groups of a bound world: every rank, same order ----------------------------------------------------


def _idle_rank_skips_the_group() -> str:
    if dist.get_rank() < 2:  # rank 2 "idles", as an elastic run's extra worker did before building the mesh
        dist.new_group([0, 1])
    return "finished"


def test_a_rank_that_skips_a_device_group_creation_is_named(strict_mode):
    seconds, error = _expect(_idle_rank_skips_the_group, 3, 20.0)
    assert "rank(s) [2] never took part" in error and "ncclCommSplit" in error, error
    assert seconds < 60, seconds


class _PausedBeforeTheGoneCheck:
    """The world's store as rank 0's creation sees it, with the pause a loaded machine can put between reading
    which peers are missing and asking whether they left: until the peer has left."""

    def __init__(self, inner):
        self.inner, self.waited = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def check(self, keys):
        if len(keys) == 1 and keys[0].startswith("gone/"):
            self.waited += 1
            deadline = time.monotonic() + 30
            while not self.inner.check(keys) and time.monotonic() < deadline:
                time.sleep(0.02)
        return self.inner.check(keys)


def _a_peer_posts_and_leaves_while_rank_0_is_paused() -> int:
    from raydist.strict import runtime

    if dist.get_rank() == 0:
        state = runtime.current()
        state.store = paused = _PausedBeforeTheGoneCheck(state.store)
        dist.new_group([0])  # rank 1 has not posted yet: rank 0 reads it missing, then pauses
        return paused.waited
    time.sleep(1.0)
    dist.new_group([0])  # the last creation, as a non-member: rank 1 returns and leaves while rank 0 is paused
    return 0


def test_a_peer_that_took_part_and_left_while_this_rank_was_paused_is_no_absentee(strict_mode):
    # (a clean-clone CI run: rank 3 read rank 2 missing from the mesh's last split, a group of rank 3 alone,
    # was paused, then saw rank 2 gone, which had posted its no-color part and left: "rank(s) [2] never took
    # part")
    waited, _ = spawn(_a_peer_posts_and_leaves_while_rank_0_is_paused, 2, timeout_s=60)
    assert waited >= 1  # the pause happened: rank 0 asked whether rank 1 had left


def _collective_against_a_creation() -> str:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 creates a group meanwhile, which waits for rank 0
        dist.new_group([0, 1])
    else:
        dist.new_group([0, 1])
        dist.all_reduce(torch.ones(1))
    return "finished"


def test_a_creation_waiting_for_a_rank_blocked_on_it_is_a_named_deadlock(strict_mode):
    seconds, error = _expect(_collective_against_a_creation, 2, 120.0)
    assert "deadlock" in error and "rank 1 waits in the world's split #1" in error, error
    assert "all_reduce #" in error, error
    assert seconds < 60, seconds  # the finder, not the 120 s timeout


def _gloo_group_made_by_everyone() -> str:
    dist.new_group([0, 1], backend="gloo")  # rank 2 is no member: on a bound world it splits with no color
    dist.new_group([0, 1, 2])
    return "finished"


def test_a_host_group_with_non_members_that_do_not_skip_it_is_caught(strict_mode):
    _, error = _expect(_gloo_group_made_by_everyone, 3, 20.0)
    assert "takes part as a non-member of gloo group [0, 1]" in error and "creates device group [0, 1, 2]" in error, error


def _groups_done_right() -> list[int]:
    from raydist.strict.purposes import HOST, new_group

    host = new_group([0, 1], HOST, "cpu", 20, use_local_synchronization=True)  # members only, gloo
    device = dist.new_group([0, 1])  # every rank takes part
    sizes = []
    if dist.get_rank() < 2:
        for group in (host, device):
            t = torch.ones(1)
            dist.all_reduce(t, group=group)
            sizes.append(int(t.item()))
    dist.barrier()  # rank 0 holds the store: nobody leaves while a peer may still read it
    return sizes


def test_groups_made_the_way_nccl_wants_pass(strict_mode):
    assert spawn(_groups_done_right, 3, timeout_s=20) == [[2, 2], [2, 2], []]


# ---- timeouts end the process, as NCCL's watchdog does -------------------------------------------------


def _one_rank_never_arrives() -> str:
    if dist.get_rank() == 0:
        try:
            dist.all_reduce(torch.ones(1))
        except Exception as exc:  # a training loop's handler: NCCL gives it nothing to catch
            return f"caught {type(exc).__name__}"
    else:
        time.sleep(8)
    return "finished"


def test_a_timeout_aborts_the_process_instead_of_raising(strict_mode, capfd):
    seconds, error = _expect(_one_rank_never_arrives, 2, 3.0)
    assert "rank 0 exited with status -6" in error, error  # SIGABRT, nothing caught
    assert "strict collectives watchdog: all_reduce #1 on group '0'" in capfd.readouterr().err
    assert seconds < 30


# ---- the finder itself, on states made by hand ----------------------------------------------------------


def _state(rank: int, units: list, waits: list | None = None, coll: int = 0, ranks=(0, 1)) -> dict:
    return {"rank": rank, "time": 0.0, "version": 1, "waits": waits or [],
            "groups": {"g": {"ranks": list(ranks), "units": units, "coll": coll, "send": {}, "recv": {}}}}


def _unit(uid: int, *ops) -> dict:
    return {"id": uid, "started": True, "ops": [list(op) for op in ops]}


def test_the_finder_needs_a_cycle():
    recv = _unit(1, ("recv", "irecv", 0, 1, 0))
    send_queued = [_unit(1, ("recv", "irecv", 0, 0, 0)), _unit(2, ("send", "isend", 0, 0, 0))]
    cycle = {0: _state(0, [recv, _unit(2, ("send", "isend", 0, 1, 0))], waits=[["g", 1]]),
             1: _state(1, send_queued, waits=[["g", 1]])}
    found = deadlock.find(cycle, me=0)
    assert found is not None and found.ranks == [0, 1]
    # rank 1's host computes (it waits for nothing): its send may still come, whatever rank 0 does
    busy = {0: cycle[0], 1: _state(1, [], waits=[])}
    assert deadlock.find(busy, me=0) is None
    # rank 1 published nothing recently: unknown, never called deadlocked
    assert deadlock.find({0: cycle[0]}, me=0) is None
    # the match runs on rank 1's stream now: it is being matched
    running = {0: cycle[0], 1: _state(1, [_unit(2, ("send", "isend", 0, 0, 0))], waits=[["g", 2]])}
    assert deadlock.find(running, me=0) is None


def test_a_collective_waits_for_every_member():
    coll = _unit(1, ("coll", "all_reduce", 3, -1, 0))
    states = {0: _state(0, [coll], waits=[["g", 1]], coll=2, ranks=(0, 1, 2)),
              1: _state(1, [coll], waits=[["g", 1]], coll=2, ranks=(0, 1, 2)),
              2: _state(2, [_unit(7, ("recv", "irecv", 5, 0, 0)), coll], waits=[["g", 7]], coll=2, ranks=(0, 1, 2))}
    found = deadlock.find(states, me=0)
    assert found is not None and "all_reduce #3 waits for rank 2, whose match is queued behind" in found.message()


def test_the_mode_is_switched_by_the_environment(monkeypatch):
    monkeypatch.setenv(strict.ENV, "1")
    assert strict.enabled() and strict.device_backend("cpu") == strict.BACKEND
    assert strict.device_backend("cuda") == "nccl"
    monkeypatch.setenv(strict.ENV, "0")
    assert not strict.enabled() and strict.device_backend("cpu") == "gloo"
    assert os.environ[strict.ENV] == "0"


# ---- a run says it is under the mode ---------------------------------------------------------------------


def _fit_start_event(raw: dict, run_dir: str) -> dict:
    import json

    from raydist.config import Config
    from raydist.training.loop import fit
    from raydist.training.trainer import Trainer

    fit(Trainer(Config.from_dict(raw), torch.device("cpu")), run_dir, log=lambda *_: None)
    dist.barrier()
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        return next(e for e in map(json.loads, f) if e["kind"] == "start")


@pytest.mark.parametrize("on", [True, False], ids=["strict", "gloo"])
def test_the_start_event_and_console_say_whether_the_run_is_under_the_mode(tiny_data, tmp_path, monkeypatch, on):
    from raydist.driver.console import describe_event
    from raydist.testing import tiny_config

    monkeypatch.setenv(strict.ENV, "1" if on else "0")
    raw = tiny_config(tiny_data, parallel={"dp_shard": 2}, train={"steps": 2, "log_every": 1})
    start = spawn(_fit_start_event, 2, raw, str(tmp_path / "run"), timeout_s=120)[0]
    assert start["strict_collectives"] is on
    assert ("under strict collectives (NCCL's rules on gloo)" in describe_event(start)) is on


# ---- elastic runs with idle workers: the world is bound only when every rank trains ------------------------


def _elastic_with_an_idle_rank(data: str, bind_first: bool) -> str:
    from raydist.config import Config
    from raydist.elastic.session import Idle, LocalSession, bind_when_all_train
    from raydist.parallel.runtime import bind_device
    from raydist.testing import tiny_config
    from raydist.training.trainer import Trainer

    raw = tiny_config(data, parallel={"dp_replicate": -1, "dp_shard": 1}, train={"steps": 2, "global_batch": 8},
                      elastic={"min_workers": 2, "max_workers": 3})
    cfg = Config.from_dict(raw)
    device = torch.device("cpu")
    if bind_first:  # what Ray workers did: bind, then learn that one of three idles (dp 3 divides no batch of 8)
        bind_device(device)
    started = LocalSession().start(cfg)
    if not bind_first:
        bind_when_all_train(started, device)
    if isinstance(started, Idle):
        return "idle"
    trainer = Trainer(cfg, device, started)
    for _ in range(2):
        trainer.train_step()
    trainer.close()
    dist.barrier(group=trainer.group)
    return "trained"


@pytest.mark.parametrize("bind_first", [True, False], ids=["bound-before-the-layout", "bound-when-all-train"])
def test_an_elastic_run_with_an_idle_worker(strict_mode, tiny_data, bind_first):
    """Ray Train creates the world unbound (spawn's bound=False); the workers used to bind it before they
    knew one of them idles, then the active ones built the mesh alone."""
    if bind_first:
        _, error = _expect(_elastic_with_an_idle_rank, 3, 30.0, tiny_data, True, bound=False)
        assert "rank(s) [2] never took part" in error and "ncclCommSplit" in error, error
    else:
        assert spawn(_elastic_with_an_idle_rank, 3, tiny_data, False, timeout_s=60, bound=False) == [
            "trained", "trained", "idle"]
