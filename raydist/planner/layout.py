"""What the planner chooses (`Layout`) and what it is given (`Workload`): plain data, no torch.

A `Layout` is one point of the search space: the five mesh degrees plus the knobs that change memory
and time without changing the math (micro-batch size, activation recompute, sequence parallelism, the
context-parallel and pipeline algorithms, FSDP resharding). `config_overrides()` spells it as
`--set section.key=value` strings, so a plan can be handed to `raydist train` verbatim.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from raydist.config import Config, ModelConfig
from raydist.mesh import MeshSpec


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    micro_batch: int = 1  # samples per forward/backward on one rank
    activation_checkpoint: str = "none"  # none | full | every_k | selective
    activation_checkpoint_k: int = 0  # every_k: blocks per segment (0: round(sqrt(layers per stage)))
    sequence_parallel: bool = False
    cp_impl: str = "ring"
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    fsdp_reshard_after_forward: bool = True

    @property
    def spec(self) -> MeshSpec:
        return MeshSpec(self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks one parameter is sharded over: dp_shard x cp (context-parallel ranks share weights)."""
        return self.dp_shard * self.cp

    @property
    def data_parallel_kind(self) -> str:
        """As raydist.parallel.data_parallel_kind decides it from the mesh."""
        if self.fsdp_size > 1 or (self.tp > 1 and self.dp_replicate > 1):
            return "hsdp" if self.dp_replicate > 1 else "fsdp"
        return "ddp" if self.dp_replicate > 1 else "none"

    def mesh(self) -> dict[str, int]:
        return self.spec.degrees()

    def describe(self) -> str:
        parts = [f"{k}{v}" for k, v in self.mesh().items() if v > 1] or ["single"]
        parts.append(f"mb{self.micro_batch}")
        if self.activation_checkpoint != "none":
            parts.append(f"ac:{self.activation_checkpoint}")
        if self.tp > 1 and self.sequence_parallel:
            parts.append("sp")
        if self.cp > 1:
            parts.append(self.cp_impl)
        if self.pp > 1:
            parts.append(self.pp_schedule + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.fsdp_size > 1 and not self.fsdp_reshard_after_forward:
            parts.append("no-reshard")
        return " ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)

    def config_overrides(self, num_microbatches: int | None = None) -> list[str]:
        """`section.key=value` strings that make a Config use this layout."""
        out = [f"parallel.{k}={v}" for k, v in self.mesh().items()]
        out += [f"train.micro_batch={self.micro_batch}",
                f"train.activation_checkpoint={self.activation_checkpoint}",
                f"train.activation_checkpoint_k={self.activation_checkpoint_k}",
                f"parallel.sequence_parallel={'true' if self.sequence_parallel else 'false'}",
                f"parallel.cp_impl={self.cp_impl}",
                f"parallel.pp_schedule={self.pp_schedule}",
                f"parallel.virtual_stages={self.virtual_stages}",
                f"parallel.fsdp_reshard_after_forward={'true' if self.fsdp_reshard_after_forward else 'false'}"]
        if num_microbatches is not None and self.pp > 1:
            out.append(f"parallel.num_microbatches={num_microbatches}")
        return out

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> "Layout":
        p, t = cfg.parallel, cfg.train
        spec = MeshSpec.from_config(p).resolve(world_size)
        return cls(spec.pp, spec.dp_replicate, spec.dp_shard, spec.cp, spec.tp, t.micro_batch,
                   t.activation_checkpoint, t.activation_checkpoint_k, p.sequence_parallel, p.cp_impl,
                   p.pp_schedule, p.virtual_stages if p.pp_schedule == "interleaved" else 1,
                   p.fsdp_reshard_after_forward)


@dataclass(frozen=True)
class Workload:
    """The model and the batch; independent of the layout."""

    model: ModelConfig
    seq_len: int
    global_batch: int  # samples per optimizer step
    compute_dtype_bytes: int = 2  # 2: bf16 autocast / FSDP mixed precision; 4: fp32
    name: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_config(cls, cfg: Config, compute_dtype_bytes: int, name: str = "") -> "Workload":
        if cfg.train.dtype == "fp32":
            compute_dtype_bytes = 4
        elif cfg.train.dtype == "bf16":
            compute_dtype_bytes = 2
        return cls(cfg.model, cfg.data.seq_len, cfg.train.global_batch, compute_dtype_bytes, name)

    @property
    def head_dim(self) -> int:
        return self.model.d_model // self.model.num_heads

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


def stage_layer_counts(num_layers: int, pp: int) -> list[int]:
    """Blocks per pipeline stage, as even as possible (earlier stages take the remainder)."""
    base, extra = divmod(num_layers, pp)
    return [base + (1 if i < extra else 0) for i in range(pp)]


def every_k_segment(layers: int, k: int) -> int:
    """raydist.parallel.checkpointing.segment_size for every_k: k, or round(sqrt(layers))."""
    return k or max(1, round(math.sqrt(layers)))
