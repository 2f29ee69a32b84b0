"""Timeouts from measurements under live recovery (raydist.elastic.hang.timeouts with raydist.elastic.live), under
plain torch.distributed and a real torchft Lighthouse (no Ray): two replicas of one worker each.

Replica 1 stops itself (SIGSTOP: alive, its sockets open, answering nothing) inside a step, after that step's
quorum, just before its all-reduce between replicas. Replica 0's all-reduce waits for it only as long as the
limit derived from the measured steps (not the fixed ceiling torchft's group was built with), its step is
retried in a quorum without replica 1 (torchft's heartbeat timeout drops it), and it trains to the end. That
quorum changed, so the rest of its step ran under the fixed limits; the derived ones are back after it, on the
group torchft built for the new quorum too."""

from __future__ import annotations

import os
import queue
import signal
import time

import pytest
import torch
import torchft  # noqa: F401  (the test extra installs it; missing, this is an error, not a skip)

from raydist.config import Config
from raydist.testing import tiny_config
from raydist.parallel.runtime import caller_process, start_method_context
from workers import patience

CEILING_S = 60.0  # elastic.collective_timeout_s: what torchft's group waits without a derived limit
FACTOR, FLOOR_S, STEP_S = 2.0, 1.0, 0.3
STEPS, STOP_AT = 12, 8  # replica 1 stops in the step that brings the run to STOP_AT + 1
HEARTBEAT_TIMEOUT_S = 2.0


class _Recorder:
    """The session: the limits it is given, in order with the quorums and steps (`events`)."""

    def __init__(self):
        self.events: list[tuple] = []

    def step_limits(self, limits):
        self.events.append(("limits", None if limits is None else limits.collective_s))


def _replica(replica: int, lighthouse: str, raw: dict, stop_file: str, out) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from raydist.elastic.hang.timeouts import StepTimeouts
    from raydist.elastic.live import TorchftReplicas
    from raydist.planner.policy import replica_layout
    from raydist.training.trainer import Trainer

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=600), wait_for_workers=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCHFT_LIGHTHOUSE=lighthouse)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    cfg = Config.from_dict(raw)
    trainer = Trainer(cfg, torch.device("cpu"), replica_layout(cfg))
    replicas = TorchftReplicas(replica, torch.device("cpu"), CEILING_S, trainer.state_parts, replicas=2)
    trainer.replicas = replicas
    session = _Recorder()
    timeouts = StepTimeouts(session, replicas.timeout_targets, factor=FACTOR, floor_s=FLOOR_S, ceiling_s=CEILING_S,
                            warmup_steps=2, start_step=0)
    def on_quorum(begins: bool, changed: bool) -> None:  # as fit attaches timeouts.quorum, recorded
        session.events.append(("quorum", begins, changed))
        timeouts.quorum(begins, changed)

    replicas.on_quorum = on_quorum
    if replica == 1:
        all_reduce = replicas.all_reduce_sum

        def stopping(tensor):
            if trainer.step == STOP_AT:  # inside the step, after its quorum
                with open(stop_file, "w") as f:
                    f.write(str(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
            all_reduce(tensor)

        replicas.all_reduce_sum = stopping
    replicas.join()
    steps = []
    while trainer.step < STEPS:
        time.sleep(STEP_S)  # a slower device: steps long beside a loaded machine's jitter
        stats = trainer.train_step()
        steps.append({"step": trainer.step, "ended": time.time(), "replicas": stats.replicas,
                      "pg_timeout_s": replicas.pg._timeout.total_seconds()})
        session.events.append(("step_done", trainer.step))
        timeouts.step_done(trainer.step)
        if trainer.step % 2 == 0:  # a logged step: with one worker per replica, its own longest step
            timeouts.update(trainer.step, [timeouts.take()])
    gloo = replicas.pg._pg._get_backend(torch.device("cpu"))  # the group torchft built for the last quorum
    out.put({"replica": replica, "steps": steps, "retried": trainer.retried_steps, "events": session.events,
             "derived": timeouts.derived.collective_s if timeouts.derived else None,
             "applied": timeouts.applied.collective_s if timeouts.applied else None,
             "gloo_timeout_s": gloo.options._timeout.total_seconds()})
    replicas.shutdown()
    trainer.close()
    dist.destroy_process_group()


def test_a_replica_stopped_mid_step_costs_the_others_the_derived_limit_not_the_ceiling(tiny_data, tmp_path):
    from torchft.coordination import LighthouseServer

    raw = {**tiny_config(tiny_data, train={"steps": STEPS}), "parallel": {"dp_replicate": 2},
           "ray": {"num_workers": 2}, "elastic": {"live_recovery": True}}
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000,
                                  heartbeat_timeout_ms=int(HEARTBEAT_TIMEOUT_S * 1000))
    stop_file = str(tmp_path / "stopped")
    ctx = start_method_context()  # forks of the fork server, torch and raydist imported once
    out = ctx.Queue()
    procs = [caller_process(ctx, _replica, r, lighthouse.address(), raw, stop_file, out) for r in (0, 1)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + patience(300)
        while True:
            try:
                result = out.get(timeout=5)
                break
            except queue.Empty:
                assert procs[0].exitcode in (None, 0), f"replica 0 exited with {procs[0].exitcode}"
                assert time.monotonic() < deadline, "replica 0 did not finish"
        procs[0].join(60)
        assert procs[0].exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    assert result["replica"] == 0
    stopped_at = float(open(stop_file).read())
    by_step = {s["step"]: s for s in result["steps"]}
    assert [s["step"] for s in result["steps"]] == list(range(1, STEPS + 1))
    assert {by_step[s]["replicas"] for s in range(1, STOP_AT + 1)} == {2}  # both replicas until the stop
    assert {by_step[s]["replicas"] for s in range(STOP_AT + 1, STEPS + 1)} == {1}  # then replica 0 alone
    assert result["retried"] == 1  # the step whose all-reduce timed out, redone without replica 1
    derived, events = result["derived"], result["events"]
    assert derived is not None and FLOOR_S <= derived < CEILING_S / 4, events
    pause = by_step[STOP_AT + 1]["ended"] - stopped_at
    print(f"\nderived limit {derived:.2f}s; replica 0 finished the interrupted step {pause:.2f}s after the stop")
    assert pause < derived + 2 * HEARTBEAT_TIMEOUT_S + patience(8), (pause, derived)  # not the 60 s ceiling
    # Each quorum ran under the fixed limits. The one without replica 1 (in the redone step) changed: the rest
    # of that step kept them, and the derived ones came back at its end, on the group torchft rebuilt too.
    first = events.index(("limits", derived))
    changed = [i for i, e in enumerate(events) if e[0] == "quorum" and not e[1] and e[2] and i > first]
    assert len(changed) == 1, events[first:]
    done = events.index(("step_done", STOP_AT + 1), changed[0])
    in_force = [e[1] for e in events[:done] if e[0] == "limits"][-1]
    assert in_force is None and ("limits", derived) not in events[changed[0]:done], events[first:]
    assert [e for e in events[done:] if e[0] == "limits"][0] == ("limits", derived)
    for i, e in enumerate(events[first:], first):  # every other quorum: fixed limits inside, derived after
        if e[0] == "quorum" and e[1]:
            assert events[i + 1] == ("limits", None), events[i:i + 3]
    assert result["applied"] == derived
    # (the groups hold it as a timedelta, to the microsecond: a derived limit above the floor is not a round
    # number, and a loaded clean-clone run saw 1.222012 s for 1.2220118 s)
    assert by_step[STEPS]["pg_timeout_s"] == pytest.approx(derived, abs=1e-6)
    # (gloo keeps it in whole milliseconds, truncated: a clean-clone run saw 1.428 s for 1.4288472 s)
    assert derived - 1e-3 < result["gloo_timeout_s"] <= derived + 1e-6
