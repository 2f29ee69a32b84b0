"""The driver: validate -> prepare data -> join or start Ray -> Ray Train V2 TorchTrainer -> progress.

Everything that can be checked without workers is checked here first (config relations, the data's
manifest and shards, the mesh against the worker count, whether the cluster can ever hold the workers),
so bad input ends in one `error:` line before any worker starts. Before anything is started or written,
`launch` also stops at a run that already completed (one line, exit 0), probes that checkpoint.storage
can be written, and takes the run's lease (raydist.checkpoint.lease: one driver per run directory). Every line it
logs and the config.toml it writes are redacted (raydist.store.redact); the I/O uses the real URIs.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from raydist import strict
from raydist.checkpoint.compat import check_run_dir
from raydist.checkpoint.lease import RunLease
from raydist.config import RUN_FACTS, Config, ConfigError, RunFacts
from raydist.data.prepare import default_data_path, prepare, read_manifest
from raydist.data.sft import check_masked_layout
from raydist.data.stream import Split
from raydist.driver.console import Console, ProgressSink, RayLogFile, result_line
from raydist.driver.follow import Follower
from raydist.driver.ray_cluster import connect_ray, resolve_use_gpu, wait_for_capacity, worker_resources
from raydist.elastic import failures
from raydist.metrics.tensorboard import TensorBoardTracker
from raydist.metrics.tracking import MlflowTracker, Tracker, end_all, start_all
from raydist.metrics.wandb_tracker import WandbTracker
from raydist.models.peft import check_pipeline_stages
from raydist.parallel.layout import Layout
from raydist.planner.policy import plan_layout, replica_layout
from raydist.store.atomic import probe_writable
from raydist.store.redact import redact
from raydist.store.run_store import RunStore, join


@dataclass(frozen=True)
class LaunchPlan:
    cfg: Config  # the user's, as given: what workers receive and config.toml records
    facts: RunFacts  # what the driver resolved: run name, storage, run directory, data path
    num_workers: int | tuple[int, int]
    layout: Layout  # at the smallest worker count that has one (`planned_for`); a live replica's own
    planned_for: int = 0  # the worker count `layout` was planned for (a replica's workers under live recovery)

    def layout_for_workers(self) -> dict | None:
        """The layout as data for a worker group of `planned_for` workers, which then plans nothing (another
        size plans its own). The policy's layout is a function of the config and the worker count alone; not
        sent for `parallel.auto` (the planner prices the device it runs on, which the driver's need not be).
        Under live recovery it is every replica's layout (planner.policy.replica_layout)."""
        if self.cfg.parallel.auto or not self.planned_for:
            return None
        return {"world_size": self.planned_for, "layout": self.layout.to_dict()}


def resolve_storage(uri: str) -> str:
    return uri if "://" in uri else os.path.abspath(os.path.expanduser(uri))


def new_run_name() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def ensure_data(cfg: Config, log: Callable[[str], None] = print) -> str:
    """The run's prepared data (data.path, or the default corpus, prepared on first use), its manifest and
    every shard's footer checked against the config. Returns its path (a run fact: the config keeps what the
    user wrote)."""
    path = cfg.data.path
    if not path:
        path = default_data_path(cfg.data)
        if read_manifest(path, missing_ok=True) is None:
            log(f"preparing {cfg.data.corpus} corpus at {path} (first use)")
            prepare(cfg.data, path, log=log)
    manifest = read_manifest(path)
    if manifest["seq_len"] != cfg.data.seq_len:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} but {path} was prepared with seq_len="
                          f"{manifest['seq_len']}; set data.seq_len={manifest['seq_len']} or prepare again")
    vocab = manifest["tokenizer"]["vocab_size"]
    if vocab > cfg.model.vocab_size and cfg.model.init_from:
        raise ConfigError(f"{path} was tokenized with a vocabulary of {vocab} but {cfg.model.init_from} "
                          f"has vocab_size={cfg.model.vocab_size}; prepare the data with the model's tokenizer "
                          f"(data.tokenizer = \"{cfg.model.init_from[3:]}/tokenizer.json\")")
    if vocab > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({vocab}); set model.vocab_size >= {vocab}")
    if cfg.model.init_from:  # a model directory's own tokenizer.json must be the one the data was made with
        from raydist.config import hf_dir_of
        from raydist.data.tokenizer import check_data_tokenizer

        check_data_tokenizer(hf_dir_of(cfg.model.init_from), manifest["tokenizer"], path)
    if manifest.get("loss_mask"):
        check_masked_layout(cfg.elastic.live_recovery)
    for split in ("train", "val") if cfg.train.eval_every else ("train",):
        Split.open(path, split, manifest).check_files(cfg.model.vocab_size)
    return path


def with_prepared_data(cfg: Config, log: Callable[[str], None] = print) -> Config:
    """`cfg` with data.path set to its prepared data (`ensure_data`): for in-process runs of one config
    (raydist.testing's harness in benchmarks and tests), which have no run facts."""
    return replace(cfg, data=replace(cfg.data, path=ensure_data(cfg, log)))


def check_live_recovery(cfg: Config) -> None:
    """Live recovery needs torchft; replicas of several workers also need the Ray whose worker-group internals
    raydist.elastic.replica_groups relies on (replicas of one worker use Ray Train's own TorchftConfig)."""
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ConfigError("elastic.live_recovery=true needs torchft, which is not installed; "
                          "pip install 'raydist[live]' (or set elastic.live_recovery=false)") from None
    from raydist.elastic.live import workers_per_replica

    if workers_per_replica(cfg) > 1:
        from raydist.elastic.replica_groups import check_ray_version  # (importing it checks too)

        check_ray_version()


def plan(cfg: Config, log: Callable[[str], None] = print) -> LaunchPlan:
    """All driver-side checks; returns where the run goes, how many workers it asks for and their layout.
    `cfg` is not rewritten: what the driver resolves goes into the plan's RunFacts."""
    data_path = ensure_data(cfg, log)
    if cfg.elastic.live_recovery:
        check_live_recovery(cfg)
    if cfg.model.init_from:  # names and shapes from the safetensors headers, before any worker starts
        from raydist.config import hf_dir_of
        from raydist.models.hf_load import check_checkpoint

        check_checkpoint(hf_dir_of(cfg.model.init_from), cfg.model)
    num_workers: int | tuple[int, int] = cfg.ray.num_workers
    if cfg.elastic_enabled:
        num_workers = (cfg.elastic.min_workers, cfg.elastic.max_workers)
    layout, planned_for = first_layout(cfg)
    check_pipeline_stages(cfg.peft.method, cfg.peft.trainable_last_layers, layout)
    storage = resolve_storage(cfg.checkpoint.storage)
    run_name = cfg.train.run_name or new_run_name()
    facts = RunFacts(run_name=run_name, storage=storage, data_path=data_path)
    check_storage(storage)  # before anything reads it: an unreachable store is one error line
    check_run_dir(facts.run_dir, cfg, read_manifest(data_path))  # a resumed run's checkpoints must fit
    return LaunchPlan(cfg, facts, num_workers, layout, planned_for)


def first_layout(cfg: Config) -> tuple[Layout, int]:
    """(layout, worker count) for the smallest worker count that has a layout: the configured count of a
    fixed-size run, the first of an elastic range that fits, a replica's workers under live recovery."""
    if cfg.elastic.live_recovery:
        from raydist.elastic.live import workers_per_replica

        return replica_layout(cfg), workers_per_replica(cfg)
    sizes = range(cfg.elastic.min_workers, cfg.elastic.max_workers + 1) if cfg.elastic_enabled \
        else [cfg.ray.num_workers]
    errors = []
    for size in sizes:
        try:
            return plan_layout(cfg, size), size
        except ConfigError as exc:
            errors.append(exc)
    raise errors[0]


def worker_label_selectors(cfg: Config) -> list[dict[str, str]]:
    """Each worker's Ray label selector (placement-group bundle i: worker i) from ray.replica_labels: replica
    r's selector for workers [r W, (r + 1) W). Ray Train orders the started workers by node, in the order
    their nodes first appear in bundle order, and raydist.elastic.replica_groups cuts that order into
    replicas of W. With selectors that match disjoint sets of nodes (zones), and replicas sharing a selector
    side by side (the config checks it), the workers of each selector's nodes are a contiguous run of whole
    replicas in that order, so every replica runs on its selector's nodes. A replaced replica restarts at its
    bundles, under the same labels."""
    from raydist.elastic.live import workers_per_replica

    selectors = cfg.replica_label_selectors()
    return [dict(s) for s in selectors for _ in range(workers_per_replica(cfg))]


def worker_payload(lp: LaunchPlan, use_gpu: bool, start_time: float, record_samples: bool = False,
                   driver_node: str | None = None) -> dict[str, Any]:
    """What every worker receives (raydist.training.ray_session.ray_worker_entry), as data: the user's config
    as given, the run facts, the layout for the worker count it was planned for, and the driver's clock."""
    return {"config": lp.cfg.to_dict(), "facts": lp.facts.to_dict(), "layout": lp.layout_for_workers(),
            "use_gpu": use_gpu, "start_time": start_time, "record_samples": record_samples,
            "driver_node": driver_node}


def build_trainer(lp: LaunchPlan, use_gpu: bool, start_time: float, record_samples: bool = False):
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    from raydist.driver.ray_trainer import Trainer
    from raydist.elastic import warm
    from raydist.training.ray_session import ray_worker_entry

    cfg, facts = lp.cfg, lp.facts
    scaling = ScalingConfig(num_workers=lp.num_workers, use_gpu=use_gpu,
                            resources_per_worker=worker_resources(cfg, use_gpu), placement_strategy="PACK",
                            label_selector=worker_label_selectors(cfg) or None)
    if cfg.elastic_enabled:
        scaling.elastic_resize_monitor_interval_s = cfg.elastic.resize_check_interval_s
    payload = worker_payload(lp, use_gpu, start_time, record_samples, ray.get_runtime_context().get_node_id())
    backend = dict(backend="nccl" if use_gpu else "gloo", timeout_s=int(cfg.elastic.collective_timeout_s))
    if cfg.elastic.live_recovery:
        # Ray Train runs torchft's Lighthouse and makes every replica's dp_shard x cp x tp x pp workers a replica
        # group, replacing only a failed one whole (raydist.elastic.live, raydist.elastic.replica_groups)
        from raydist.elastic.live import LIGHTHOUSE_KWARGS, workers_per_replica

        if workers_per_replica(cfg) == 1:  # Ray's own replica groups of one worker
            from ray.train.v2.torch.torchft_config import TorchftConfig

            torch_config = TorchftConfig(lighthouse_kwargs=dict(LIGHTHOUSE_KWARGS), **backend)
        else:
            from raydist.elastic.replica_groups import ReplicaGroupsConfig

            torch_config = ReplicaGroupsConfig(dict(LIGHTHOUSE_KWARGS), workers_per_replica(cfg), **backend)
    else:  # group timeouts after raydist's own hang detection, NCCL's flight recorder on (see there)
        from raydist.elastic.torch_backend import torch_config as watched_torch_config

        torch_config = watched_torch_config(cfg, use_gpu)
    if strict.enabled() and not use_gpu:  # gloo under NCCL's rules (raydist.strict)
        from raydist.strict.ray_train import strict_torch_config

        torch_config = strict_torch_config(torch_config)
    return Trainer(  # TorchTrainer; an elastic run sized from the alive nodes, no DatasetManager
        ray_worker_entry,
        train_loop_config=payload,
        torch_config=torch_config,
        scaling_config=scaling,
        run_config=RunConfig(name=facts.run_name, storage_path=facts.storage,
                             failure_config=FailureConfig(max_failures=cfg.elastic.max_failures),
                             worker_runtime_env=warm.worker_runtime_env() if warm.enabled(cfg) else {}),
    )


# ---- progress --------------------------------------------------------------------------------------


class Progress(Follower):
    """Follows the run directory on the driver: a live bar on a terminal, a line per logged step elsewhere,
    a line per event an operator should see (raydist.driver.console)."""

    def __init__(self, run_dir: str, total_steps: int, stream=None, console: Console | None = None,
                 interval_s: float = 1.0):
        console = console or Console(verbose=True)
        super().__init__(run_dir, [ProgressSink(total_steps, console, stream)], interval_s, name="raydist-progress")


def _warn_local_paths(cfg: Config, lp: LaunchPlan, log: Callable[[str], None]) -> None:
    """On a cluster, local paths are only seen by the machine they are on: say so (the job may still be
    right on a one-node cluster or a shared file system)."""
    import ray

    if len([n for n in ray.nodes() if n.get("Alive")]) <= 1 and not os.environ.get("RAY_JOB_ID"):
        return
    for key, value in (("checkpoint.storage", lp.facts.storage), ("data.path", lp.facts.data_path)):
        if "://" not in value:
            log(f"warning: {key}={value} is a local path; on a multi-node cluster (and under `ray job submit`, "
                f"whose working directory is temporary) use shared storage such as s3://bucket/prefix")


# ---- safety: before anything is started or written -----------------------------------------------


def redacting(log: Callable[[str], None]) -> Callable[[str], None]:
    """`log` with the credentials of every URI in the line masked (the I/O keeps the real URIs)."""
    return lambda line: log(redact(line))


def completed_summary(cfg: Config, log: Callable[[str], None]) -> dict[str, Any] | None:
    """summary.json of a finished run with this train.run_name that reached train.steps (then says so in
    one line), else None. Reads only: no Ray, no writes. An unreadable storage or a torn summary reads as
    not finished (the storage probe and the run itself then say what is wrong)."""
    if not cfg.train.run_name:
        return None
    run_dir = join(resolve_storage(cfg.checkpoint.storage), cfg.train.run_name)
    try:
        summary = RunStore(run_dir).read_json("summary.json")
    except Exception:
        return None
    if not isinstance(summary, dict) or summary.get("status") != "completed":
        return None
    steps = summary.get("steps")
    if not isinstance(steps, int) or steps < cfg.train.steps:
        return None
    log(f"run {cfg.train.run_name} already completed at step {steps} ({run_dir}); nothing to do")
    return summary


def check_storage(storage: str) -> None:
    """A ConfigError unless a small file can be written and deleted under checkpoint.storage (on the
    driver, before Ray starts: an unreachable, read-only or wrongly authorised storage would otherwise
    fail in every worker, after the cluster was set up)."""
    try:
        probe_writable(storage)
    except Exception as exc:
        detail = (str(exc).strip().splitlines() or [""])[0]
        raise ConfigError(redact(f"checkpoint.storage={storage} cannot be written ({type(exc).__name__}: {detail}); "
                                 "point it at a writable directory or bucket, or fix its permissions or "
                                 "credentials")) from None


# ---- entry -----------------------------------------------------------------------------------------


def launch(cfg: Config, address: str | None = None, log: Callable[[str], None] | None = None,
           console: Console | None = None, record_samples: bool = False) -> dict[str, Any]:
    """Runs a training job to completion; returns summary.json's content. `console` (the CLI's) keeps
    Ray's output in RUN_DIR/logs/ unless it is verbose; `log` defaults to its lines (else print).
    `record_samples` (tests): with live recovery, every replica appends the sample ids of its committed
    steps to RUN_DIR/samples/."""
    start_time = time.time()
    log = redacting(log or (console.line if console is not None else print))
    done = completed_summary(cfg, log)
    if done is not None:
        return done
    lp = plan(cfg, log)
    with RunLease(lp.facts.run_dir, lp.facts.run_name, log=log):
        try:
            return _launch(cfg, lp, address, start_time, log, console or Console(verbose=True), record_samples)
        except KeyboardInterrupt:
            record_end(lp.facts.run_dir, start_time, "interrupted", "interrupted (Ctrl-C or SIGINT)")
            raise
        except BaseException as exc:
            record_end(lp.facts.run_dir, start_time, "failed", failures.describe(exc))
            raise


def record_end(run_dir: str, start_time: float, status: str, error: str) -> None:
    """The driver's `end` event for a run that did not complete (what `raydist status` reads)."""
    from raydist.metrics.goodput import EventLog

    try:
        EventLog(run_dir, start_time).event("end", None, status=status, error=redact(error)[:500], source="driver")
    except Exception:  # bookkeeping must never hide the run's own outcome
        pass


def configured_trackers(cfg: Config, run_dir: str, run_name: str, log: Callable[[str], None]) -> list[Tracker]:
    """Every tracker the config asks for, the only writers of tracking data (raydist.metrics.tracking), in
    the order they start (those that can fail first): MLflow with tracking.mlflow_uri, Weights & Biases with
    tracking.wandb_project, TensorBoard always."""
    trackers: list[Tracker] = []
    if cfg.tracking.mlflow_uri:
        trackers.append(MlflowTracker(cfg, run_dir, run_name, log))
    if cfg.tracking.wandb_project:
        trackers.append(WandbTracker(cfg, run_dir, run_name, log))
    trackers.append(TensorBoardTracker(run_dir, log))
    return trackers


def _summary(run_dir: str) -> dict[str, Any]:
    """summary.json's content for the trackers' end ({} when missing, torn or unreadable)."""
    try:
        summary = RunStore(run_dir).read_json("summary.json")
    except Exception:
        return {}
    return summary if isinstance(summary, dict) else {}


def _launch(cfg: Config, lp: LaunchPlan, address: str | None, start_time: float,
            log: Callable[[str], None], console: Console, record_samples: bool = False) -> dict[str, Any]:
    store = RunStore(lp.facts.run_dir)
    store.write_text("config.toml", redact(cfg.to_toml()))  # the user's config, as given
    store.write_text(RUN_FACTS, redact(json.dumps(lp.facts.to_dict(), indent=1)))
    # before Ray: a tracker that cannot start is one `error:` line
    trackers = start_all(configured_trackers(cfg, lp.facts.run_dir, lp.facts.run_name, log), log)
    status = "FAILED"
    try:
        with console.quiet(lp.facts.run_dir, lp.facts.run_name) as logs:
            ray_log = RayLogFile(os.path.join(logs, "workers.log")) if logs else None
            try:
                _run_on_ray(cfg, lp, address, start_time, log, console, ray_log, trackers, record_samples)
            finally:
                if ray_log is not None:
                    ray_log.close()
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        end_all(trackers, status, _summary(lp.facts.run_dir), log)
    summary = store.read_json("summary.json") or {}
    log(result_line(summary, lp.facts.run_dir, time.time() - start_time))
    return summary


def _run_on_ray(cfg: Config, lp: LaunchPlan, address: str | None, start_time: float, log: Callable[[str], None],
                console: Console, ray_log: RayLogFile | None, trackers: list[Tracker],
                record_samples: bool = False) -> None:
    import ray

    needed = cfg.elastic.min_workers if cfg.elastic_enabled else cfg.ray.num_workers
    embedded = connect_ray(cfg, address, needed * cfg.ray.cpus_per_worker)
    if ray_log is not None:
        ray_log.install()  # the cluster's streamed lines: to logs/workers.log, not the console
    if not embedded:
        _warn_local_paths(cfg, lp, log)
    try:
        use_gpu = resolve_use_gpu(cfg)
        from raydist.kernels import resolve_kernels

        resolve_kernels(cfg.kernels, "cuda" if use_gpu else "cpu", cfg.head_dim)  # a bad choice fails here
        wait_for_capacity(needed, worker_resources(cfg, use_gpu), cfg.ray.max_pending_s, can_grow=not embedded,
                          log=log, setting="elastic.min_workers" if cfg.elastic_enabled else "ray.num_workers")
        # (get_runtime_context() on an uninitialised Ray would start one: only ask a connected driver)
        gcs = ray.get_runtime_context().gcs_address if ray.is_initialized() else address or cfg.ray.address
        where = "an embedded local Ray" if embedded else f"the Ray cluster at {gcs}"
        backend = "GPU/nccl" if use_gpu else "CPU/gloo under NCCL's rules (strict collectives)" if strict.enabled() \
            else "CPU/gloo"
        log(f"run {lp.facts.run_name}: {lp.num_workers} worker(s), {backend} on {where}; "
            f"run directory {lp.facts.run_dir}")
        if console.logs_dir:
            log(f"Ray's own output goes to {console.logs_dir}/ (driver.log, workers.log); --verbose shows it here")
        trainer = build_trainer(lp, use_gpu, start_time, record_samples)
        try:
            tracking = Follower(lp.facts.run_dir, trackers, name="raydist-tracking")
            with Progress(lp.facts.run_dir, cfg.train.steps, console=console), tracking:
                trainer.fit()
        finally:
            fatal = failures.recorded(lp.facts.run_dir, start_time)
            if fatal is not None:  # a deterministic failure: its message, not Ray Train's retry story
                raise failures.DeterministicFailure(f"{fatal['error']} (rank {fatal['rank']}; not retried: a "
                                                    "restart would fail the same way)")
    finally:
        if embedded:
            ray.shutdown()
