"""Warm spare processes, so that a restarted Ray Train worker group starts in processes that already run Ray
with Ray Train, torch and raydist imported.

A Ray Train restart replaces every worker actor, and an actor is hosted by a fresh Python process: importing
`ray.train` (which pulls in pandas and Ray Data) and torch takes seconds of a restart, all of it on the
critical path. Ray's raylet keeps idle worker processes in a pool and hands a new actor one whose job,
language and runtime env (its hash) match, provided the process never hosted anything
(ray-project/ray src/ray/raylet/worker_pool.cc: `FindAndPopIdleWorker`, `WorkerFitForLease`; a process that
ran a task or an actor never hosts another actor). This module fills that pool ahead of a failure:

- every Ray Train worker's runtime env carries SPARE_ENV_VAR (through `RunConfig.worker_runtime_env`, which
  Ray Train merges into the controller's runtime env for each worker actor). It marks the processes to
  preload, and it keeps the workers' spares apart from the controller's own: at every worker group start
  the controller also creates, with its own runtime env and on its own node, a SynchronizationActor
  (CONTROLLER_ACTORS; Ray Train's DatasetManager too, but raydist's trainer starts none,
  raydist.driver.ray_trainer), whose cold start otherwise competes for the cores with the workers';
- the job's `worker_process_setup_hook` (a job-level runtime env field: Ray runs it in every worker process
  of the job after the process connects and before it takes work; ray/_private/workers/default_worker.py)
  is `preload`: in a process with SPARE_ENV_VAR it imports what a raydist Ray Train worker imports, in a
  process with the controller's runtime env (CONTROLLER_ENV_VAR) the modules of the controller's actors, in
  any other process nothing;
- after a worker group's first step, local rank 0 of each node asks its raylet to start idle processes with
  the workers' exact runtime env, one per worker on the node, and on the controller's node one with the
  controller's runtime env, less those already idle there (`request_spares`: the raylet's PrestartWorkers
  RPC, `NodeManagerService.PrestartWorkers` in src/ray/protobuf/node_manager.proto, Ray >= 2.40; no public
  Python API calls it in Ray 2.60).

The RPC and the controller's runtime env are Ray internals, so the path is optional: it is taken only on a
Ray version it was checked against (SUPPORTED_RAY), any failure is one warning line, and a restart then
starts cold processes as before. tests/ray/test_warm_spares_on_ray.py fails if Ray stops placing actors in such
spares, tests/ray/test_elastic.py if a restarted Ray Train group starts a new process. The spares cost
memory (an idle process per worker with torch imported, one with Ray Train) and belong to the job: Ray
ends them with the driver.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
import time
import traceback
from importlib.machinery import ExtensionFileLoader

SPARE_ENV_VAR = "RAYDIST_SPARE_WORKER"
# Ray Train 2.60 sets it in its controller's runtime env (DataParallelTrainer._initialize_and_run_controller),
# which the controller's own actors inherit; the job's other processes do not have it
CONTROLLER_ENV_VAR = "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"
CONTROLLER_ACTORS = 1  # the SynchronizationActor, started with every worker group (raydist.driver.ray_trainer)
HOOK = "raydist.elastic.warm.preload"
# A spare is protected from Ray's idle-worker reaper this long (after it, only idle processes beyond the
# node's free CPUs are reaped); the job's end ends it anyway.
KEEP_ALIVE_S = 7 * 24 * 3600
SUPPORTED_RAY = ((2, 40), (2, 61))  # [first, last) minor versions the PrestartWorkers request was checked on
# How often local rank 0 tops its spares up: an actor of the job that starts after the first request can
# take a spare (Ray Data's _AutoscalingCoordinatorActor, a singleton started once, has the controller's
# runtime env); a top-up is a /proc scan, and an RPC only when a spare is missing.
TOP_UP_S = 10.0
# How many processes the hook ends per node and job for an import that failed after loading an extension
# module (`_import`)
UNFIT_ENDS = 3

# What a raydist Ray Train worker imports, in order; the last ones lazily, on its way to the first step:
# ray.train.torch (TorchConfig, unpickled on every worker), raydist's train function module and all it
# imports, torch._dynamo (imported by torch the first time a module is built on the meta device: 0.55 s),
# Ray Tune (`ray.train.get_context()` asks whether it runs in a Tune session, first in Ray Train's own
# process-group setup: 0.3 s), torch's profiler
PRELOAD = ("torch", "torch.distributed", "ray.train", "ray.train.torch", "raydist.training.ray_session",
           "raydist.training.loop", "raydist.training.trainer", "torch._dynamo")
PRELOAD_OPTIONAL = ("ray.tune.trainable.trainable_fn_utils", "torch.profiler")
PRELOAD_CONTROLLER = ("ray.train.v2._internal.execution.checkpoint.sync_actor",)

preloaded_at: float | None = None  # when `preload` finished in this process (None: it did not run)
# The process title a spare takes when its preload is done. Ray titles an idle worker `ray::IDLE` from
# before its core worker registers with the raylet (ray/_private/worker.py: connect), and runs the setup hook
# after it registered and before its task loop, so this title says from outside (`ps`, /proc) that the
# process is registered, preloaded and about to wait for work; Ray retitles it when it hosts something.
# (Idle CPU was tried instead: an idle worker's main thread still ticks about 10 ms a second in Ray's task
# loop, and on loaded CI machines the spares never looked quiet.)
READY_TITLE = "ray::IDLE raydist-preloaded"


def preload() -> None:
    """The job's worker_process_setup_hook (see the module docstring). Raises only for a process that can no
    longer import what a worker needs (`_import`): Ray then ends it before it hosts anything."""
    global preloaded_at
    if os.environ.get(SPARE_ENV_VAR):
        required, optional = PRELOAD, PRELOAD_OPTIONAL
    elif CONTROLLER_ENV_VAR in os.environ:
        required, optional = (), PRELOAD_CONTROLLER
    else:
        return
    for name in required:
        if not _import(name, required=True):
            return  # a cold import later fails with the real error where it matters, or succeeds
    for name in optional:
        _import(name, required=False)  # not installed, or moved by a Ray upgrade: nothing to preload
    preloaded_at = time.time()
    if os.environ.get("RAY_RAYLET_PID"):  # a Ray worker process (the raylet sets it), not a test's own
        try:
            from ray._raylet import setproctitle

            setproctitle(READY_TITLE)
        except Exception:  # only the title is missing then: the spare works, `ready_only` does not see it
            pass


def _import(name: str, required: bool) -> bool:
    """Imports `name`; False if that failed, after making sure the failure cannot poison this process.

    A failed import leaves behind the modules it had finished, and Python cannot run the same import again
    over them: the package's __init__ runs anew, but a submodule already in sys.modules is not bound to the
    new package object (importlib binds a submodule to its parent only when it loads it), so torch's second
    attempt ends in "partially initialized module 'torch' has no attribute 'library'" when the first had
    failed after torch.library was loaded (tests/unit/test_warm_spares.py makes one fail so). A Ray Train
    worker failed with that message in CI (2026-11-29, unpickling TorchConfig in init_train_context, in a
    process this hook had preloaded); whatever failed first was swallowed without a word, hence the warning
    below with the exception and its innermost frame. So, after a failure:
    - when the attempt loaded no extension module, the modules it added are dropped from sys.modules, and
      a later import starts from scratch;
    - when it loaded one (torch._C, Triton's libtriton), this process cannot import the package at all any
      more (a second `import torch` after torch._C was loaded fails with a SystemError from torch._C), so the hook
      raises and Ray ends the process before it hosts anything. A Ray Train worker waiting for it dies
      before its creation, and Ray Train starts the worker group again (WorkerGroupStartupFailedError, a
      retried controller failure). That happens at most UNFIT_ENDS times per node and job
      (`_count_unfit_end`): a failure that repeats then ends the run with the worker's own error, not with
      restarts forever."""
    before = set(sys.modules)
    try:
        importlib.import_module(name)
        return True
    except Exception as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        added = set(sys.modules) - before
        own = name.split(".")[0]  # name the package's own extension first (torch._C)
        extension = next((m for m in sorted(added, key=lambda m: (m.split(".")[0] != own, m))
                          if _is_extension(sys.modules.get(m))), None)
        if not required and extension is None and isinstance(exc, ImportError) and not added:
            return False  # not installed: nothing was loaded, nothing to say
        print(f"warning: raydist could not preload {name} in a spare worker ({type(exc).__name__}: {exc}{where})",
              flush=True)
        if extension is None:
            for module in added:
                sys.modules.pop(module, None)
            return False
        if _count_unfit_end() > UNFIT_ENDS:
            print(f"warning: this process loaded {extension} before that failure and cannot import {name} again; "
                  f"{UNFIT_ENDS} processes on this node were already ended for it, so this one is left to fail "
                  "where it imports it", flush=True)
            return False
        raise RuntimeError(f"raydist ends this spare worker: importing {name} failed ({type(exc).__name__}: {exc}) "
                           f"after loading {extension}, and this process cannot import {name} again") from exc


def _is_extension(module) -> bool:
    return isinstance(getattr(getattr(module, "__spec__", None), "loader", None), ExtensionFileLoader)


def _count_unfit_end() -> int:
    """Records that the hook ends this process and returns how many it has ended on this node for this job,
    this one included: a line per process in a file of the temp dir named by the raylet's pid and the job's
    id (the raylet sets both in every worker it starts)."""
    path = os.path.join(tempfile.gettempdir(), f"raydist-unfit-{os.environ.get('RAY_RAYLET_PID', 'none')}-"
                                               f"{os.environ.get('RAY_JOB_ID', 'none')}")
    try:
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")
        with open(path) as f:
            return len(f.read().splitlines())
    except OSError:  # no count, no bound: end nothing rather than risk ending every process
        return UNFIT_ENDS + 1


def enabled(cfg) -> bool:
    """Whether a run keeps warm spares: elastic.warm_spares, except under live recovery. There a failed
    replica's group is replaced while the others train, and with replicas of several workers the live runs
    did not reach their first steps with spares on (tests/faults/test_live_recovery.py, not yet understood;
    on 2026-11-29 the FSDP-inside case reached step 12 with them, but failed after the kill, at Ray Train's
    handling of the dead replica's workers: not investigated further), so live recovery starts its
    replacements cold."""
    return cfg.elastic.warm_spares and not cfg.elastic.live_recovery


def job_runtime_env() -> dict:
    """The job-level runtime env fields that make every new worker process of the job run `preload`."""
    return {"worker_process_setup_hook": HOOK}


def worker_runtime_env() -> dict:
    """RunConfig.worker_runtime_env: marks Ray Train's worker processes (see the module docstring)."""
    return {"env_vars": {SPARE_ENV_VAR: "1"}}


def controller_runtime_env(worker_env: str) -> str | None:
    """The Ray Train controller's runtime env, from one of its workers' (`worker_env`, exactly as the worker
    process got it), or None if the worker's is not marked.

    The controller creates each worker actor with its worker env, {"env_vars": the variables Ray Train hands
    on (already in the controller's own env) + SPARE_ENV_VAR}, which Ray merges into the controller's env
    (the core worker's MergeRuntimeEnv: JSON with sorted keys and no spaces); the controller's own actors
    inherit its env unchanged. So the controller's is the worker's without the marker's entry."""
    entry = f'"{SPARE_ENV_VAR}":"1"'
    for cut in (entry + ",", "," + entry):
        if cut in worker_env:
            return worker_env.replace(cut, "", 1)
    return None


def ray_supported(version: str) -> bool:
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return SUPPORTED_RAY[0] <= (major, minor) < SUPPORTED_RAY[1]


def idle_processes(raylet_pid: str, ready_only: bool = False, proc: str = "/proc") -> list[tuple[int, list[bytes]]]:
    """The worker processes of the raylet `raylet_pid` (RAY_RAYLET_PID in their environment: the raylet sets it)
    that host nothing yet, each with its environment's entries: named `ray::IDLE` (Ray names a process after
    what it hosts) or still starting (its python command line); with `ready_only`, only those whose preload is
    done (READY_TITLE). [] where there is no /proc."""
    found = []
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return found
    raylet, ready = f"RAY_RAYLET_PID={raylet_pid}".encode(), READY_TITLE.encode()
    for pid in pids:
        try:
            with open(f"{proc}/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0]
            if title.startswith(b"ray::") and not title.startswith(b"ray::IDLE"):
                continue  # hosts a task or an actor
            if ready_only and title != ready:
                continue
            with open(f"{proc}/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if raylet in env:
            found.append((int(pid), env))
    return found


def spare_pids(job_id: str, raylet_pid: str | None = None, controller: bool = False, ready_only: bool = False,
               proc: str = "/proc") -> list[int]:
    """This job's spare processes on this node that host nothing yet (`idle_processes` of the raylet `raylet_pid`,
    this process's own by default) whose environment has RAY_JOB_ID=`job_id` (the raylet sets it for the job's
    workers; a job id alone is not unique: every cluster's first job is 01000000) and SPARE_ENV_VAR (workers'
    spares) or, with `controller`, CONTROLLER_ENV_VAR without SPARE_ENV_VAR (the controller's); with
    `ready_only`, only those whose preload is done. [] where there is no /proc."""
    job, spare = f"RAY_JOB_ID={job_id}".encode(), f"{SPARE_ENV_VAR}=".encode()
    found = []
    for pid, env in idle_processes(raylet_pid or os.environ.get("RAY_RAYLET_PID", ""), ready_only, proc):
        marked = any(v.startswith(spare) for v in env)
        if controller:
            marked = not marked and any(v.startswith(f"{CONTROLLER_ENV_VAR}=".encode()) for v in env)
        if marked and job in env:
            found.append(pid)
    return sorted(found)


def request_spares(workers: int, controller_actors: int = 0, log=print) -> int | None:
    """From a Ray Train worker process: asks this node's raylet for idle processes with this process's
    runtime env until `workers` are idle or starting here, and with the controller's until
    `controller_actors` are. Returns how many it asked for (0 when enough are there), or None when it could
    not ask (one warning line then; asking again would fail the same way)."""
    try:
        import ray

        if not ray_supported(ray.__version__):
            log(f"warning: warm spare workers are off: Ray {ray.__version__} is outside the versions they were "
                f"checked on ({SUPPORTED_RAY[0][0]}.{SUPPORTED_RAY[0][1]} to before "
                f"{SUPPORTED_RAY[1][0]}.{SUPPORTED_RAY[1][1]}); restarts start cold processes")
            return None
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc
        from ray.core.generated.runtime_environment_pb2 import RuntimeEnvInfo

        worker = ray._private.worker.global_worker
        job_id = worker.current_job_id
        # the runtime env exactly as this process got it: the raylet matches an actor to an idle process by
        # the hash of this string
        runtime_env = worker.core_worker.get_current_runtime_env()
        if not os.environ.get("RAY_RAYLET_PID"):  # (set by the raylet in every worker it starts)
            raise RuntimeError("RAY_RAYLET_PID is not set: this is not a Ray worker process")
        if HOOK not in worker.core_worker.get_job_config().runtime_env_info.serialized_runtime_env:
            # without the preload a spare saves only the process start, and under `ray job submit` a Ray Train
            # worker that landed in one failed importing torch ("partially initialized module 'torch'", once in
            # CI: the message of a second import after a first that failed, see `_import`): no spares then
            log(f"warning: warm spare workers are off: the job's runtime env has no worker_process_setup_hook "
                f"{HOOK!r} (add it to `ray job submit --runtime-env-json`); restarts start cold processes")
            return None
        wanted = [(runtime_env, workers - len(spare_pids(job_id.hex())))]
        if controller_actors:
            controller_env = controller_runtime_env(runtime_env)
            if controller_env is None:
                raise ValueError(f"this process's runtime env has no {SPARE_ENV_VAR}: {runtime_env[:200]}")
            wanted.append((controller_env, controller_actors - len(spare_pids(job_id.hex(), controller=True))))
        wanted = [(env, n) for env, n in wanted if n > 0]
        if not wanted:
            return 0
        address = f"{worker.node.node_ip_address}:{worker.node.node_manager_port}"
        stub = node_manager_pb2_grpc.NodeManagerServiceStub(init_grpc_channel(address))
        for env, n in wanted:
            stub.PrestartWorkers(node_manager_pb2.PrestartWorkersRequest(
                language=common_pb2.PYTHON, job_id=job_id.binary(), num_workers=n,
                runtime_env_info=RuntimeEnvInfo(serialized_runtime_env=env),
                keep_alive_duration_secs=KEEP_ALIVE_S), timeout=10)
        return sum(n for _, n in wanted)
    except Exception as exc:
        log(f"warning: could not start warm spare workers ({type(exc).__name__}: {str(exc)[:200]}); "
            "a restart starts cold processes")
        return None
