"""raydist's TorchConfig backend (raydist.elastic.torch_backend): a default process group whose store lost its
port between Ray Train's choice and the bind fails the worker group's start in a way Ray Train retries, and
any other failure of the backend's start still ends the run."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from raydist.elastic import torch_backend


def taken_port_error() -> BaseException:
    """What rank 0's `_setup_torch_process_group` raised in CI, raised for real: a TCPStore on a port another
    socket listens on, wrapped as Ray wraps a task's exception."""
    from ray.exceptions import RayTaskError

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        try:
            dist.TCPStore("127.0.0.1", holder.getsockname()[1], is_master=True, wait_for_workers=False)
        except dist.DistNetworkError as exc:
            return RayTaskError("execute._setup_torch_process_group", "Traceback ...", exc)
    raise AssertionError("the store listened on a port already in use")


class _Group:
    def execute(self, fn, **kwargs):
        fn(**kwargs)

    def get_replica_groups(self):
        return []


def _default_group(monkeypatch, fail):
    from ray.train.torch.config import _TorchBackend

    monkeypatch.setattr(_TorchBackend, "on_start", fail)
    return torch_backend.WatchedTorchConfig(backend="gloo")


def _replica_groups(monkeypatch, fail):
    """Live recovery's backend, starting the whole group: a store per replica, each set up as the default
    group's is."""
    from ray.train.v2.torch.torchft_config import _TorchftBackend

    from raydist.elastic import replica_groups

    monkeypatch.setattr(_TorchftBackend, "on_start", fail)
    monkeypatch.setattr(replica_groups, "regroup", lambda group, size: None)
    monkeypatch.setattr(replica_groups, "_push_identities", lambda *args: None)
    return replica_groups.ReplicaGroupsConfig(lighthouse_kwargs={}, workers_per_replica=1)


@pytest.mark.parametrize("backend", [_default_group, _replica_groups], ids=["default-group", "replica-groups"])
@pytest.mark.parametrize("raised, retried", [("taken", True), ("other", False)])
def test_a_taken_port_restarts_the_group_and_any_other_failure_ends_the_run(monkeypatch, backend, raised, retried):
    from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError
    from ray.train.v2._internal.execution.failure_handling.default import RETRYABLE_CONTROLLER_ERRORS

    error = taken_port_error() if raised == "taken" else RuntimeError("gloo backend unavailable")
    assert torch_backend.port_taken(error) == retried

    def fail(self, worker_group, backend_config):
        raise error

    config = backend(monkeypatch, fail)
    with pytest.raises(Exception) as caught:
        config.backend_cls().on_start(_Group(), config)
    if retried:  # the error Ray Train's failure policy retries (ray/train/v2/.../failure_handling/default.py)
        assert isinstance(caught.value, WorkerGroupStartupFailedError) and caught.value.__cause__ is error
        assert issubclass(type(caught.value), RETRYABLE_CONTROLLER_ERRORS)
    else:
        assert caught.value is error and not isinstance(caught.value, RETRYABLE_CONTROLLER_ERRORS)
