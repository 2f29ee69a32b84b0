"""Model families: what distinguishes one decoder family from another, in one registry.

raydist's decoder (`raydist.models.gpt`) is the Llama architecture (Touvron et al. 2023): RMSNorm,
SwiGLU MLP, grouped-query attention, RoPE. The open families most users fine-tune differ from it in a few
switches, and everything that depends on the family reads them here: the model (which modules a block
has), its initialisation, the tensor-parallel plan, LoRA, the parameter and FLOP counts, and the Hugging
Face adapter (`model_type`, architecture, extra config keys).

- Qwen2 / Qwen2.5 (Qwen team 2024, "Qwen2 Technical Report"): biases on the q, k and v projections.
- Qwen3 (Qwen team 2025, "Qwen3 Technical Report"): no biases; an RMSNorm over each head's
  coordinates of q and of k before RoPE ("QK-norm", as Dehghani et al. 2023 used at scale), and a head
  dimension that need not be d_model / num_heads (Qwen3-0.6B: d_model 1024, 16 heads of 128).
- Mistral (Jiang et al. 2023): Llama's blocks; raydist loads checkpoints without sliding-window attention.
- Mixtral (Jiang et al. 2024, "Mixtral of Experts"): Mistral's attention, every block's MLP a mixture of
  experts (raydist.models.moe) with renormalised top-k weights; Hugging Face names them `block_sparse_moe`.
- Qwen3-MoE (Qwen team 2025): Qwen3's attention, every block's MLP a mixture of experts (`mlp.gate`,
  `mlp.experts.{j}`), the experts' width `moe_intermediate_size`.

A new family of the same block structure is one `ModelFamily` line in `FAMILIES` (plus its Hugging Face
config keys, if it has extra ones, in `hf_config_extra`); docs/architecture.md says how. This module imports
nothing heavy: the config validates `model.family` against it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelFamily:
    name: str
    hf_model_type: str  # config.json's model_type, read and written
    hf_architecture: str  # config.json's architectures[0] on export
    qkv_bias: bool = False  # q, k and v projections carry biases (not o)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE
    hf_config_extra: dict[str, Any] = field(default_factory=dict)  # keys export writes besides the shared ones
    # config.json's key that turns sliding-window attention on, and its value when absent (transformers'
    # default): raydist has none, so a checkpoint loads only with that key null or false
    sliding_window_key: tuple[str, Any] | None = None
    # a mixture-of-experts family (model.moe_experts > 0): its Hugging Face module holding the router
    # (`gate`) and the experts, and each expert's (gate, up, down) projection names
    hf_moe: tuple[str, tuple[str, str, str]] | None = None

    @property
    def moe(self) -> bool:
        return self.hf_moe is not None

    def sliding_window_on(self, hf_config: dict) -> str | None:
        """`key=value` when `hf_config` (config.json) turns sliding-window attention on, else None."""
        if self.sliding_window_key is None:
            return None
        key, default = self.sliding_window_key
        value = hf_config.get(key, default)
        return None if value in (None, False) else f"{key}={json.dumps(value)}" + (" (default)" if key not in hf_config else "")


FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (
    ModelFamily("llama", "llama", "LlamaForCausalLM",
                hf_config_extra={"attention_bias": False, "mlp_bias": False}),
    ModelFamily("mistral", "mistral", "MistralForCausalLM", hf_config_extra={"sliding_window": None},
                sliding_window_key=("sliding_window", 4096)),
    ModelFamily("qwen2", "qwen2", "Qwen2ForCausalLM", qkv_bias=True,
                hf_config_extra={"use_sliding_window": False, "sliding_window": None},
                sliding_window_key=("use_sliding_window", False)),
    ModelFamily("qwen3", "qwen3", "Qwen3ForCausalLM", qk_norm=True,
                hf_config_extra={"attention_bias": False, "use_sliding_window": False, "sliding_window": None},
                sliding_window_key=("use_sliding_window", False)),
    ModelFamily("mixtral", "mixtral", "MixtralForCausalLM", hf_config_extra={"sliding_window": None},
                sliding_window_key=("sliding_window", None), hf_moe=("block_sparse_moe", ("w1", "w3", "w2"))),
    ModelFamily("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True,
                hf_config_extra={"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
                                 "decoder_sparse_step": 1, "mlp_only_layers": []},
                sliding_window_key=("use_sliding_window", False),
                hf_moe=("mlp", ("gate_proj", "up_proj", "down_proj"))),
)}
FAMILY_NAMES = tuple(FAMILIES)


def family_of(model_cfg) -> ModelFamily:
    """The family of a ModelConfig (validated by the config: a KeyError here is a programming error)."""
    return FAMILIES[model_cfg.family]


def family_for_hf(model_type: str | None) -> ModelFamily | None:
    """The family whose Hugging Face model_type this is (None: no family raydist has)."""
    return next((f for f in FAMILIES.values() if f.hf_model_type == model_type), None)
