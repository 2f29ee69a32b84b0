"""Pick the kernels from `[kernels]` and install them into a built model (before it is parallelized).

    chosen = apply_kernels(model, cfg.kernels, device)   # {"attention": "triton", "matmul": "triton"}

attention: `auto` -> sdpa; `triton` | `sdpa` | `eager` as asked, or a ConfigError with the fix.
matmul:    `auto` -> torch (cuBLAS on CUDA); `triton` | `torch`.
loss:      `auto` -> fused (the head's matmul and the loss a chunk of tokens at a time, the chunks'
           elementwise work in torch); `triton` (the same, that work in raydist.kernels.cross_entropy's
           kernels) | `plain` (the logits, then the loss).

Why `auto` is torch's kernels on CUDA too: measured on one H100 (torch 2.11, Triton 3.6, the GPU suite of
2026-11-27, figures in benchmarks/results/gpu_suite_h100.json), the Triton attention's forward+backward ran at
0.65-0.66x the speed of `F.scaled_dot_product_attention` (flash) at Llama 3 8B/70B heads for T = 2k-8k, the
Triton matmul at 0.82-0.88x cuBLAS on the MLP GEMMs, and an 8B-shaped stack of 4 blocks at T = 8192 reached
35.5% MFU with both Triton kernels against 43.6% with torch's. Triton stays one setting away.

The Triton matmul is installed by changing the class of each plain `nn.Linear` to `TritonLinear` and of each
`FeedForward` to `TritonFeedForward` (same instance, same parameters, same names: checkpoints and
tensor-parallel plans that key on module names are unaffected, and isinstance(m, nn.Linear)
still holds). Where a parallel plan has turned a weight or input into a DTensor, those modules fall back to
the torch path (counted as `matmul.torch_fallback` / `swiglu.torch_fallback` in `runtime.kernel_calls()`),
since the kernel works on local tensors only. On the torch path plain `nn.Linear`s become `TorchLinear`
(F.linear, counted as `matmul.torch`) in the same way, so the metrics can report what ran on every path.

Either class, as the model's head, also computes the loss with its matmul when given the targets
(`forward(x, targets)`, counted as `loss.fused`): models.loss.linear_cross_entropy, chunk by chunk of
tokens, never the whole logits, vocabulary-parallel on a tensor-parallel head (`ParallelModel.loss`; `kernels.loss`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raydist.errors import ConfigError
from raydist.kernels import runtime
from raydist.kernels.attention import SUPPORTED_HEAD_DIMS, triton_causal_attention
from raydist.kernels.cross_entropy import TRITON_CHUNKS
from raydist.kernels.matmul import linear, swiglu
from raydist.models.gpt import FeedForward, eager_attention, sdpa_attention
from raydist.models.loss import TORCH_CHUNKS, linear_cross_entropy

ATTENTION_FNS = {"triton": triton_causal_attention, "sdpa": sdpa_attention, "eager": eager_attention}


def _is_dtensor(*tensors) -> bool:
    return any(t is not None and type(t).__name__ == "DTensor" for t in tensors)


def fused_loss(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
               kernel: str = "fused") -> torch.Tensor:
    """A head's loss with its matmul, chunk by chunk of tokens (models.loss.linear_cross_entropy;
    vocabulary-parallel when tensor parallelism split the head): what `ParallelModel.loss` asks of the head.
    `kernel`: the head's `loss_kernel`, "fused" (torch's elementwise work on each chunk) or "triton"
    (raydist.kernels.cross_entropy's kernels); counted as `loss.<kernel>`."""
    if bias is not None:
        raise ValueError("the fused loss takes a head without bias")
    runtime.count_call(f"loss.{kernel}")
    return linear_cross_entropy(x, weight, targets, ops=TRITON_CHUNKS if kernel == "triton" else TORCH_CHUNKS)


class TorchLinear(nn.Linear):
    """nn.Linear (F.linear) that counts its calls as `matmul.torch`: the torch path, installed so that the
    run's metrics can report what ran on every path (`raydist.metrics.kernels`)."""

    fuses_loss = True  # a head of this class computes the loss with its matmul (`forward(x, targets)`)
    loss_kernel = "fused"  # the chunks' elementwise work: "fused" (torch) or "triton" (`apply_kernels` sets it)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        runtime.count_call("matmul.torch")
        if targets is not None:
            return fused_loss(x, self.weight, self.bias, targets, self.loss_kernel)
        return F.linear(x, self.weight, self.bias)


class TritonLinear(nn.Linear):
    """nn.Linear whose forward runs the Triton matmul (bias fused in the epilogue)."""

    fuses_loss = True  # (as TorchLinear's; the loss's chunked matmuls are torch's: counted as the fallback)
    loss_kernel = "fused"

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is not None:
            runtime.count_call("matmul.torch_fallback")
            return fused_loss(x, self.weight, self.bias, targets, self.loss_kernel)
        if _is_dtensor(x, self.weight, self.bias):
            runtime.count_call("matmul.torch_fallback")
            return F.linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)


class TritonFeedForward(FeedForward):
    """SwiGLU with silu(gate x) * (up x) in one Triton kernel (both products share each x tile), then down."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.projections()
        if gate.bias is not None or up.bias is not None or _is_dtensor(x, gate.weight, up.weight):
            runtime.count_call("swiglu.torch_fallback")  # (its three linears count as matmul calls)
            return super().forward(x)
        return down(swiglu(x, gate.weight, up.weight))  # (B, T, F) -> (B, T, D)


def resolve_kernels(cfg, device: torch.device | str, head_dim: int) -> dict[str, str]:
    """{"attention": ..., "matmul": ..., "loss": ...}: what will run, or a ConfigError naming the setting and
    the fix. `cfg` holds the choices (`.attention`, `.matmul`, `.loss`: the `[kernels]` section)."""
    device = torch.device(device)
    attention = cfg.attention
    if attention == "auto":
        attention = "sdpa"  # faster than the Triton kernel where measured (the module's docstring)
    elif attention == "triton":
        runtime.require_triton(device, "kernels.attention=triton")
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ConfigError(f"kernels.attention=triton supports head dims {SUPPORTED_HEAD_DIMS}, but "
                              f"the head dim (model.head_dim, or d_model/num_heads) is {head_dim}; change the model shape or "
                              "use kernels.attention=sdpa")
    elif attention not in ATTENTION_FNS:
        raise ConfigError(f"kernels.attention={attention!r} is not one of auto, triton, sdpa, eager")
    matmul = cfg.matmul
    if matmul == "auto":
        matmul = "torch"  # cuBLAS beat the Triton matmul where measured (the module's docstring)
    elif matmul == "triton":
        runtime.require_triton(device, "kernels.matmul=triton")
    elif matmul != "torch":
        raise ConfigError(f"kernels.matmul={matmul!r} is not one of auto, triton, torch")
    loss = cfg.loss
    if loss == "auto":
        loss = "fused"  # torch's elementwise work: the Triton loss kernels have not been timed on a GPU
    elif loss == "triton":
        runtime.require_triton(device, "kernels.loss=triton")
    elif loss != "plain":
        raise ConfigError(f"kernels.loss={loss!r} is not one of auto, triton, plain")
    return {"attention": attention, "matmul": matmul, "loss": loss}


def install_triton_matmul(model: nn.Module) -> int:
    """Switch every plain nn.Linear and FeedForward in `model` to the Triton versions, and a mixture of
    experts' experts to the Triton grouped GEMM (raydist.kernels.grouped_mm); returns how many."""
    from raydist.kernels.grouped_mm import grouped_mm
    from raydist.models.moe import GroupedExperts

    changed = 0
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.kernel = grouped_mm
            changed += 1
        elif type(module) in (nn.Linear, TorchLinear):
            module.__class__ = TritonLinear
            changed += 1
        elif type(module) is FeedForward and not any(hasattr(m, "lora_a") for m in module.children()):
            # (the fused SwiGLU reads the gate and up weights directly: it would skip LoRA adapters on them)
            module.__class__ = TritonFeedForward
            changed += 1
    return changed


def install_torch_matmul(model: nn.Module) -> int:
    """Switch every plain nn.Linear in `model` to the counting `TorchLinear`; returns how many."""
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = TorchLinear
            changed += 1
    return changed


def apply_kernels(model: nn.Module, cfg, device: torch.device | str) -> dict[str, str]:
    """Install the selected kernels into a GPT built by models.gpt.build_model; returns the selection.

    Call after building the model and before parallelizing it (the DTensor fallbacks above are a safety
    net, not the intended layout).
    """
    model_cfg = model.cfg
    chosen = resolve_kernels(cfg, device, model_cfg.head_size)
    model.set_attention(ATTENTION_FNS[chosen["attention"]])
    if chosen["matmul"] == "triton":
        install_triton_matmul(model)
    else:
        install_torch_matmul(model)
    if chosen["loss"] == "triton" and model.head is not None:
        model.head.loss_kernel = "triton"  # (a pipeline's copy of a tied head keeps it: GPT.give_head)
    return chosen
