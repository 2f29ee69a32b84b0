"""A mixture-of-experts feed-forward: a router picks k of E SwiGLU experts per token, dropless.

Sparsely-gated experts (Shazeer et al. 2017, "Outrageously Large Neural Networks"), as the open MoE
decoders use them: Mixtral (Jiang et al. 2024, "Mixtral of Experts") and Qwen3-MoE (Qwen team 2025) route
each token to the top k of a softmax over E experts and weight the chosen experts' outputs by their
probabilities, renormalised to sum to 1 (`model.moe_norm_topk`; Qwen3-MoE's `norm_topk_prob`). No token is
dropped by a capacity limit (dropless, as MegaBlocks, Gale et al. 2023): every expert computes every token
routed to it. An optional shared expert (DeepSeekMoE, Dai et al. 2024) sees every token.

Shapes: N tokens (B x T flattened), D d_model, E experts, F an expert's hidden width, k experts per token.

The experts' weights are stacked, one (E, out, in) tensor per projection (`experts.w1.weight` gate,
`experts.w3.weight` up, `experts.w2.weight` down), so a grouped GEMM takes them whole and expert
parallelism and FSDP can shard the expert dimension. The token-expert pairs are sorted by expert (a stable
sort: ties keep token order), each expert multiplies its contiguous rows, and the outputs are put back in
token order and summed over each token's k experts with its weights (a gather, not an atomic add: the
same sums in the same order on every run). The grouped product is `torch._grouped_mm` where the device has
it (CUDA, sm90+, bf16, 16-byte rows), raydist's Triton grouped GEMM under `kernels.matmul = "triton"`
(raydist.kernels.grouped_mm), and a loop over experts elsewhere.

The load-balancing loss (Switch Transformer's f . P, Fedus et al. 2021), per sequence as DeepSeek-V3's
sequence-wise balance loss (DeepSeek-AI 2024): for a sequence of T tokens, f_e is the share of its T k
assignments that went to expert e and P_e its tokens' mean router probability for e;
aux(sequence) = E * sum_e f_e P_e (1 when balanced). A block's aux is the mean over the micro-batch's
sequences and the model's the mean over its MoE blocks and the step's micro-batches. Because it is a mean
over whole sequences, a data-parallel rank's or a micro-batch's mean, averaged as the language-model loss
is, is the single process's mean over the step's sequences: every layout computes the same value. Training
differentiates `model.moe_aux_coef` times it along with the language-model loss (`_BalanceGradient`); the
logged loss is the language model's, the balance loss is logged apart (`moe_aux`).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from raydist.metrics.kernels import count_call


class ExpertWeights(nn.Module):
    """E stacked nn.Linear weights: `weight` (E, out_features, in_features); expert e computes x @ weight[e].T."""

    def __init__(self, experts: int, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1 / max(1, self.weight.shape[-1]) ** 0.5  # nn.Linear's default bound, per expert
        nn.init.uniform_(self.weight, -bound, bound)


def _grouped_mm_fits(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """torch._grouped_mm's CUDA kernel: Hopper or newer, bf16, rows of every operand a multiple of 16 bytes."""
    if not (x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16):
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return all(w.dtype == torch.bfloat16 and all(s * 2 % 16 == 0 for s in w.shape[1:]) for w in weights)


# a grouped GEMM: rows x (M, K) sorted by expert, w (E, K, N), offsets (E,) int32 cumulative row ends -> (M, N)
GroupedMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _torch_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, w, offs=offsets)


def expert_swiglu(xs: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                  w2: torch.Tensor, kernel: str | GroupedMM = "auto") -> torch.Tensor:
    """Rows xs (M, D) sorted by expert, counts (E,) rows per expert -> (M, D): expert e's SwiGLU
    w2[e](silu(w1[e] x) * w3[e] x) on its rows. w1, w3 (E, F, D), w2 (E, D, F).

    kernel: `grouped_mm` (torch._grouped_mm), `loop` (one matmul per expert; reads the counts on the host),
    `auto` (torch._grouped_mm where it runs, else the loop), or a GroupedMM function (kernels.select installs
    raydist.kernels.grouped_mm's Triton one under kernels.matmul = "triton"; counted by its `kernel_name`)."""
    if torch.is_autocast_enabled(xs.device.type):  # as autocast casts a matmul's operands (the grouped
        # GEMMs take one dtype for rows and weights; autocast does not know them)
        dtype = torch.get_autocast_dtype(xs.device.type)
        xs, w1, w3, w2 = (t.to(dtype) for t in (xs, w1, w3, w2))
    if kernel == "auto":
        kernel = "grouped_mm" if _grouped_mm_fits(xs, w1, w3, w2) else "loop"
    if kernel != "loop":
        grouped_mm = _torch_grouped_mm if kernel == "grouped_mm" else kernel
        count_call(f"moe.{getattr(grouped_mm, 'kernel_name', 'grouped_mm')}")
        offsets = counts.cumsum(0).to(torch.int32)  # where each expert's rows end (no host sync)
        gate = grouped_mm(xs, w1.transpose(-2, -1), offsets)
        up = grouped_mm(xs, w3.transpose(-2, -1), offsets)
        return grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offsets)
    count_call("moe.loop")
    outs = [F.silu(rows @ w1[e].T) * (rows @ w3[e].T) @ w2[e].T
            for e, rows in enumerate(xs.split(counts.tolist()))]
    return torch.cat(outs)


class GroupedExperts(nn.Module):
    """E SwiGLU experts, their weights stacked (w1 gate, w3 up: (E, F, D); w2 down: (E, D, F))."""

    def __init__(self, experts: int, d_model: int, hidden: int):
        super().__init__()
        self.num_experts = experts
        self.kernel: str | GroupedMM = "auto"  # expert_swiglu's (kernels.select installs the Triton one)
        self.w1 = ExpertWeights(experts, hidden, d_model)
        self.w3 = ExpertWeights(experts, hidden, d_model)
        self.w2 = ExpertWeights(experts, d_model, hidden)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                counts: torch.Tensor) -> torch.Tensor:
        """x (N, D), experts (N, k) chosen expert ids, weights (N, k), counts (E,) pairs per expert (the
        bincount of `experts`) -> (N, D): sum_j weights[:, j] * expert_{experts[:, j]}(x)."""
        n, k = experts.shape
        flat = experts.reshape(-1)  # (N k,): pair p is token p // k's j = p % k-th choice
        order = flat.argsort(stable=True)  # pairs grouped by expert, token order within an expert
        ys = expert_swiglu(x[order // k], counts, self.w1.weight, self.w3.weight, self.w2.weight, self.kernel)
        y = ys[order.argsort()].view(n, k, -1)  # back in pair order
        return (y * weights.unsqueeze(-1).to(y.dtype)).sum(1)


def sequence_balance_loss(probs: torch.Tensor, experts: torch.Tensor, num_experts: int,
                          group: "dist.ProcessGroup | None" = None) -> torch.Tensor:
    """probs (B, T, E) router probabilities (fp32), experts (B, T, k) chosen ids -> the mean over the B
    sequences of E * sum_e f_e P_e (f_e: share of the sequence's T k assignments to e, P_e: mean probability).

    group: ranks holding other tokens of the same sequences (context parallelism). The counts and the
    probability sums are summed over it (the sums with autograd: each rank's probabilities get the gradient
    of the whole sequence's loss), so every rank computes the whole sequences' value."""
    b, t, k = experts.shape
    counts = torch.zeros(b, num_experts, device=probs.device, dtype=probs.dtype)
    counts.scatter_add_(1, experts.reshape(b, t * k), torch.ones(b, t * k, device=probs.device, dtype=probs.dtype))
    sums = probs.sum(1)  # (B, E)
    if group is not None and dist.get_world_size(group) > 1:
        from torch.distributed.nn.functional import all_reduce

        dist.all_reduce(counts, group=group)
        sums = all_reduce(sums, group=group)
        t *= dist.get_world_size(group)
    share = counts / (t * k)  # (B, E), no gradient (a count)
    return num_experts * (share * sums / t).sum(-1).mean()


class _BalanceGradient(torch.autograd.Function):
    """The identity on a block's output whose backward gives the block's balance loss the gradient
    `block.aux_weight`: weight x aux joins what backward differentiates without being added to any loss
    value, so a block contributes it wherever it runs, a pipeline stage that computes no loss included
    (Megatron-LM's MoEAuxLossAutoScaler does the same). The backward also hands the block its aux and load
    for the metrics: it runs once per training micro-batch, also when activation checkpointing recomputes
    the forward (the recomputation only refills saved tensors)."""

    @staticmethod
    def forward(ctx, out, aux, block, load):
        ctx.block, ctx.load = block, load
        ctx.save_for_backward(aux)
        return out

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        ctx.block.record(aux.detach(), ctx.load)
        return grad, torch.full_like(aux, ctx.block.aux_weight), None, None


class MoEFeedForward(nn.Module):
    """The router (`router`, nn.Linear D -> E without bias), the routed experts (`experts`) and an optional
    shared expert (`shared`, a dense SwiGLU). In training (gradients enabled) the block's load-balancing loss
    enters backward with the weight `aux_weight` (`_BalanceGradient`): model.moe_aux_coef / (MoE blocks x
    micro-batches of the step), set by `set_balance_weight`, so that the step's gradient is that of the
    coefficient times the mean over blocks and micro-batches. `aux_values` and `load` (the tokens each expert
    received, (E,)) collect what each training micro-batch's backward saw, for the metrics (`take_stats`)."""

    def __init__(self, cfg):
        super().__init__()
        from raydist.models.gpt import FeedForward

        self.num_experts, self.top_k, self.norm_topk = cfg.moe_experts, cfg.moe_top_k, cfg.moe_norm_topk
        self.router = nn.Linear(cfg.d_model, cfg.moe_experts, bias=False)
        self.experts = GroupedExperts(cfg.moe_experts, cfg.d_model, cfg.expert_hidden)
        self.shared = FeedForward(cfg, hidden=cfg.moe_shared_ffn_hidden) if cfg.moe_shared_ffn_hidden else None
        self.aux_weight = cfg.moe_aux_coef / cfg.num_layers  # one micro-batch per step until told otherwise
        self.sequence_group: dist.ProcessGroup | None = None  # context parallelism's (GPT.set_sequence_group)
        self.aux_values: list[torch.Tensor] = []
        self.load: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, D) -> (probs (N, E) fp32, weights (N, k) in x's dtype, experts (N, k))."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return probs, weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        probs, weights, experts = self.route(flat)
        counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts)  # the experts' rows; the load
        out = self.experts(flat, experts, weights, counts)
        if self.shared is not None:
            out = out + self.shared(flat)
        if torch.is_grad_enabled():  # training: evaluation neither differentiates the loss nor counts the load
            aux = sequence_balance_loss(probs.view(b, t, -1), experts.view(b, t, -1), self.num_experts,
                                        self.sequence_group)
            out = _BalanceGradient.apply(out, aux, self, counts.float())
        return out.view(b, t, d)

    @torch.no_grad()
    def record(self, aux: torch.Tensor, load: torch.Tensor) -> None:
        self.aux_values.append(aux)
        self.load = load if self.load is None else self.load + load


def moe_blocks(module: nn.Module) -> list[MoEFeedForward]:
    return [m for m in module.modules() if isinstance(m, MoEFeedForward)]


def set_balance_weight(module: nn.Module, coef: float, blocks: int, micro_batches: int) -> None:
    """Each MoE block of `module` weighs its balance loss coef / (blocks x micro_batches): `blocks` the
    model's MoE blocks (a pipeline stage holds some of them), `micro_batches` the step's on this rank."""
    for block in moe_blocks(module):
        block.aux_weight = coef / (blocks * micro_batches)


@torch.no_grad()
def take_stats(module: nn.Module) -> tuple[torch.Tensor | None, int, torch.Tensor | None]:
    """(sum of the balance losses (0-d, on the device), how many, tokens per expert summed over blocks (E,))
    that `module`'s MoE blocks recorded since the last call (None, 0, None without any); the records restart."""
    values, load = [], None
    for block in moe_blocks(module):
        values += block.aux_values
        if block.load is not None:
            load = block.load if load is None else load + block.load
        block.aux_values, block.load = [], None
    return (torch.stack(values).sum() if values else None), len(values), load
