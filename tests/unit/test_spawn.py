"""raydist.parallel.runtime.spawn starts its ranks as forks of a fork server that has imported torch and the trainer:
each call must still behave as fresh spawned interpreters would (the caller's environment at the call, a
process group of its own, failures reported with the rank's traceback or exit status)."""

from __future__ import annotations

import os

import pytest

from raydist.parallel import runtime
from raydist.parallel.runtime import spawn

_CALLS: list[int] = []  # module state a rank changes: a later call must not see it


def _rank_view(tag: str) -> dict:
    import torch
    import torch.distributed as dist

    _CALLS.append(1)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "env": os.environ.get("RAYDIST_SPAWN_TEST"),
            "tag": tag, "calls": len(_CALLS), "seed": torch.initial_seed(), "pid": os.getpid()}


def _fsspec_defaults() -> dict:
    from fsspec.config import conf

    return dict(conf.get("memory", {}))


def test_fsspec_settings_come_from_the_callers_environment(monkeypatch):
    # fsspec reads FSSPEC_<PROTOCOL>_<KEY> once, at import, which in a rank is the fork server's import
    monkeypatch.delenv("FSSPEC_MEMORY_RAYDIST_SPAWN_TEST", raising=False)
    assert spawn(_fsspec_defaults, 1) == [{}]  # the fork server is running now, started without the setting
    monkeypatch.setenv("FSSPEC_MEMORY_RAYDIST_SPAWN_TEST", "at-the-call")
    assert spawn(_fsspec_defaults, 1) == [{"raydist_spawn_test": "at-the-call"}]


def _fail_on(rank: int) -> int:
    import torch.distributed as dist

    if dist.get_rank() == rank:
        raise ValueError(f"rank {rank} refuses")
    return dist.get_rank()


def _exit_on(rank: int, code: int) -> int:
    import torch.distributed as dist

    if dist.get_rank() == rank:
        os._exit(code)
    return dist.get_rank()


def test_each_call_gets_fresh_ranks_with_the_callers_environment(monkeypatch):
    views = []
    for world, value in ((2, "first"), (3, "second")):
        monkeypatch.setenv("RAYDIST_SPAWN_TEST", value)  # set after the fork server may have started
        views.append(spawn(_rank_view, world, value))
    first, second = views
    assert [v["rank"] for v in first] == [0, 1] and [v["rank"] for v in second] == [0, 1, 2]
    assert {v["world"] for v in first} == {2} and {v["world"] for v in second} == {3}
    assert {v["env"] for v in first} == {"first"} and {v["env"] for v in second} == {"second"}
    assert all(v["calls"] == 1 for v in first + second)  # nothing left over from an earlier call
    assert len({v["pid"] for v in first + second}) == 5 and os.getpid() not in {v["pid"] for v in first}
    assert len({v["seed"] for v in first + second}) == 5  # a fresh random torch seed each, as spawned


def test_a_rank_failure_is_reported_with_its_traceback():
    with pytest.raises(RuntimeError) as err:
        spawn(_fail_on, 2, 1)
    assert "rank 1 failed" in str(err.value) and "Traceback" in str(err.value)
    assert "ValueError: rank 1 refuses" in str(err.value)


def _fail_before_bind_on(rank: int) -> int:
    # rank `rank` fails before the world's bind, as a rank would on a broken init; the others wait in it
    import torch.distributed as dist

    from raydist import strict

    if dist.get_rank() == rank:
        raise ValueError(f"rank {rank} broke before binding")
    strict.bind()
    return dist.get_rank()


def test_the_failure_that_caused_the_others_is_listed_first(monkeypatch):
    # The ranks left waiting for a failed rank fail too, and their errors may reach the caller first (a
    # clean-clone CI run showed only rank 2's "rank 1 left the world", never what rank 1 raised).
    monkeypatch.setenv("RAYDIST_STRICT_COLLECTIVES", "1")
    monkeypatch.setattr(runtime, "FAILURE_GRACE_S", 60.0)  # a loaded machine: spawn ends once all have failed
    with pytest.raises(RuntimeError) as err:
        spawn(_fail_before_bind_on, 3, 1, bound=False)
    text = str(err.value)
    assert "ValueError: rank 1 broke before binding" in text
    assert text.index("rank 1 failed") < text.index("left the world")  # the cause, then its consequences
    assert "rank 0 failed" in text and "rank 2 failed" in text


def test_a_rank_that_exits_is_reported_with_its_status():
    with pytest.raises(RuntimeError, match="rank 1 exited with status 7 without a result"):
        spawn(_exit_on, 2, 1, 7)
