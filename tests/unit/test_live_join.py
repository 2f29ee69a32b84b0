"""A whole group of live-recovery replicas starts stepping together, through a real torchft Lighthouse and
Managers (no Ray): replica 1 builds its Manager seconds after replica 0 asked for its first quorum, and
replica 0's first quorum (`join`) still ends only once both replicas are in it. Were replica 0 to step
alone meanwhile and then die, no live replica would hold the state and replica 1 would have to resume from
storage: a restart, with steps redone, where a live replacement was wanted."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torchft  # noqa: F401  (the test extra installs it; missing, this is an error, not a skip)
from raydist.parallel.runtime import caller_process, start_method_context
from workers import patience

LATE_S = 2.0  # how much later replica 1 asks for its first quorum


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replica(replica: int, lighthouse: str, group_size: int, wait_s: float, out) -> None:
    import torch
    from torch.distributed import TCPStore

    from raydist.elastic.live import TorchftReplicas

    port = _free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # what Ray Train's env:// holds
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHFT_LIGHTHOUSE=lighthouse)
    if replica == 1:
        time.sleep(LATE_S)
    replicas = TorchftReplicas(replica, torch.device("cpu"), wait_s, dict, replicas=group_size)
    asked = time.time()
    healed = replicas.join()
    _, count = replicas.begin_step()  # the first step's quorum is the one join formed
    out.put({"replica": replica, "healed": healed, "count": count, "asked": asked, "joined": time.time()})
    time.sleep(1.0)  # the peer reads its quorum before this Manager goes
    replicas.shutdown()
    del store


def _start_group(group_size: int, wait_s: float, started: int = 2) -> dict[int, dict]:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    ctx = start_method_context()  # forks of the fork server, torch and raydist imported once
    out = ctx.Queue()
    procs = [caller_process(ctx, _replica, r, lighthouse.address(), group_size, wait_s, out) for r in range(started)]
    try:
        for p in procs:
            p.start()
        results = {}
        for _ in procs:
            rec = out.get(timeout=patience(120))
            results[rec["replica"]] = rec
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()


def test_a_fresh_group_waits_for_every_replica_before_its_first_step():
    results = _start_group(group_size=2, wait_s=60)
    assert [results[r]["count"] for r in (0, 1)] == [2, 2], results
    assert not results[0]["healed"] and not results[1]["healed"]  # a fresh start: nobody was ahead
    # the replica that asked first (replica 0, but for a freak scheduling) waited for the later one: it
    # did not step alone meanwhile
    first, last = sorted(results.values(), key=lambda r: r["asked"])
    assert last["asked"] <= first["joined"], results


def test_the_wait_is_bounded_when_a_replica_never_comes():
    # replica 1 never starts: replica 0 still ends its first quorum, alone, after its bounded wait (unbounded,
    # it would never return and _start_group would time out)
    results = _start_group(group_size=2, wait_s=3, started=1)
    assert results[0]["count"] == 1 and not results[0]["healed"], results
