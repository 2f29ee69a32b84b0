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


@pytest.mark.parametrize("raised, retried", [("taken", True), ("other", False)])
def test_a_taken_port_restarts_the_group_and_any_other_failure_ends_the_run(monkeypatch, raised, retried):
    from ray.train.torch.config import _TorchBackend
    from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError
    from ray.train.v2._internal.execution.failure_handling.default import RETRYABLE_CONTROLLER_ERRORS

    error = taken_port_error() if raised == "taken" else RuntimeError("gloo backend unavailable")
    assert torch_backend.port_taken(error) == retried

    def fail(self, worker_group, backend_config):
        raise error

    monkeypatch.setattr(_TorchBackend, "on_start", fail)
    backend = torch_backend.WatchedTorchConfig(backend="gloo").backend_cls()
    with pytest.raises(Exception) as caught:
        backend.on_start(_Group(), torch_backend.WatchedTorchConfig(backend="gloo"))
    if retried:  # the error Ray Train's failure policy retries (ray/train/v2/.../failure_handling/default.py)
        assert isinstance(caught.value, WorkerGroupStartupFailedError) and caught.value.__cause__ is error
        assert issubclass(type(caught.value), RETRYABLE_CONTROLLER_ERRORS)
    else:
        assert caught.value is error and not isinstance(caught.value, RETRYABLE_CONTROLLER_ERRORS)
