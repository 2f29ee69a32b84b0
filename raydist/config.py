"""Run configuration: one dataclass per TOML section, `--set section.key=value` overrides, validation.

A config is loaded from TOML (`Config.load(path, overrides)`), every value is type-checked against the
field's annotation, unknown sections or keys are errors, and `validate()` checks the relations between
fields. Every error is a `ConfigError` whose message names the offending value and the fix, so the CLI
can print it as a single `error:` line before any worker starts.

Each field carries a docstring (the string literal under it); `field_docs()` (config_io.py) reads them back
from the source (this file and config_sections.py) so that the README's reference and error hints never
drift from the code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raydist.errors import ConfigError


DEFAULT_WORKLOAD = "gpt_tiny.toml"


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int = 4
    """Transformer blocks."""
    d_model: int = 128
    """Width of the residual stream."""
    num_heads: int = 4
    """Attention (query) heads; d_model must be divisible by it."""
    num_kv_heads: int = 2
    """Key/value heads for grouped-query attention; num_heads must be divisible by it."""
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
    init_from: str = ""
    """Start from pretrained weights: `hf:DIR`, a Hugging Face Llama directory (config.json and
    *.safetensors). The shape keys above are then read from its config.json (one set here must agree);
    each rank reads only its shards. Resuming from a run's own checkpoint wins over it."""


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
    sequence_parallel: bool = False
    """Megatron sequence parallelism for norms and the residual stream (needs tp > 1)."""
    cp_impl: str = "ring"
    """Context-parallel attention: `ring` (K/V passed around a ring) or `ulysses` (all-to-all to heads)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: `gpipe`, `1f1b`, `interleaved`, or the zero-bubble `zbh1` (1F1B's memory, the
    backward split into input and weight gradients) and `zbv` (two chunks per rank in a V); both need
    num_microbatches >= pp."""
    num_microbatches: int = 0
    """Micro-batches per step in the pipeline (0: one per micro_batch of the per-rank batch)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B needs >= 2; zbv always uses 2)."""
    fsdp_reshard_after_forward: bool = True
    """FSDP: free the gathered parameters after forward (ZeRO-3) rather than keep them for backward."""
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
    gives at least pp micro-batches). In an elastic run it is an upper bound."""
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


# the run-level sections (checkpoints, elasticity, Ray, kernels, fine-tuning, monitoring, tracking)
from raydist.config_sections import (CheckpointConfig, ElasticConfig, KernelsConfig, MonitorConfig,  # noqa: E402
                                     PeftConfig, RayConfig, TrackingConfig)


CHOICES: dict[str, tuple[str, ...]] = {
    "peft.method": ("none", "lora", "freeze"),
    "peft.lora_targets": ("attention", "mlp", "all"),
    "data.reader": ("auto", "ray", "arrow"),
    "parallel.cp_impl": ("ring", "ulysses"),
    "parallel.pp_schedule": ("gpipe", "1f1b", "interleaved", "zbh1", "zbv"),
    "train.activation_checkpoint": ("none", "full", "every_k", "selective"),
    "train.dtype": ("auto", "fp32", "bf16"),
    "ray.use_gpu": ("auto", "true", "false"),
    "kernels.attention": ("auto", "triton", "sdpa", "eager"),
    "kernels.matmul": ("auto", "triton", "torch"),
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


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> "Config":
        raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
        if raw.get("parallel") == "auto":  # `parallel = "auto"`: the planner picks the layout
            raw["parallel"] = {"auto": True}
        for item in overrides:
            section, key, value = parse_override(item)
            raw.setdefault(section, {})[key] = value
        if isinstance(raw.get("model"), dict) and raw["model"].get("init_from"):
            raw["model"] = _model_from_init(raw["model"])
        sections = {}
        for name, value in raw.items():
            if name not in SECTIONS:
                raise ConfigError(f"unknown section [{name}]; valid sections: {', '.join(SECTIONS)}")
            if not isinstance(value, dict):
                raise ConfigError(f"{name} must be a table ([{name}] with keys), got {value!r}")
            sections[name] = _build_section(name, value)
        cfg = cls(**sections)
        cfg.validate()
        return cfg

    @classmethod
    def load(cls, path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> "Config":
        return cls.from_dict(read_toml(path) if path else {}, overrides)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def to_toml(self) -> str:
        return dump_toml(self.to_dict())

    # ---- validation of relations between fields ------------------------------------------------
    def validate(self) -> None:
        m, t, p, d = self.model, self.train, self.parallel, self.data
        for key in ("num_layers", "d_model", "num_heads", "num_kv_heads", "ffn_hidden", "vocab_size"):
            _positive(f"model.{key}", getattr(m, key))
        for key in ("steps", "global_batch"):
            _positive(f"train.{key}", getattr(t, key))
        if t.micro_batch < 0:
            raise ConfigError(f"train.micro_batch={t.micro_batch} must be >= 0 (0: derived for the layout)")
        _positive("data.seq_len", d.seq_len)
        _positive("data.shard_rows", d.shard_rows)
        _positive("data.row_group_rows", d.row_group_rows)
        if d.shard_rows % d.row_group_rows:
            raise ConfigError(f"data.shard_rows={d.shard_rows} is not a multiple of data.row_group_rows="
                              f"{d.row_group_rows}; set data.shard_rows="
                              f"{max(1, d.shard_rows // d.row_group_rows) * d.row_group_rows}")
        _positive("checkpoint.keep", self.checkpoint.keep)
        _positive("parallel.virtual_stages", p.virtual_stages)
        for key in ("lr", "rope_theta"):
            obj = t if key == "lr" else m
            if not getattr(obj, key) > 0:
                section = "train" if key == "lr" else "model"
                raise ConfigError(f"{section}.{key}={getattr(obj, key)} must be > 0")
        for key in ("eval_every", "eval_batches", "log_every", "warmup_steps", "activation_checkpoint_k"):
            if getattr(t, key) < 0:
                raise ConfigError(f"train.{key}={getattr(t, key)} must be >= 0")
        if t.log_every == 0:
            raise ConfigError("train.log_every=0 must be >= 1")
        if t.eval_every > 0 and t.eval_batches == 0:
            raise ConfigError("train.eval_batches=0 must be >= 1 when train.eval_every > 0; set train.eval_batches "
                              f">= 1, or train.eval_every=0 to skip validation (it is {t.eval_every})")
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(t, key) < 1.0:
                raise ConfigError(f"train.{key}={getattr(t, key)} must be in [0, 1) (AdamW's moment decay; "
                                  f"the default is {getattr(TrainConfig, key)})")
        if not t.weight_decay >= 0:
            raise ConfigError(f"train.weight_decay={t.weight_decay} must be >= 0 (0: no decay; the default is "
                              f"{TrainConfig.weight_decay})")
        if self.checkpoint.every_steps < 0:
            raise ConfigError(f"checkpoint.every_steps={self.checkpoint.every_steps} must be >= 0 (0: only at the end)")
        if not 0.0 <= d.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={d.val_fraction} must be in [0, 1)")
        if not 0.0 <= t.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
        if t.grad_clip < 0:
            raise ConfigError(f"train.grad_clip={t.grad_clip} must be >= 0 (0 disables clipping)")
        if m.d_model % m.num_heads:
            raise ConfigError(f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}; "
                              f"pick num_heads from {divisors(m.d_model)}")
        if m.num_heads % m.num_kv_heads:
            raise ConfigError(f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads={m.num_kv_heads}; "
                              f"pick num_kv_heads from {divisors(m.num_heads)}")
        if (m.d_model // m.num_heads) % 2:
            raise ConfigError(f"head dim d_model/num_heads={m.d_model // m.num_heads} must be even for RoPE; "
                              "change model.d_model or model.num_heads")
        if t.micro_batch and t.global_batch % t.micro_batch:
            raise ConfigError(f"train.global_batch={t.global_batch} is not divisible by train.micro_batch={t.micro_batch}")
        degrees = {k: getattr(p, k) for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
        for key, value in degrees.items():
            if value == 0 or value < -1:
                raise ConfigError(f"parallel.{key}={value} must be a positive degree or -1 (fill from the world size)")
        filled = [k for k, v in degrees.items() if v == -1]
        if len(filled) > 1:
            raise ConfigError(f"only one parallel degree may be -1, got {', '.join('parallel.' + k for k in filled)}; "
                              "set all but one explicitly")
        if p.sequence_parallel and p.tp == 1:
            raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1; set tp or turn sequence_parallel off")
        if p.num_microbatches < 0:
            raise ConfigError(f"parallel.num_microbatches={p.num_microbatches} must be >= 0 (0: automatic)")
        pe = self.peft
        if pe.method == "lora" and not (pe.lora_rank > 0 and pe.lora_alpha > 0):
            raise ConfigError(f"peft.lora_rank={pe.lora_rank} and peft.lora_alpha={pe.lora_alpha} must be > 0")
        if pe.method == "freeze" and not 0 < pe.trainable_last_layers <= m.num_layers:
            raise ConfigError(f"peft.trainable_last_layers={pe.trainable_last_layers} must be in 1..model.num_layers="
                              f"{m.num_layers} for peft.method='freeze'")
        e = self.elastic
        if e.min_workers < 0 or e.max_workers < 0:
            raise ConfigError("elastic.min_workers and elastic.max_workers must be >= 0")
        if (e.min_workers == 0) != (e.max_workers == 0):
            raise ConfigError(f"elastic.min_workers={e.min_workers} and elastic.max_workers={e.max_workers}: "
                              "set both (an elastic run) or neither (a fixed-size run of ray.num_workers)")
        if e.min_workers > e.max_workers:
            raise ConfigError(f"elastic.min_workers={e.min_workers} exceeds elastic.max_workers={e.max_workers}")
        _positive("ray.num_workers", self.ray.num_workers)
        if not self.ray.cpus_per_worker > 0:
            raise ConfigError(f"ray.cpus_per_worker={self.ray.cpus_per_worker} must be > 0")
        mon = self.monitor
        if not mon.heartbeat_interval_s > 0:
            raise ConfigError(f"monitor.heartbeat_interval_s={mon.heartbeat_interval_s} must be > 0 (seconds)")
        if mon.straggler_factor != 0 and not mon.straggler_factor > 1:
            raise ConfigError(f"monitor.straggler_factor={mon.straggler_factor} must be > 1 (how many times the "
                              "median rank's busy time), or 0 to turn straggler events off")
        _positive("monitor.straggler_intervals", mon.straggler_intervals)
        for key in ("collective_timeout_s", "startup_timeout_s", "checkpoint_timeout_s", "group_start_timeout_s"):
            if not getattr(e, key) > 0:
                raise ConfigError(f"elastic.{key}={getattr(e, key)} must be > 0 (seconds)")
        if e.live_recovery:
            self._validate_live_recovery()

    def _validate_live_recovery(self) -> None:
        """Live recovery runs replicas of dp_shard x cp x tp x pp workers each, every replica its own mesh (FSDP,
        CP, TP and PP inside it): Ray Train replaces a failed replica group whole (raydist.elastic.replica_groups),
        and a replica's share of each step is cut equally over its dp_shard ranks. A replica's degrees are
        fixed: no planner (parallel.auto), none filled from the world size (-1)."""
        p = self.parallel
        if p.auto:
            raise ConfigError("elastic.live_recovery=true with parallel.auto=true: a live replica's mesh is fixed; set "
                              "parallel.auto=false with dp_shard, tp, cp and pp for one replica, or "
                              "elastic.live_recovery=false")
        for key in ("dp_shard", "cp", "tp", "pp"):
            value = getattr(p, key)
            if value < 1:
                raise ConfigError(f"elastic.live_recovery=true needs an explicit parallel.{key} (got {value}): a "
                                  f"degree of one replica's mesh; set parallel.{key} >= 1")
        if p.dp_replicate < 2:
            raise ConfigError(f"elastic.live_recovery=true needs parallel.dp_replicate >= 2 replicas (got "
                              f"{p.dp_replicate}); set parallel.dp_replicate to the replica count")
        if self.elastic_enabled:
            raise ConfigError(f"elastic.live_recovery=true with elastic.max_workers={self.elastic.max_workers}: live "
                              "recovery keeps a fixed replica count; set elastic.min_workers=0 and max_workers=0")
        per_replica = p.dp_shard * p.cp * p.tp * p.pp
        if self.ray.num_workers != p.dp_replicate * per_replica:
            raise ConfigError(f"elastic.live_recovery=true needs dp_replicate x (dp_shard x cp x tp x pp) workers: "
                              f"ray.num_workers={self.ray.num_workers} but parallel.dp_replicate={p.dp_replicate} x "
                              f"({p.dp_shard} x {p.cp} x {p.tp} x {p.pp}) = {p.dp_replicate * per_replica}; set "
                              f"ray.num_workers={p.dp_replicate * per_replica}")

    @property
    def elastic_enabled(self) -> bool:
        return self.elastic.max_workers > 0

    @property
    def head_dim(self) -> int:
        return self.model.d_model // self.model.num_heads


# ---- helpers ---------------------------------------------------------------------------------------


def _positive(name: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{name}={value} must be a positive integer")


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


# TOML reading and writing, `--set` parsing, field docs (re-exported: callers import them from here)
from raydist.config_io import (_build_section, _model_from_init, dump_toml, field_docs, hf_dir_of,  # noqa: E402,F401
                               parse_override, read_toml, reference_markdown)


if __name__ == "__main__":  # regenerates the README's reference: python -m raydist.config
    print(reference_markdown())
