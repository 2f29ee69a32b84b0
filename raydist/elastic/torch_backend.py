"""Ray Train's TorchConfig as raydist's hang detection needs it: group timeouts later than raydist's own
detection, and NCCL's flight recorder on before the first process group exists.

On NCCL a collective never raises in Python: ProcessGroupNCCL's watchdog aborts the process once an op has
waited longer than the group's timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING, which Ray Train sets to 1,
tear down). raydist's monitor (raydist.elastic.hang, raydist.elastic.inflight) detects an op pending longer than
`elastic.collective_timeout_s` itself, names the rank that never arrived and ends the worker; the group's
timeout (`timeout_s`, the default group's, which Ray Train passes to `init_process_group`) is therefore
`hang.trigger.group_timeout_s`: detection, plus the diagnosis budget, plus a margin. It stays as the backstop.

The recorder is sized from the environment when ProcessGroupNCCL first records (FlightRecorder.hpp:
`TORCH_FR_BUFFER_SIZE`, else `TORCH_NCCL_TRACE_BUFFER_SIZE`), so the variables are set in every worker in
`on_start`, before Ray Train's own `on_start` creates the process group; a value the worker already has (the
user's runtime env) wins. TORCH_NCCL_DUMP_ON_TIMEOUT makes the backstop abort write the recorder's content
first (to TORCH_NCCL_DEBUG_INFO_TEMP_FILE, torch's default /tmp/nccl_trace_rank_<rank>), for the case
where raydist's monitor could not act.

Imported by the launcher only (it imports Ray Train at import time).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable

import torch.distributed as dist
from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend

from raydist import strict
from raydist.config import Config
from raydist.errors import wrapped
from raydist.elastic.hang.trigger import group_timeout_s

NCCL_ENV = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def set_env_defaults(env: dict[str, str]) -> None:
    for key, value in env.items():
        os.environ.setdefault(key, value)


def port_taken(error: BaseException) -> bool:
    """Whether `error` (a Ray task's, whose `cause` is the worker's exception, or one it chains) is rank 0's
    TCPStore failing to listen because its port was taken: Ray Train's `get_address_and_port` finds a free
    port by binding port 0 and closing the socket, and another process can take the port before the store
    binds it (a clean-clone CI run: EADDRINUSE, with other tests' gloo and Ray connections on the machine)."""
    return any(isinstance(e, dist.DistNetworkError) and any(m in str(e) for m in ("EADDRINUSE", "already in use"))
               for e in wrapped(error))


def retried_if_port_taken(start: Callable[..., None], *args) -> None:
    """Runs a backend's `start(*args)` (which sets up a process group); a store that lost its port
    (`port_taken`) becomes the error Ray Train retries. Ray Train retries a worker group whose start failed
    with WorkerGroupStartupFailedError (a controller error it counts against
    FailureConfig.controller_failure_limit, unbounded by default; any other error in a backend's on_start ends
    the run): new workers, a new port. The workers still waiting for the store are ended with the group."""
    try:
        start(*args)
    except Exception as exc:
        if not port_taken(exc):
            raise
        from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError

        raise WorkerGroupStartupFailedError(
            "a process group's store could not listen on the port Ray Train chose (another "
            "process took it first); starting the worker group again") from exc


class _WatchedTorchBackend(_TorchBackend):
    def on_start(self, worker_group, backend_config: "WatchedTorchConfig"):
        if backend_config.worker_env:
            worker_group.execute(set_env_defaults, env=dict(backend_config.worker_env))
        retried_if_port_taken(super().on_start, worker_group, backend_config)


@dataclass
class WatchedTorchConfig(TorchConfig):
    """TorchConfig plus environment variables set (unless already set) in every worker before the process
    group is created."""

    worker_env: dict = field(default_factory=dict)

    @property
    def backend_cls(self):
        return _WatchedTorchBackend


def torch_config(cfg: Config, use_gpu: bool) -> WatchedTorchConfig:
    """The default group's config: NCCL or gloo (the launcher turns gloo into the strict backend under the
    strict mode, raydist.strict.ray_train), with the timeout of the backend it will run."""
    runs = strict.device_backend("cuda" if use_gpu else "cpu")
    timeout_s = group_timeout_s(cfg.elastic.collective_timeout_s, runs, cfg.monitor.heartbeat_interval_s,
                                monitored=True)  # (every worker's RaySession starts a monitor: training/ray_session.py)
    return WatchedTorchConfig(backend="nccl" if use_gpu else "gloo", timeout_s=math.ceil(timeout_s),
                              worker_env=NCCL_ENV if use_gpu else {})
