"""Warm spare worker processes, so that a restarted Ray Train worker group starts in processes that already
run Ray with Ray Train, torch and raydist imported.

A Ray Train restart replaces every worker actor, and an actor is hosted by a fresh Python process: importing
`ray.train` (which pulls in pandas and Ray Data) and torch takes seconds of a restart, all of it on the
critical path. Ray's raylet keeps idle worker processes in a pool and hands a new actor one whose job,
language and runtime env (its hash) match, provided the process never hosted anything
(ray-project/ray src/ray/raylet/worker_pool.cc: `FindAndPopIdleWorker`, `WorkerFitForLease`; a process that
ran a task or an actor never hosts another actor). This module fills that pool ahead of a failure:

- every Ray Train worker's runtime env carries SPARE_ENV_VAR (through `RunConfig.worker_runtime_env`, which
  Ray Train merges into each worker actor's runtime env). It marks the processes to preload, and it makes
  the workers' runtime env differ from the Train controller's own, so that the actors the controller creates
  with its env (a SynchronizationActor per worker group) cannot take a spare;
- the job's `worker_process_setup_hook` (a job-level runtime env field: Ray runs it in every worker process
  of the job after the process connects and before it takes work; ray/_private/workers/default_worker.py)
  is `preload`: in a process with SPARE_ENV_VAR it imports what a raydist Ray Train worker imports, in every
  other process it returns at once;
- after a worker group's first step, local rank 0 of each node asks its raylet to start idle processes with
  the workers' exact runtime env, one per worker on the node less those already idle there
  (`request_spares`: the raylet's PrestartWorkers RPC, `NodeManagerService.PrestartWorkers` in
  src/ray/protobuf/node_manager.proto, Ray >= 2.40; no public Python API calls it in Ray 2.60).

The RPC is Ray internals, so the path is optional: it is taken only on a Ray version it was checked against
(SUPPORTED_RAY), any failure is one warning line and the restart simply starts cold processes as before.
tests/ray/test_warm_spares.py fails if Ray stops placing an actor in a prestarted process.
The spares cost memory (one idle process per worker with torch imported) and are bound to the job: Ray
ends them with the driver.
"""

from __future__ import annotations

import os
import time

SPARE_ENV_VAR = "RAYDIST_SPARE_WORKER"
HOOK = "raydist.elastic.warm.preload"
# A spare is protected from Ray's idle-worker reaper this long (after it, only idle processes beyond the
# node's free CPUs are reaped); the job's end ends it anyway.
KEEP_ALIVE_S = 7 * 24 * 3600
SUPPORTED_RAY = ((2, 40), (2, 61))  # [first, last) minor versions the PrestartWorkers request was checked on

preloaded_at: float | None = None  # when `preload` finished in this process (None: it did not run)


# What a raydist Ray Train worker imports, in order; the last ones lazily, on its way to the first step:
# ray.train.torch (TorchConfig, unpickled on every worker), raydist's train function module and all it
# imports, torch._dynamo (imported by torch the first time a module is built on the meta device: 0.55 s),
# TensorBoard's writer (rank 0 opens one at every start)
PRELOAD = ("torch", "torch.distributed", "ray.train", "ray.train.torch", "raydist.elastic.ray_session",
           "raydist.train_loop", "raydist.trainer", "torch._dynamo")
PRELOAD_OPTIONAL = ("torch.utils.tensorboard",)


def preload() -> None:
    """The job's worker_process_setup_hook: imports a raydist Ray Train worker's modules in a process that
    will host one (SPARE_ENV_VAR set), nothing in any other. Never raises: Ray ends a worker whose hook
    fails."""
    global preloaded_at
    if not os.environ.get(SPARE_ENV_VAR):
        return
    import importlib

    try:
        for name in PRELOAD:
            importlib.import_module(name)
    except Exception as exc:  # a cold import later fails with the real error where it matters
        print(f"warning: raydist could not preload a spare worker ({type(exc).__name__}: {exc})", flush=True)
        return
    for name in PRELOAD_OPTIONAL:
        try:
            importlib.import_module(name)
        except Exception:  # not installed: nothing to preload
            pass
    preloaded_at = time.time()


def job_runtime_env() -> dict:
    """The job-level runtime env fields that make every new worker process of the job run `preload`."""
    return {"worker_process_setup_hook": HOOK}


def worker_runtime_env() -> dict:
    """RunConfig.worker_runtime_env: marks Ray Train's worker processes (see the module docstring)."""
    return {"env_vars": {SPARE_ENV_VAR: "1"}}


def ray_supported(version: str) -> bool:
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return SUPPORTED_RAY[0] <= (major, minor) < SUPPORTED_RAY[1]


def spare_pids(job_id: str, ready_only: bool = False, proc: str = "/proc") -> list[int]:
    """This job's spare processes on this node that host nothing yet: processes whose environment has
    SPARE_ENV_VAR and RAY_JOB_ID=`job_id` (the raylet sets it for the job's workers), named `ray::IDLE` (Ray
    names a process after what it hosts) or, unless `ready_only`, still starting (its python command line).
    [] where there is no /proc."""
    found = []
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return found
    marker, job = f"{SPARE_ENV_VAR}=1".encode(), f"RAY_JOB_ID={job_id}".encode()
    for pid in pids:
        try:
            with open(f"{proc}/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0]
            if title.startswith(b"ray::") and not title.startswith(b"ray::IDLE"):
                continue  # hosts a task or an actor
            if ready_only and not title.startswith(b"ray::IDLE"):
                continue
            with open(f"{proc}/{pid}/environ", "rb") as f:
                env = set(f.read().split(b"\0"))
        except OSError:  # gone, or not ours to read
            continue
        if marker in env and job in env:
            found.append(int(pid))
    return sorted(found)


def request_spares(wanted: int, log=print) -> int:
    """From a Ray Train worker process: asks this node's raylet for idle processes with this process's
    runtime env until `wanted` are idle or starting here. Returns how many it asked for (0 when enough are
    there, or when it could not ask: one warning line then)."""
    try:
        import ray

        if not ray_supported(ray.__version__):
            log(f"warning: warm spare workers are off: Ray {ray.__version__} is outside the versions they were "
                f"checked on ({SUPPORTED_RAY[0][0]}.{SUPPORTED_RAY[0][1]} to before "
                f"{SUPPORTED_RAY[1][0]}.{SUPPORTED_RAY[1][1]}); restarts start cold processes")
            return 0
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc
        from ray.core.generated.runtime_environment_pb2 import RuntimeEnvInfo

        worker = ray._private.worker.global_worker
        job_id = worker.current_job_id
        missing = wanted - len(spare_pids(job_id.hex()))
        if missing <= 0:
            return 0
        # the runtime env exactly as this process got it: the raylet matches an actor to an idle process by
        # the hash of this string (the controller's merge of its own env with the worker env)
        runtime_env = worker.core_worker.get_current_runtime_env()
        address = f"{worker.node.node_ip_address}:{worker.node.node_manager_port}"
        stub = node_manager_pb2_grpc.NodeManagerServiceStub(init_grpc_channel(address))
        stub.PrestartWorkers(node_manager_pb2.PrestartWorkersRequest(
            language=common_pb2.PYTHON, job_id=job_id.binary(), num_workers=missing,
            runtime_env_info=RuntimeEnvInfo(serialized_runtime_env=runtime_env),
            keep_alive_duration_secs=KEEP_ALIVE_S), timeout=10)
        return missing
    except Exception as exc:
        log(f"warning: could not start warm spare workers ({type(exc).__name__}: {str(exc)[:200]}); "
            "a restart starts cold processes")
        return 0
