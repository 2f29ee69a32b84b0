"""The driver's side of the Ray cluster: joining one or starting an embedded one, waiting for enough
capacity for the worker group, and whether workers get GPUs."""

from __future__ import annotations

import os
import time
from typing import Callable

from raydist import strict
from raydist.config import Config, ConfigError
from raydist.elastic import warm


# Ray Train V2 settings (ray/train/v2/_internal/constants.py); a value the user set in the environment wins.
# On any cluster:
RAY_TRAIN_ENV = {
    # How often the controller polls the workers (Ray's default 2 s): a failed worker group is noticed and
    # restarted up to this much later. Safe when the machine is loaded: a poll that has not answered within
    # the interval is only a missed check, not a failure (a worker is declared dead only after its poll
    # hangs RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S, 600 s). Each poll is an actor call on every worker,
    # taking the GIL from the training thread; 0.25 s measured 0.27 s faster from kill to first step than
    # 0.5 s (9.04 vs 9.31 s, one run each) with its cost on the step unmeasured, so 0.5 s stays.
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
}
# Only on an embedded cluster (one local node that ends with the driver: no autoscaler, no node drains):
EMBEDDED_RAY_TRAIN_ENV = {
    # Ray Train starts a PreemptionWatcher actor with every worker group and kills it with the group
    # (callbacks/preemption_callback.py): a new Python process importing Ray Train, about a second of a
    # core, started while a restarted group's workers import torch on the same cores. It watches Ray's
    # drain state for node preemption (spot nodes), which a local embedded cluster never has; without it a
    # lost node would still fail the group and be restarted, only without the drain grace window.
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
}
# Ray settings of an embedded cluster's raylet, which reads them from the environment it inherits when the
# driver starts it (so they mean nothing to a cluster raydist joins):
EMBEDDED_RAY_ENV = {
    # The raylet starts one idle worker process per CPU for a job's first driver (`--num_prestart_python_workers`
    # = num_cpus, ray/_private/services.py; RAY_prestart_worker_first_driver, on by default), each importing
    # Ray, for the driver's tasks. raydist's driver runs none: Ray Train's actors start in processes of their
    # own runtime env (the controller's, the workers' marked one: raydist.elastic.warm), which these never
    # match, so they host nothing. An embedded cluster has num_cpus >= the machine's cores: 64 such processes on
    # a 64-core machine, each about a second of CPU at the start, beside the workers' own start.
    "RAY_prestart_worker_first_driver": "0",
}


# Read by Ray Train's controller, but not among the variables Ray Train hands from the driver to it
# (ENV_VARS_TO_PROPAGATE): they reach it through the environment its processes inherit (an embedded cluster
# started by this driver, `ray start` on a node) or the job's runtime env (raydist joining a cluster). A
# driver that starts Ray itself must set them before `ray.init`.
CONTROLLER_ENV = {
    # How long the controller waits, when it tears a worker group down, for every worker to destroy its
    # process group (TorchConfig.on_shutdown, ray/train/torch/config.py; Ray's default 30 s). A hung or
    # stopped worker never answers, so every hang recovery waited the whole 30 s before the new group
    # started; the workers are killed after the wait either way, and a healthy gloo or NCCL teardown takes
    # well under a second.
    "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S": "5",
}


GROUP_START_TIMEOUT = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"  # from elastic.group_start_timeout_s


def train_env(embedded: bool, cfg: Config | None = None) -> dict[str, str]:
    """The Ray Train environment raydist runs with (and an embedded cluster's raylet settings): its defaults,
    the user's own values winning, and the run's configured settings (`cfg`), which always win (an earlier run
    in the same driver set them too)."""
    embedded_env = {**EMBEDDED_RAY_TRAIN_ENV, **EMBEDDED_RAY_ENV} if embedded else {}
    wanted = {**RAY_TRAIN_ENV, **CONTROLLER_ENV, **embedded_env}
    env = {k: os.environ.get(k, v) for k, v in wanted.items()}
    if cfg is not None:
        env[GROUP_START_TIMEOUT] = str(cfg.elastic.group_start_timeout_s)
    if strict.enabled():  # the strict-collectives mode reaches every worker (raydist.strict)
        env[strict.ENV] = "1"
    return env


def connect_ray(cfg: Config, address: str | None, min_cpus: float) -> bool:
    """Joins the cluster at `address` (or RAY_ADDRESS); else starts an embedded one. Returns True if
    embedded. Token authentication stays as Ray sets it (on by default since Ray 2.60)."""
    import logging

    import ray

    address = address or cfg.ray.address or os.environ.get("RAY_ADDRESS") or None
    if ray.is_initialized():
        # A driver that started Ray itself: Ray Train hands the RAY_TRAIN_* variables set in the driver's
        # environment to its controller and workers (ENV_VARS_TO_PROPAGATE in its constants.py); the
        # CONTROLLER_ENV ones only reach it if they were set before that `ray.init`
        os.environ.update(train_env(embedded=False, cfg=cfg))
        return False
    # The settings reach Ray Train's controller and workers on any cluster: in the job's runtime env when
    # joining one, through the driver's environment (inherited by every process) for an embedded one.
    env = train_env(embedded=not address, cfg=cfg)
    kwargs = dict(logging_level=logging.WARNING, log_to_driver=True)
    # An embedded cluster's processes inherit the driver's environment, and Ray Train hands the driver's
    # RAY_TRAIN_* variables to its controller (a submitted job keeps the runtime env it was submitted with)
    os.environ.update(env)
    # warm spares: Ray runs the job's worker_process_setup_hook in every new worker process (a submitted
    # job keeps the runtime env it was submitted with: see ElasticConfig.warm_spares)
    hook = warm.job_runtime_env() if warm.enabled(cfg) else {}
    if address and not os.environ.get("RAY_JOB_ID"):
        kwargs["runtime_env"] = {"env_vars": env, **hook}
    elif not address and hook:
        kwargs["runtime_env"] = hook
    if address:
        ray.init(address=address, **kwargs)
        return False
    # Logical CPUs: at least one per worker plus headroom for Ray Data read tasks and the controller.
    # address="local": a fresh instance even when another local cluster runs; no dashboard: nobody
    # submits jobs to an embedded cluster, and its processes would compete with training for the cores.
    num_cpus = max(os.cpu_count() or 1, int(min_cpus + 2))
    ray.init(address="local", num_cpus=num_cpus, **embedded_dashboard(), **kwargs)
    return True


def embedded_dashboard() -> dict[str, object]:
    """`ray.init` arguments for an embedded cluster: no dashboard, and its recorded address on a port of
    its own.

    Ray 2.60 records a dashboard address in the GCS even when the dashboard's HTTP server is off, on the
    default port 8265 (ray/dashboard/head.py, the `internal_kv_put` of DASHBOARD_ADDRESS after "http
    server disabled"). Ray Train's PlacementGroupCleaner (ray/train/v2/_internal/execution/controller/
    placement_group_cleaner.py, `_monitor_loop`) asks the state API at that address every second whether
    the run's controller is alive, and `is_actor_alive` (ray/train/v2/_internal/state/util.py) takes "no
    such actor" for dead: the cleaner then removes the run's placement group, which kills every worker.
    When another Ray cluster on the machine serves its dashboard on 8265 (a second run, a test, a user's
    own `ray start --head`), it answers "no such actor" for our controller and the whole worker group is
    torn down mid-run. On a free port nobody serves, every query fails instead, which the cleaner
    survives ("Continuing to monitor"); it has nothing to do for an embedded cluster anyway, which ends
    with the driver."""
    from raydist.parallel.runtime import free_port

    return {"include_dashboard": False, "dashboard_port": free_port()}


def worker_resources(cfg: Config, use_gpu: bool) -> dict[str, float]:
    resources = {"CPU": cfg.ray.cpus_per_worker}
    if use_gpu:
        resources["GPU"] = 1
    return resources


def workers_that_fit(per_worker: dict[str, float]) -> int:
    """How many workers the live nodes can hold at once (per node, not summed across nodes)."""
    import ray

    total = 0
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        have = node.get("Resources", {})
        total += min(int(have.get(k, 0) // v) for k, v in per_worker.items() if v > 0)
    return total


def wait_for_capacity(needed: int, per_worker: dict[str, float], max_pending_s: float, can_grow: bool,
                      log: Callable[[str], None] = print, setting: str = "ray.num_workers") -> int:
    """Waits (bounded) until the cluster can hold `needed` workers; a ConfigError otherwise.

    Waiting is also asking: an autoscaler launches nodes only for pending demand, so while the cluster
    is too small a placement group of the workers' bundles stays pending (what `ray status` shows as a
    demand). It is removed once placed; the nodes stay up for the autoscaler's idle timeout, long
    enough for Ray Train's own placement a moment later. Elastic runs ask for their minimum; Ray Train
    then asks for the rest.
    """
    fit = workers_that_fit(per_worker)
    if fit >= needed:
        return fit
    need = ", ".join(f"{v:g} {k}" for k, v in per_worker.items())

    def too_small(fit: int) -> ConfigError:
        return ConfigError(f"{setting}={needed} needs {needed} workers of {need} each but the cluster can hold {fit}"
                           + ("" if not can_grow else f" after waiting {max_pending_s:g}s") +
                           "; lower ray.num_workers (or elastic.min_workers) or add nodes")

    if not can_grow:
        raise too_small(fit)
    from ray.util.placement_group import placement_group, remove_placement_group

    log(f"waiting up to {max_pending_s:g}s for the cluster to hold {needed} workers (now {fit}); "
        "asking the autoscaler for them")
    start = time.monotonic()
    group = placement_group([dict(per_worker) for _ in range(needed)], strategy="PACK")
    try:
        placed = group.wait(timeout_seconds=max_pending_s)
    finally:
        remove_placement_group(group)
    fit = workers_that_fit(per_worker)
    if not placed:
        raise too_small(fit)
    log(f"scale-up: the cluster holds {fit} workers after {time.monotonic() - start:.1f}s")
    return fit


def resolve_use_gpu(cfg: Config) -> bool:
    import ray

    if cfg.ray.use_gpu == "auto":
        return ray.cluster_resources().get("GPU", 0) > 0
    return cfg.ray.use_gpu == "true"
