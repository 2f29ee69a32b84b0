"""Pick the kernels from `[kernels]` and install them into a built model (before it is parallelized).

    chosen = apply_kernels(model, cfg.kernels, device)   # {"attention": "triton", "matmul": "triton"}

attention: `auto` -> measured on CUDA (below), sdpa on the CPU; `triton` | `sdpa` | `eager` as asked, or a
           ConfigError with the fix.
matmul:    `auto` -> measured on CUDA per linear shape, torch on the CPU; `triton` | `torch`.
loss:      `auto` -> fused (the head's matmul and the loss a chunk of tokens at a time, the chunks'
           elementwise work in torch); `triton` (the same, that work in raydist.kernels.cross_entropy's
           kernels) | `plain` (the logits, then the loss).

`auto` on CUDA is decided by measurement (raydist.kernels.choice): the Triton kernel against SDPA / cuBLAS,
forward + backward, at each shape the run will use, the faster kept, cached per device, versions and shape.
Why measure rather than fix a choice: on one H100 (torch 2.11, Triton 3.6, the GPU suite of 2026-11-27,
benchmarks/results/gpu_suite_h100.json) the Triton attention ran at 0.65-0.66x SDPA's speed at Llama 3
8B/70B heads and the Triton matmul at 0.82-0.88x cuBLAS's, but another GPU, shape or compiler release
can reverse either, and a per-shape pick costs a few seconds once per device.

Where and when: at model build, from the shapes the config fixes (`Workload.of`: micro-batch, sequence
length over cp, local heads under tp, the compute dtype), never inside a training step. A Trainer's rank 0
decides (`shared_choices`: it alone times, on its GPU, before any weight is allocated) and every rank
installs its picks, so the ranks of a run run the same kernels (numerics and speed alike) whatever each
would have measured; a restart reads the picks back from the cache file. Untimed, torch's: shapes the
Triton kernel lacks (head dims outside SUPPORTED_HEAD_DIMS), linears that tensor parallelism hands DTensors,
the head when it computes the fused loss (its matmuls are torch's chunks), LoRA-adapted and expert modules,
attention under context parallelism (ring / Ulysses choose their own blocks). Calls at other shapes
(evaluation batches, generation) run what was installed. The CPU never times: Triton runs there only
under its interpreter. The picks and both times go to the metrics (`kernels_measured` in summary.json).

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

import json
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from raydist.errors import ConfigError
from raydist.kernels import runtime
from raydist.kernels.attention import SUPPORTED_HEAD_DIMS, triton_causal_attention
from raydist.kernels.choice import AttentionShape, KernelChooser, MatmulShape, Pick, default_chooser
from raydist.kernels.cross_entropy import TRITON_CHUNKS
from raydist.kernels.matmul import linear, swiglu
from raydist.metrics.kernels import record_choice
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
    the fix. `cfg` holds the choices (`.attention`, `.matmul`, `.loss`: the `[kernels]` section). An `auto`
    stays "auto" where it is decided by measurement (CUDA with Triton importable: `apply_kernels`)."""
    device = torch.device(device)
    measured = measures_auto(device)
    attention = cfg.attention
    if attention == "auto":
        attention = "auto" if measured else "sdpa"  # (the CPU: Triton runs only under the interpreter)
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
        matmul = "auto" if measured else "torch"
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


def measures_auto(device: torch.device | str) -> bool:
    """True where `auto` is decided by timing: a CUDA device, Triton importable. (On a CPU Triton runs
    only under its interpreter, which no run would choose: `auto` is torch's kernels there, untimed.)"""
    return torch.device(device).type == "cuda" and runtime.triton_import_error() is None


# ---- `auto` by measurement ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """What each kernel call sees on one rank, known from the config before the model exists: the shapes
    `auto` measures at (`Workload.of` for a Trainer's)."""

    micro_batch: int = 1
    seq_len: int = 0  # tokens of a whole sequence (context parallelism divides it); 0: the model's max_seq_len
    dtype: torch.dtype = torch.bfloat16  # the compute dtype the kernels see (autocast's or FSDP's)
    tp: int = 1
    cp: int = 1
    fused_loss: bool = True  # the head computes the loss with its matmul (chunked in torch: nothing to time)

    @classmethod
    def of(cls, cfg, layout, compute_dtype: torch.dtype) -> "Workload":
        """A Trainer's: `cfg` the run's Config, `layout` its Layout."""
        return cls(layout.micro_batch, cfg.data.seq_len, compute_dtype, layout.tp, layout.cp,
                   cfg.kernels.loss != "plain")


@dataclass
class KernelChoices:
    """What `auto` picked: the attention's pick (None when attention was not `auto`) and each linear
    module's and SwiGLU feed-forward's, by module name in the unparallelized model (the same on every rank)."""

    attention: Pick | None = None
    modules: dict[str, Pick] = field(default_factory=dict)

    def picks(self) -> list[Pick]:
        """Each distinct shape's pick once, attention first (what the metrics record)."""
        seen: dict[tuple[str, str], Pick] = {}
        for pick in ([self.attention] if self.attention else []) + list(self.modules.values()):
            seen.setdefault((pick.shape, pick.source), pick)
        return list(seen.values())

    def to_json(self) -> str:
        return json.dumps({"attention": self.attention.record() if self.attention else None,
                           "modules": {name: pick.record() for name, pick in self.modules.items()}})

    @classmethod
    def from_json(cls, text: str) -> "KernelChoices":
        raw = json.loads(text)
        attention = Pick.from_record(raw["attention"]) if raw["attention"] else None
        return cls(attention, {name: Pick.from_record(r) for name, r in raw["modules"].items()})


def _unmeasured(kind: str, shape: str, reason: str) -> Pick:
    return Pick(kind, shape, "torch", None, None, reason)


def choose_auto(model: nn.Module, cfg, workload: Workload, chooser: KernelChooser) -> KernelChoices:
    """Decide each `auto` kernel of `model` (a GPT, on any device, meta included) at `workload`'s shapes
    with `chooser`; nothing is installed. Linears that will hold DTensors (tensor parallelism), the head that
    computes the fused loss, LoRA-adapted and expert modules keep torch's kernels, unmeasured."""
    mc = model.cfg
    seq_len = workload.seq_len or model.max_seq_len
    tokens = workload.micro_batch * (seq_len // workload.cp)  # M of every linear on this rank
    dtype = str(workload.dtype).removeprefix("torch.")
    choices = KernelChoices()
    if cfg.attention == "auto":
        shape = AttentionShape(workload.micro_batch, mc.num_heads // workload.tp, mc.num_kv_heads // workload.tp,
                               seq_len, mc.head_size, dtype)
        if workload.cp > 1:  # ring or Ulysses attention replace the call (parallel/context.py picks the blocks)
            choices.attention = _unmeasured("attention", shape.key(), "context parallelism runs its own attention")
        else:
            choices.attention = chooser.choose(shape)
    if cfg.matmul != "auto":
        return choices
    from raydist.models.moe import GroupedExperts

    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts) or any(hasattr(m, "lora_a") for m in module.children()):
            continue
        if type(module) is FeedForward:
            gate, _, _ = module.projections()
            shape = MatmulShape(tokens, gate.in_features, gate.out_features, dtype, swiglu=True)
        elif type(module) in (nn.Linear, TorchLinear):
            shape = MatmulShape(tokens, module.in_features, module.out_features, dtype, bias=module.bias is not None)
            if module is model.head and workload.fused_loss:
                choices.modules[name] = _unmeasured(shape.kind, shape.key(),
                                                    "the head computes the fused loss (torch's chunked matmuls)")
                continue
        else:
            continue
        if workload.tp > 1:
            choices.modules[name] = _unmeasured(shape.kind, shape.key(), "tensor parallelism hands it DTensors")
        else:
            choices.modules[name] = chooser.choose(shape)
    return choices


def shared_choices(model: nn.Module, cfg, device: torch.device, workload: Workload, group=None,
                   chooser: KernelChooser | None = None) -> KernelChoices | None:
    """Rank 0 of `group` decides (`choose_auto`, timing on its device), every rank gets its decision: the
    ranks of a run run the same kernels, whatever each would have measured. None when nothing is `auto`
    on a device that measures. A failure on rank 0 is raised on every rank."""
    if not measures_auto(device) or "auto" not in (cfg.attention, cfg.matmul):
        return None
    import torch.distributed as dist

    shared = dist.is_initialized() and dist.get_world_size(group) > 1
    text = None
    if not shared or dist.get_rank(group) == 0:
        try:
            text = choose_auto(model, cfg, workload, chooser or default_chooser(device)).to_json()
        except Exception as exc:
            if not shared:
                raise
            text = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
    if shared:
        box = [text]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        text = box[0]
    if "error" in json.loads(text):
        raise RuntimeError(f"kernels = auto: measuring the kernels on rank 0 failed: {json.loads(text)['error']}")
    return KernelChoices.from_json(text)


def install_choices(model: nn.Module, choices: KernelChoices) -> str:
    """Install the measured matmul picks (a Triton class where Triton won, else the torch path); returns
    the selection's name: "triton", "torch", or "torch+triton" where shapes picked differently."""
    modules = dict(model.named_modules())
    kernels = set()
    for name, pick in choices.modules.items():
        module = modules[name]
        kernels.add(pick.kernel)
        if pick.kernel == "triton":
            module.__class__ = TritonFeedForward if isinstance(module, FeedForward) else TritonLinear
    install_torch_matmul(model)  # every other plain nn.Linear (the Triton FeedForward's gate and up included)
    return "+".join(sorted(kernels)) or "torch"


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


def apply_kernels(model: nn.Module, cfg, device: torch.device | str, workload: Workload | None = None,
                  choices: KernelChoices | None = None, chooser: KernelChooser | None = None) -> dict[str, str]:
    """Install the selected kernels into a GPT built by models.gpt.build_model; returns the selection.

    Call after building the model and before parallelizing it (the DTensor fallbacks above are a safety
    net, not the intended layout). Where `auto` is measured (`measures_auto`) it installs `choices` (a
    Trainer's, from `shared_choices`), or decides now at `workload`'s shapes (default: one sequence of the
    model's max_seq_len in bf16) with `chooser` (default: CUDA events and the cache file); the picks go to
    the metrics (`raydist.metrics.kernels.kernel_choices`).
    """
    model_cfg = model.cfg
    chosen = resolve_kernels(cfg, device, model_cfg.head_size)
    if "auto" in (chosen["attention"], chosen["matmul"]):
        if choices is None:
            choices = choose_auto(model, cfg, workload or Workload(), chooser or default_chooser(device))
        if chosen["attention"] == "auto":
            chosen["attention"] = "triton" if choices.attention.kernel == "triton" else "sdpa"
        for pick in choices.picks():
            record_choice(pick.record())
    model.set_attention(ATTENTION_FNS[chosen["attention"]])
    if chosen["matmul"] == "auto":
        chosen["matmul"] = install_choices(model, choices)
    elif chosen["matmul"] == "triton":
        install_triton_matmul(model)
    else:
        install_torch_matmul(model)
    if chosen["loss"] == "triton" and model.head is not None:
        model.head.loss_kernel = "triton"  # (a pipeline's copy of a tied head keeps it: GPT.give_head)
    return chosen
