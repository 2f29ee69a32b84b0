"""Run configuration: one frozen dataclass per TOML section, `--set section.key=value` overrides, validation.

`Config` holds one frozen section per TOML table (raydist.config_sections: each field with its docstring, the
choices a string key allows), is loaded from TOML with `--set` overrides (`Config.load`; raydist.config_io
reads and writes TOML, type-checks values, fills [model] from `model.init_from = "hf:DIR"`'s config.json),
and `validate()` checks the relations between fields. Every error is a `ConfigError` whose message names
the offending value and the fix, so the CLI can print it as a single `error:` line before any worker
starts. Callers import all of it from here; `python -m raydist.config` prints the README's reference.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raydist.config_io import (build_section, dump_toml, field_docs, hf_dir_of, model_from_init, parse_override,
                               read_toml, reference_markdown)
from raydist.config_sections import (CHOICES, SECTIONS, CheckpointConfig, DataConfig, ElasticConfig, KernelsConfig,
                                     ModelConfig, MonitorConfig, ParallelConfig, PeftConfig, RayConfig, TrackingConfig,
                                     TrainConfig)
from raydist.errors import ConfigError
from raydist.schedule.batch import divisors
from raydist.store.run_store import join

__all__ = ["CHOICES", "DEFAULT_WORKLOAD", "RUN_FACTS", "SECTIONS", "CheckpointConfig", "Config", "ConfigError",
           "DataConfig", "ElasticConfig", "KernelsConfig", "ModelConfig", "MonitorConfig", "ParallelConfig", "PeftConfig",
           "RayConfig", "RunFacts", "TrackingConfig", "TrainConfig", "dump_toml", "field_docs", "hf_dir_of",
           "parse_override", "read_toml", "reference_markdown"]

DEFAULT_WORKLOAD = "gpt_tiny.toml"


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
            raw["model"] = model_from_init(raw["model"])
        sections = {}
        for name, value in raw.items():
            if name not in SECTIONS:
                raise ConfigError(f"unknown section [{name}]; valid sections: {', '.join(SECTIONS)}")
            if not isinstance(value, dict):
                raise ConfigError(f"{name} must be a table ([{name}] with keys), got {value!r}")
            sections[name] = build_section(name, value)
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
    def _validate_moe(self) -> None:
        m = self.model
        from raydist.families.registry import family_of

        for key in ("moe_experts", "moe_ffn_hidden", "moe_shared_ffn_hidden"):
            if getattr(m, key) < 0:
                raise ConfigError(f"model.{key}={getattr(m, key)} must be >= 0")
        if not m.moe_aux_coef >= 0:
            raise ConfigError(f"model.moe_aux_coef={m.moe_aux_coef} must be >= 0 (0: no load-balancing loss)")
        if family_of(m).moe and not m.moe_experts:
            raise ConfigError(f"model.family={m.family!r} is a mixture of experts; set model.moe_experts (e.g. 8) "
                              "and model.moe_top_k, or use init_from = \"hf:DIR\" to read them")
        if m.moe_experts and not 1 <= m.moe_top_k <= m.moe_experts:
            raise ConfigError(f"model.moe_top_k={m.moe_top_k} must be in 1..model.moe_experts={m.moe_experts}")
        if m.moe_experts and self.peft.method == "lora" and self.peft.lora_targets != "attention":
            raise ConfigError(f"peft.lora_targets={self.peft.lora_targets!r} with model.moe_experts={m.moe_experts}: "
                              "LoRA on experts is not built yet; set peft.lora_targets = \"attention\"")
        p = self.parallel
        if p.ep < 1:
            raise ConfigError(f"parallel.ep={p.ep} must be a positive degree (1: no expert parallelism)")
        if p.ep > 1 and not m.moe_experts:
            raise ConfigError(f"parallel.ep={p.ep} needs a mixture of experts (model.moe_experts); set parallel.ep = 1")
        if p.ep > 1 and m.moe_experts % p.ep:
            raise ConfigError(f"parallel.ep={p.ep} does not divide model.moe_experts={m.moe_experts}; pick ep from "
                              f"{divisors(m.moe_experts)}")
        if m.moe_experts and not family_of(m).moe and m.family not in ("llama",):
            raise ConfigError(f"model.moe_experts={m.moe_experts} with model.family={m.family!r}: a dense family; "
                              "use family 'mixtral' or 'qwen3_moe' (or 'llama' for raydist's own MoE)")

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
        self._validate_moe()
        if m.head_dim < 0:
            raise ConfigError(f"model.head_dim={m.head_dim} must be >= 0 (0: d_model / num_heads)")
        if not m.head_dim and m.d_model % m.num_heads:
            raise ConfigError(f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}; "
                              f"pick num_heads from {divisors(m.d_model)}, or set model.head_dim")
        if m.num_heads % m.num_kv_heads:
            raise ConfigError(f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads={m.num_kv_heads}; "
                              f"pick num_kv_heads from {divisors(m.num_heads)}")
        if m.head_size % 2:
            raise ConfigError(f"head dim {m.head_size} (model.head_dim, or d_model/num_heads) must be even for "
                              "RoPE; change model.head_dim, model.d_model or model.num_heads")
        # train.micro_batch is exact only where the layout policy uses it as given: a fixed-size run without a
        # pipeline's parallel.num_microbatches. An elastic run takes it as an upper bound (raydist.planner.policy)
        if t.micro_batch and t.global_batch % t.micro_batch and self.micro_batch_is_exact:
            raise ConfigError(f"train.global_batch={t.global_batch} is not divisible by train.micro_batch="
                              f"{t.micro_batch}; pick a divisor of it, or 0 to derive one")
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
        if e.timeout_factor != 0 and not e.timeout_factor > 1:
            raise ConfigError(f"elastic.timeout_factor={e.timeout_factor} must be > 1 (how many times the longest "
                              "measured step a collective may wait), or 0 for the fixed elastic.collective_timeout_s")
        _positive("elastic.timeout_warmup_steps", e.timeout_warmup_steps)
        for key in ("collective_timeout_s", "timeout_floor_s", "startup_timeout_s", "checkpoint_timeout_s",
                    "group_start_timeout_s"):
            if not getattr(e, key) > 0:
                raise ConfigError(f"elastic.{key}={getattr(e, key)} must be > 0 (seconds)")
        if e.live_recovery:
            self._validate_live_recovery()
        self._validate_sync()

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

    def replica_label_selectors(self) -> list[dict[str, str]]:
        """ray.replica_labels as one Ray label selector per replica ([] when empty)."""
        text = self.ray.replica_labels.strip()
        if not text:
            return []
        selectors = []
        for entry in text.split(";"):
            pairs, depth, current = [], 0, ""
            for ch in entry + ",":  # split on commas outside in(...) / !in(...)
                depth += ch == "("
                depth -= ch == ")"
                if ch == "," and depth == 0:
                    pairs.append(current.strip())
                    current = ""
                else:
                    current += ch
            selector = {}
            for pair in pairs:
                key, eq, value = pair.partition("=")
                if not eq or not key.strip() or not value.strip():
                    raise ConfigError(f"ray.replica_labels={self.ray.replica_labels!r}: {pair!r} is not key=value; "
                                      "write one selector per replica, e.g. 'zone=us-east-1a; zone=us-east-1b'")
                selector[key.strip()] = value.strip()
            selectors.append(selector)
        return selectors

    def _validate_sync(self) -> None:
        e = self.elastic
        labels = self.replica_label_selectors()
        if labels and not e.live_recovery:
            raise ConfigError(f"ray.replica_labels={self.ray.replica_labels!r} places live recovery's replicas: set "
                              "elastic.live_recovery=true, or ray.replica_labels=''")
        if labels and len(labels) != self.parallel.dp_replicate:
            raise ConfigError(f"ray.replica_labels={self.ray.replica_labels!r} has {len(labels)} selectors for "
                              f"parallel.dp_replicate={self.parallel.dp_replicate} replicas; give one per replica, "
                              "separated by ';'")
        seen = []
        for selector in labels:  # replicas that share a selector sit side by side (see launcher.worker_label_selectors)
            if selector in seen and selector != seen[-1]:
                raise ConfigError(f"ray.replica_labels={self.ray.replica_labels!r}: replicas with the same selector "
                                  f"{selector} must be next to each other; reorder the list")
            seen.append(selector)
        if e.sync == "every_step":
            return
        if not e.live_recovery:
            raise ConfigError(f"elastic.sync={e.sync!r} synchronises live recovery's replicas: set "
                              "elastic.live_recovery=true with parallel.dp_replicate >= 2, or elastic.sync='every_step'")
        _positive("elastic.sync_every", e.sync_every)
        every = self.checkpoint.every_steps
        if every % e.sync_every:
            raise ConfigError(f"checkpoint.every_steps={every} is not a multiple of elastic.sync_every={e.sync_every}: "
                              "a checkpoint is taken where the replicas are synchronised; set checkpoint.every_steps "
                              f"to a multiple of {e.sync_every}")
        if e.sync == "diloco" and not (e.outer_lr > 0 and 0 <= e.outer_momentum < 1):
            raise ConfigError(f"elastic.outer_lr={e.outer_lr} and elastic.outer_momentum={e.outer_momentum}: the "
                              "outer step needs outer_lr > 0 and 0 <= outer_momentum < 1 (e.g. DiLoCo's 0.7 and 0.9)")

    @property
    def elastic_enabled(self) -> bool:
        return self.elastic.max_workers > 0

    @property
    def micro_batch_is_exact(self) -> bool:
        """Whether a set train.micro_batch is used as given (else it is an upper bound, or the pipeline's
        parallel.num_microbatches decides, or the planner does)."""
        p = self.parallel
        return not (self.elastic_enabled or p.auto or (p.pp != 1 and p.num_microbatches))

    @property
    def head_dim(self) -> int:
        return self.model.head_size


RUN_FACTS = "run.json"  # RUN_DIR/run.json: the run's RunFacts


@dataclass(frozen=True)
class RunFacts:
    """What the driver resolved for one run, kept apart from the user's `Config`, which stays as the user gave
    it (workers receive it and RUN_DIR/config.toml records it unchanged): the run's name (train.run_name, or a
    new one), the storage it lives under (checkpoint.storage made absolute) and the prepared data (data.path,
    or the default corpus's cache directory); the run directory follows (storage/name). The driver writes them
    to RUN_DIR/run.json (the run directory with them, for readers) and sends them to every worker beside the
    config."""

    run_name: str
    storage: str
    data_path: str

    @property
    def run_dir(self) -> str:
        return join(self.storage, self.run_name)

    def to_dict(self) -> dict[str, str]:
        return {**dataclasses.asdict(self), "run_dir": self.run_dir}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "RunFacts":
        return cls(**{f.name: str(raw[f.name]) for f in dataclasses.fields(cls)})


# ---- helpers ---------------------------------------------------------------------------------------


def read_run_config(run_dir: str) -> Config:
    """The config a run was launched with, as its user gave it (RUN_DIR/config.toml, any fsspec URI); init_from is
    dropped (the checkpoint holds every weight, the pretrained directory need not exist any more)."""
    import tomllib

    from raydist.store.run_store import RunStore

    try:
        text = RunStore(run_dir).read_text("config.toml")
    except FileNotFoundError:
        raise ConfigError(f"{run_dir} has no config.toml: not a raydist run directory (pass "
                          "<checkpoint.storage>/<train.run_name>, or hf:DIR where a model may be one)") from None
    return Config.from_dict(tomllib.loads(text), ["model.init_from="])


def _positive(name: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{name}={value} must be a positive integer")


if __name__ == "__main__":  # regenerates the README's reference: python -m raydist.config
    print(reference_markdown())
