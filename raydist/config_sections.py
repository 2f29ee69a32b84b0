"""The configuration's sections, one frozen dataclass per TOML table: what is trained (model, data,
parallel, train) and how the run is kept (checkpoints, elasticity, Ray, kernels, fine-tuning, monitoring,
tracking); the choices a string key allows, and the table name of each section.

Each field carries a docstring (the string literal under it); `raydist.config_io.field_docs` reads them
back from this source so that the README's reference and error hints never drift from the code."""

from __future__ import annotations

from dataclasses import dataclass

from raydist.families.registry import FAMILY_NAMES
from raydist.schedule.registry import DEFAULT_KIND, KINDS


@dataclass(frozen=True)
class ModelConfig:
    family: str = "llama"
    """The decoder family (raydist.families.registry): `llama`, `mistral` (Llama's blocks), `qwen2` (Qwen2 and
    Qwen2.5: biases on q, k, v), `qwen3` (RMSNorm on each head of q and k, no biases), or the mixture-of-experts
    `qwen3_moe` and `mixtral` (model.moe_experts > 0). Read from
    config.json's model_type under `init_from = "hf:DIR"`."""
    num_layers: int = 4
    """Transformer blocks."""
    d_model: int = 128
    """Width of the residual stream."""
    num_heads: int = 4
    """Attention (query) heads; d_model must be divisible by it unless model.head_dim is set."""
    num_kv_heads: int = 2
    """Key/value heads for grouped-query attention; num_heads must be divisible by it."""
    head_dim: int = 0
    """Coordinates per attention head; 0: d_model / num_heads (Llama). Qwen3 sets it apart (0.6B: 1024
    wide, 16 heads of 128); the q projection is then d_model x num_heads * head_dim."""
    ffn_hidden: int = 352
    """Hidden width of the SwiGLU MLP (Llama uses about 8/3 * d_model, rounded)."""
    vocab_size: int = 320
    """Embedding rows; at least the tokenizer's vocabulary (byte-level: 257). Padding to a multiple of
    64 keeps tensor-parallel splits even."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = True
    """Share the input embedding with the output head."""
    init_std: float = 0.02
    """Standard deviation of the normal weight init (output projections are scaled by 1/sqrt(2*layers))."""
    moe_experts: int = 0
    """Routed experts in each block's mixture-of-experts feed-forward (raydist.models.moe); 0: the dense SwiGLU
    MLP. Qwen3-MoE and Mixtral (`family = "qwen3_moe"`, `"mixtral"`) are MoE models; `llama` blocks can be
    made one too (raydist's own, not exported to Hugging Face)."""
    moe_top_k: int = 2
    """Experts each token is routed to (the router's top k of its softmax)."""
    moe_ffn_hidden: int = 0
    """Hidden width of each expert's SwiGLU MLP; 0: model.ffn_hidden (Qwen3-MoE's moe_intermediate_size)."""
    moe_norm_topk: bool = True
    """Rescale a token's k routing weights to sum to 1 (Mixtral always; Qwen3-MoE's norm_topk_prob)."""
    moe_shared_ffn_hidden: int = 0
    """Hidden width of a shared expert every token goes through besides its routed ones (DeepSeekMoE's
    shared experts); 0: none."""
    moe_aux_coef: float = 0.001
    """Weight of the load-balancing loss (raydist.models.moe: sequence-wise, the same value in every layout)
    added to the training loss; 0: off. Its value is in the metrics as `moe_aux`."""
    init_from: str = ""
    """Start from pretrained weights: `hf:DIR`, a Hugging Face directory of a model.family (config.json and
    *.safetensors). The shape keys above are then read from its config.json (one set here must agree);
    each rank reads only its shards. Resuming from a run's own checkpoint wins over it."""

    @property
    def head_size(self) -> int:
        """Coordinates per attention head: head_dim, or d_model / num_heads when it is 0."""
        return self.head_dim or self.d_model // self.num_heads

    @property
    def expert_hidden(self) -> int:
        """Hidden width of one routed expert: moe_ffn_hidden, or ffn_hidden when it is 0."""
        return self.moe_ffn_hidden or self.ffn_hidden

    @property
    def q_width(self) -> int:
        """Outputs of the q projection (and inputs of o): num_heads x head_size (d_model for Llama)."""
        return self.num_heads * self.head_size


@dataclass(frozen=True)
class DataConfig:
    path: str = ""
    """Prepared shards (a directory or fsspec URI holding manifest.json). Empty: the default corpus,
    prepared on first use under ~/.cache/raydist/data/<corpus-name>-<seq_len>."""
    corpus: str = "stdlib"
    """What `raydist data prepare` reads: `stdlib` (the Python standard library's source that ships with
    the interpreter), a glob or fsspec URI of text files, or parquet files with a text column."""
    text_column: str = "text"
    """Column holding the documents when the corpus is parquet."""
    tokenizer: str = "byte"
    """`byte` (bytes 0-255 plus end-of-document 256), the path of a `tokenizers` JSON file, or `hf:DIR`:
    a Hugging Face model directory's tokenizer.json (to fine-tune that model on the prepared data)."""
    seq_len: int = 128
    """Tokens per training sample (each stored row holds seq_len + 1 tokens: inputs and shifted targets)."""
    val_fraction: float = 0.02
    """Share of documents held out for validation (chosen by a hash of the document's name)."""
    shard_rows: int = 4096
    """Samples per parquet shard (a multiple of data.row_group_rows)."""
    row_group_rows: int = 8
    """Samples per parquet row group: the unit a data-parallel rank reads, and the block of rows the sample
    order keeps together. Each rank reads only its own rows when this divides its slice of a batch
    (train.global_batch / dp); larger row groups read fewer, bigger pieces. `raydist data prepare` drops a
    split's last rows short of a whole row group."""
    max_corpus_mb: float = 0.0
    """Stop reading the corpus after this many megabytes (0: read all of it)."""
    reader: str = "auto"
    """How workers read shards: `ray` (Ray Data), `arrow` (pyarrow through fsspec in a background thread),
    `auto` (the faster as measured by benchmarks/data_throughput.py: pyarrow, on local files and on S3)."""
    prefetch_shards: int = 2
    """Shards read ahead of the one being consumed."""


@dataclass(frozen=True)
class ParallelConfig:
    auto: bool = False
    """Let the planner choose the layout (degrees, micro-batch, recompute, ...) for the live worker count by
    its cost model; the degrees below are then ignored. `parallel = "auto"` in TOML says the same."""
    dp_replicate: int = -1
    """Data-parallel replicas (DDP, or the replicate dim of HSDP). -1: fill from the world size."""
    dp_shard: int = 1
    """Fully-sharded (FSDP/ZeRO-3) degree; HSDP when dp_replicate > 1 too. -1: fill from the world size."""
    tp: int = 1
    """Tensor-parallel degree (innermost mesh axis, kept inside a node)."""
    pp: int = 1
    """Pipeline-parallel stages (outermost mesh axis)."""
    cp: int = 1
    """Context-parallel degree: the sequence is split across this many ranks."""
    ep: int = 1
    """Expert-parallel degree (a mixture of experts): each expert lives on one of ep ranks, which receive the
    tokens routed to it by all-to-all. The ep ranks are data-parallel ranks: ep divides dp_shard (after -1 is
    filled) and model.moe_experts; FSDP shards each expert over the remaining dp_shard / ep x cp ranks."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism for norms and the residual stream (needs tp > 1)."""
    cp_impl: str = "ring"
    """Context-parallel attention: `ring` (K/V passed around a ring) or `ulysses` (all-to-all to heads)."""
    pp_schedule: str = DEFAULT_KIND
    """Pipeline schedule: `gpipe`, `1f1b`, `interleaved`, or the zero-bubble `zbh1` (1F1B's memory, the
    backward split into input and weight gradients) and `zbv` (two chunks per rank in a V); both need
    num_microbatches >= pp."""
    num_microbatches: int = 0
    """Micro-batches per step in the pipeline (0: one per micro_batch of the per-rank batch)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B needs >= 2; zbv always uses 2)."""
    fsdp_reshard_after_forward: str = "auto"
    """FSDP: free the gathered parameters after forward (ZeRO-3, `true`) or keep them for backward (`false`);
    `auto`: `true`, but `false` under a pipeline, whose chunks then stay gathered from their first forward to
    their last backward of the step (one all-gather per chunk and step, not two per micro-batch)."""
    fsdp_forward_prefetch: bool = True
    """FSDP: all-gather the next block's parameters while the current block computes."""


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    """Optimizer steps."""
    global_batch: int = 16
    """Samples per optimizer step across all data-parallel ranks (kept fixed when the dp size changes)."""
    micro_batch: int = 0
    """Samples per forward/backward on one rank; gradient accumulation = global_batch / (dp * micro_batch).
    0: derived for the layout (the largest divisor of the per-rank batch up to 8; with a pipeline, one that
    gives at least pp micro-batches). In an elastic run and under parallel.auto it is an upper bound (the
    planner picks at most it); with a pipeline and parallel.num_microbatches set, the pipeline decides it."""
    seed: int = 0
    """Seed for the weights, the data order and dropout-free RNG state."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """Cosine decay floor as a fraction of lr."""
    warmup_steps: int = 20
    """Linear warmup steps."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to norms and biases)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    eval_every: int = 50
    """Validation every this many steps, and before the first step (0: never)."""
    eval_batches: int = 4
    """Validation batches of global_batch samples each."""
    log_every: int = 10
    """Write a metrics.jsonl line every this many steps."""
    run_name: str = ""
    """Run directory name under checkpoint.storage; empty: generated. Re-running a name resumes it."""
    activation_checkpoint: str = "none"
    """Activation recomputation: `none`, `full`, `every_k`, `selective`."""
    activation_checkpoint_k: int = 0
    """For `every_k`: checkpoint every k-th block (0: round(sqrt(num_layers)), the sqrt(n) rule)."""
    dtype: str = "auto"
    """Compute precision: `auto` (bf16 autocast on CUDA, fp32 on CPU), `fp32`, `bf16`."""
    deterministic: bool = False
    """`torch.use_deterministic_algorithms(True)` in every worker: an op without a deterministic
    implementation raises instead of running (slower on CUDA; CPU runs here are deterministic already)."""


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
    watchdog). After warm-up the step phase's limits are derived from measured steps (timeout_factor) and
    this is their ceiling."""
    timeout_factor: float = 3.0
    """k of the limits derived from measured steps (raydist.elastic.hang.timeouts): after
    timeout_warmup_steps steps of an attempt, a collective on the training groups may wait k times the longest
    step of the recent window (every rank's, gathered at each logged step), never less than timeout_floor_s nor
    more than collective_timeout_s, and the step watchdog allows twice that (the same where a group's timeout
    cannot be changed: the watchdog then enforces it). A stopped rank is found within a few of its steps; a
    slow one is inside every rank's measurement (every step waits for it) and gets a `straggler` event; one
    that becomes more than k times slower between two logged steps is taken for a stopped one. Evaluations,
    saves and the step after them keep the fixed limits. With live recovery the all-reduce between replicas
    gets the derived limit too (a replica stopped mid-step costs the others that, then torchft drops it), and
    torchft's quorum at each step's start runs under the fixed limits, as does the rest of a step whose quorum
    changed (a replica lost or joined). The values are in each metrics record (`timeouts`) and a `timeouts`
    event when they change. 0: the fixed collective_timeout_s throughout."""
    timeout_floor_s: float = 30.0
    """The shortest derived collective timeout (seconds): short steps do not make a pause of a few seconds
    (a garbage collection, a slow read, the host's other load) a hang."""
    timeout_warmup_steps: int = 20
    """Steps of each attempt that are not measured for the derived timeouts (the first ones compile, fill
    caches and wait for the data); until the first logged step after them, collective_timeout_s applies."""
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
    sync: str = "every_step"
    """How live recovery's replicas meet: `every_step` (their gradients are summed every step: one
    synchronous run), `diloco` (each replica takes sync_every steps with its own AdamW on its share of each
    global batch, then the replicas average how far they moved and an outer Nesterov SGD step moves the
    shared parameters: DiLoCo, Douillard et al., 2023; sync_every times fewer bytes between replicas) or
    `local_sgd` (the same, the replicas' parameters averaged instead: Stich, 2019). Needs live_recovery."""
    sync_every: int = 10
    """Steps between the replicas' synchronisations under sync = diloco or local_sgd (H), and at the run's
    last step; it divides checkpoint.every_steps (a checkpoint holds synchronised replicas)."""
    outer_lr: float = 0.7
    """DiLoCo's outer learning rate (the paper's 0.7)."""
    outer_momentum: float = 0.5
    """DiLoCo's outer Nesterov momentum. The paper's 0.9 suits windows of hundreds of steps; at H = 8 on the
    default workload 0.5 ended 3.7% above every-step training's validation loss and 0.9 11.1%
    (benchmarks/diloco.py)."""


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
    replica_labels: str = ""
    """Live recovery: where each replica's workers run, by node label, one Ray label selector per replica
    separated by `;` (e.g. "zone=us-east-1a; zone=us-east-1b": replica r's workers only on nodes labelled
    zone=us-east-1a for r = 0, ...; `key=value` pairs joined by `,`, values in Ray's selector syntax such as
    `!a` or `in(a,b)`). Empty: anywhere the cluster has room. With elastic.sync = diloco, replicas placed
    behind a slow link exchange only their outer gradient every sync_every steps."""


@dataclass(frozen=True)
class KernelsConfig:
    attention: str = "auto"
    """`auto` (on CUDA the faster of the Triton kernel and sdpa, timed at the run's shape when the model
    is built, cached per device; sdpa on the CPU), `triton`, `sdpa`, `eager`."""
    matmul: str = "auto"
    """`auto` (on CUDA the faster of the Triton matmul and cuBLAS at each linear's shape, timed as
    attention's; torch on the CPU), `triton`, `torch`."""
    loss: str = "auto"
    """`auto`: the head's matmul and the cross-entropy run together, a chunk of tokens at a time, never
    holding the whole (B, T, V) logits or their gradient (one more head matmul in backward), in every
    layout (vocabulary-parallel under tensor parallelism). `triton`: the same, each chunk's elementwise
    work in Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1). `plain`: the logits, then the loss."""


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
    """Which projections get adapters: `attention` (q, k, v, o projections), `mlp` (gate, up, down), `all`."""
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
    wandb_project: str = ""
    """Weights & Biases project: the driver logs the run's config, metrics and events to a W&B run named
    after train.run_name (a rerun of the name resumes it). Needs `pip install wandb` and, online, `wandb
    login` or WANDB_API_KEY on the driver. Empty: no W&B."""
    wandb_entity: str = ""
    """W&B entity (user or team) the project belongs to. Empty: the API key's default entity."""
    wandb_mode: str = "online"
    """online: logged to the W&B server as the run goes; offline: written under RUN_DIR/wandb/ (WANDB_DIR
    when set) for a later `wandb sync`, no network needed."""


CHOICES: dict[str, tuple[str, ...]] = {
    "model.family": FAMILY_NAMES,  # the model registry's families
    "peft.method": ("none", "lora", "freeze"),
    "peft.lora_targets": ("attention", "mlp", "all"),
    "data.reader": ("auto", "ray", "arrow"),
    "parallel.cp_impl": ("ring", "ulysses"),
    "parallel.pp_schedule": KINDS,  # the schedule registry's kinds
    "train.activation_checkpoint": ("none", "full", "every_k", "selective"),
    "train.dtype": ("auto", "fp32", "bf16"),
    "ray.use_gpu": ("auto", "true", "false"),
    "parallel.fsdp_reshard_after_forward": ("auto", "true", "false"),
    "kernels.attention": ("auto", "triton", "sdpa", "eager"),
    "kernels.matmul": ("auto", "triton", "torch"),
    "kernels.loss": ("auto", "triton", "plain"),
    "tracking.wandb_mode": ("online", "offline"),
    "elastic.sync": ("every_step", "diloco", "local_sgd"),
}

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "elastic": ElasticConfig,
    "ray": RayConfig,
    "kernels": KernelsConfig,
    "peft": PeftConfig,
    "monitor": MonitorConfig,
    "tracking": TrackingConfig,
}
