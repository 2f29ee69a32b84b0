"""The run-level sections of the configuration (see config.py): checkpoints, elasticity, Ray, kernels,
fine-tuning, monitoring and tracking. Each field's docstring is read back by `config_io.field_docs`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointConfig:
    storage: str = "./runs"
    """Where run directories go: a local path or any fsspec URI (s3://bucket/prefix, gs://...)."""
    every_steps: int = 100
    """Save a checkpoint every this many steps (0: only at the end)."""
    keep: int = 3
    """Committed checkpoints to keep (older ones are deleted after a newer one commits)."""
    async_save: bool = True
    """Write checkpoints in the background while training continues."""


@dataclass(frozen=True)
class ElasticConfig:
    min_workers: int = 0
    """Smallest worker count an elastic run trains on (0 with max_workers 0: a fixed-size run)."""
    max_workers: int = 0
    """Largest worker count an elastic run grows to."""
    resize_check_interval_s: float = 30.0
    """How often Ray Train considers growing a healthy elastic run."""
    max_failures: int = 3
    """Restarts after worker or node failures before the run gives up (-1: unlimited)."""
    collective_timeout_s: float = 300.0
    """A collective that waits longer than this fails (so a dead peer ends in a restart, not a hang): on gloo
    it raises; on NCCL and under the strict mode raydist's hang monitor ends the worker after naming the
    rank that never arrived (those groups' own timeout is set later, as a backstop). A training step, an
    evaluation or a report to Ray Train that makes no progress for twice as long ends the worker (the step
    watchdog)."""
    startup_timeout_s: float = 900.0
    """The watchdog's limit for a worker's start: building and parallelizing the model, loading the
    checkpoint, and the first step (which waits for the first data)."""
    checkpoint_timeout_s: float = 1800.0
    """The longest a checkpoint save (or waiting for one in flight) may take before the worker fails."""
    group_start_timeout_s: float = 60.0
    """How long Ray Train waits for a new worker group's resources and processes before it decides its size
    again (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S). An elastic run's restart is sized from the nodes alive
    when it is decided (`raydist/elastic/fresh_view.py`; Ray Train's own policy would count a lost node
    until its coordinator's next 20 s tick and ask for the old size first, waiting out this timeout), so
    this wait is for processes slow to start."""
    warm_spares: bool = True
    """Keep one idle, started worker process per worker (Python with Ray, Ray Train, torch and raydist
    imported) on each node, so that a restarted worker group starts in them instead of new processes
    (raydist.elastic.warm; costs one idle process's memory per worker). They need the job's runtime env to
    preload them: under `ray job submit` add {"worker_process_setup_hook": "raydist.elastic.warm.preload"} to
    it (without it, no spares). Not with elastic.live_recovery (its replacements start cold)."""
    live_recovery: bool = False
    """Live recovery (torchft): each of the parallel.dp_replicate replicas is dp_shard x cp x tp x pp workers
    with its own mesh (FSDP, CP, TP and PP inside it); when a worker dies the other replicas keep stepping,
    Ray Train replaces its whole replica and the replacement receives the live state from a peer (no
    restart, no reload). Needs dp_replicate >= 2, explicit degrees (no parallel.auto) and ray.num_workers =
    dp_replicate x dp_shard x cp x tp x pp."""


@dataclass(frozen=True)
class RayConfig:
    num_workers: int = 2
    """Workers for a fixed-size run (one per device)."""
    address: str = ""
    """Cluster to join; empty: RAY_ADDRESS if set, else an embedded local Ray."""
    cpus_per_worker: float = 1.0
    """Logical CPUs each worker reserves (and torch threads it uses on CPU)."""
    use_gpu: str = "auto"
    """`auto` (GPUs when the cluster has them), `true`, `false`."""
    max_pending_s: float = 60.0
    """How long to wait for the cluster to offer the workers' resources before failing."""


@dataclass(frozen=True)
class KernelsConfig:
    attention: str = "auto"
    """`auto` (Triton on CUDA, sdpa on CPU), `triton`, `sdpa`, `eager`."""
    matmul: str = "auto"
    """`auto` (Triton on CUDA, torch on CPU), `triton`, `torch`."""


@dataclass(frozen=True)
class PeftConfig:
    method: str = "none"
    """Parameter-efficient fine-tuning: `none` (train everything), `lora` (low-rank adapters on frozen
    weights; Hu et al., 2021), `freeze` (train only the last `trainable_last_layers` blocks)."""
    lora_rank: int = 8
    """LoRA rank r: each adapted weight W (out x in) gains B (out x r) A (r x in)."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: the update is (lora_alpha / lora_rank) B A x."""
    lora_targets: str = "attention"
    """Which projections get adapters: `attention` (wq, wk, wv, wo), `mlp` (w1, w2, w3), `all`."""
    trainable_last_layers: int = 1
    """For `freeze`: the last this many blocks (and the final norm; the head too when untied) train."""


@dataclass(frozen=True)
class MonitorConfig:
    heartbeat_interval_s: float = 2.0
    """How often each worker publishes what it is doing (its current collective or pipeline action, and
    since when) to the process group's store, for hang diagnosis."""
    hang_stacks: bool = True
    """On a hang (a collective timeout or the step watchdog), write every live rank's Python stack with
    py-spy (Python's own traceback where py-spy cannot attach) to RUN_DIR/logs/hang-<time>-rank<r>/."""
    straggler_factor: float = 1.5
    """A rank whose busy time per step (data wait + forward) is at least this many times the median rank's
    for straggler_intervals logged intervals in a row gets a `straggler` event (0: never)."""
    straggler_intervals: int = 3
    """Consecutive logged intervals a rank must be that slow before the `straggler` event."""


@dataclass(frozen=True)
class TrackingConfig:
    mlflow_uri: str = ""
    """MLflow tracking URI (http://host:5000, a file store path, databricks, ...): the driver logs the run's
    params, metrics and events there. Empty: no MLflow (TensorBoard files are written either way)."""
    mlflow_experiment: str = "raydist"
    """MLflow experiment the run is logged in (created when missing)."""
