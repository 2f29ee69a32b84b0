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

import contextlib
import time
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


class CommClock:
    """Seconds a module spent in its collectives since the last `take`: CUDA events around each one on a GPU
    (NCCL returns before the transfer ends; the events are read, with one wait, only when the metrics ask),
    the host clock elsewhere (gloo's blocking collectives return when done)."""

    def __init__(self):
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.host_s = 0.0

    @contextlib.contextmanager
    def timing(self, device: torch.device):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.append((start, end))
        else:
            begin = time.perf_counter()
            yield
            self.host_s += time.perf_counter() - begin

    def take(self) -> float:
        if self.events:
            self.events[-1][1].synchronize()
        seconds = self.host_s + sum(start.elapsed_time(end) for start, end in self.events) / 1e3
        self.events, self.host_s = [], 0.0
        return seconds


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, clock: CommClock) -> torch.Tensor:
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    with clock.timing(x.device):
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits that differentiates (the backward is the exchange with the
    splits swapped) and times both directions into a CommClock (the `moe_all_to_all_s` metric)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, clock):
        ctx.splits, ctx.group, ctx.clock = (out_splits, in_splits), group, clock
        return _exchange(x, out_splits, in_splits, group, clock)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group, ctx.clock), None, None, None, None


def _local(weight: torch.Tensor) -> torch.Tensor:
    """An expert stack's rows on this rank: the local experts of an expert-parallel DTensor (Shard(0) over
    ep; FSDP has gathered the rest of its dims), the tensor itself otherwise."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


class GroupedExperts(nn.Module):
    """E SwiGLU experts, their weights stacked (w1 gate, w3 up: (E, F, D); w2 down: (E, D, F)).

    Expert parallelism (`ep_group` set, raydist.parallel.fsdp.shard_experts): the stacks are DTensors split
    along the expert dim over the group's R ranks, R consecutive slices of E / R experts; rank r holds
    experts r E/R .. (r+1) E/R - 1. The group's ranks see different tokens (they are data-parallel ranks): each
    sends every token-expert pair to the rank holding its expert and gets the outputs back (`_dispatch`)."""

    def __init__(self, experts: int, d_model: int, hidden: int):
        super().__init__()
        self.num_experts = experts
        self.kernel: str | GroupedMM = "auto"  # expert_swiglu's (kernels.select installs the Triton one)
        self.ep_group: dist.ProcessGroup | None = None
        self.clock = CommClock()  # its all-to-alls (expert parallelism)
        self.w1 = ExpertWeights(experts, hidden, d_model)
        self.w3 = ExpertWeights(experts, hidden, d_model)
        self.w2 = ExpertWeights(experts, d_model, hidden)

    def stacks(self) -> tuple[ExpertWeights, ...]:
        """The modules holding the stacked weights (what expert parallelism splits)."""
        return self.w1, self.w3, self.w2

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                counts: torch.Tensor) -> torch.Tensor:
        """x (N, D), experts (N, k) chosen expert ids, weights (N, k), counts (E,) pairs per expert (the
        bincount of `experts`) -> (N, D): sum_j weights[:, j] * expert_{experts[:, j]}(x)."""
        n, k = experts.shape
        flat = experts.reshape(-1)  # (N k,): pair p is token p // k's j = p % k-th choice
        order = flat.argsort(stable=True)  # pairs grouped by expert, token order within an expert
        w1, w3, w2 = (_local(w.weight) for w in self.stacks())
        if self.ep_group is None:
            ys = expert_swiglu(x[order // k], counts, w1, w3, w2, self.kernel)
        else:
            ys = self._dispatch(x[order // k], counts, w1, w3, w2)
        y = ys[order.argsort()].view(n, k, -1)  # back in pair order
        return (y * weights.unsqueeze(-1).to(y.dtype)).sum(1)

    def _dispatch(self, xs: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                  w2: torch.Tensor) -> torch.Tensor:
        """Rows xs (M, D) sorted by global expert, counts (E,) -> the experts' outputs in the same order,
        computed where the experts live (GShard's dispatch and combine, Lepikhin et al. 2020, dropless):

        1. the counts go to every rank (an all-to-all of R x E/R integers): rank r learns how many rows each
           peer sends each of its experts; one host sync reads them, for the splits;
        2. the rows go out (all-to-all, variable splits): rank s's rows for rank r's experts are contiguous
           (sorted by expert), and arrive grouped by source rank, then expert;
        3. they are regrouped by expert (source rank order within one), computed by the local experts, put
           back in arrival order and returned (the all-to-all with the splits swapped).

        Both all-to-alls differentiate (their backward is the reverse all-to-all), so each expert's weight
        gradient sums every rank's tokens; FSDP's reduction divides it by the data-parallel width
        (raydist.parallel.fsdp), as it does a dense weight's average."""
        group, ranks = self.ep_group, dist.get_world_size(self.ep_group)
        local = self.num_experts // ranks
        sent = counts.view(ranks, local)  # rows this rank sends each rank's experts
        got = torch.empty_like(sent)
        with self.clock.timing(xs.device):  # got[s, j]: rows rank s sends my expert j
            dist.all_to_all_single(got, sent.contiguous(), group=group)
        table = torch.stack([sent.sum(1), got.sum(1)]).tolist()  # the one host sync: the splits
        send_splits, recv_splits = table
        got_rows = got.reshape(-1)
        rows = _AllToAll.apply(xs, recv_splits, send_splits, group, self.clock)
        # arrival order is (source s, expert j); the experts want (j, s): segment (s, j) starts at
        # starts[s, j]; regroup = the row indices in (j, s) order
        starts = (got_rows.cumsum(0) - got_rows).view(ranks, local)
        lengths = got.t().reshape(-1)  # (j, s) order
        seg_starts = starts.t().reshape(-1)
        total = sum(recv_splits)  # (known on the host: no further sync for the sizes below)
        offsets = torch.repeat_interleave(seg_starts - (lengths.cumsum(0) - lengths), lengths, output_size=total)
        regroup = torch.arange(total, device=xs.device) + offsets
        ys = expert_swiglu(rows[regroup], got.sum(0), w1, w3, w2, self.kernel)
        back = ys[regroup.argsort()]  # arrival order again
        return _AllToAll.apply(back, send_splits, recv_splits, group, self.clock)


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
        return grad, torch.full_like(aux, ctx.block.aux_weight * ctx.block.aux_share), None, None


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
        self.tp_mesh = None  # tensor parallelism's (`shard_tensor_parallel`)
        self.tp_layout = None  # the residual stream's placement over tp: Replicate, or Shard(1) under SP
        self.aux_share = 1.0  # this rank's share of the balance loss's gradient (1 / tp under tensor parallelism)
        self.aux_values: list[torch.Tensor] = []
        self.load: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, D) -> (probs (N, E) fp32, weights (N, k) in x's dtype, experts (N, k))."""
        if self.tp_mesh is None:
            logits = self.router(x)
        else:  # every tp rank routes the same tokens with the same (replicated) router; its gradient on each
            # rank is a partial sum (the rank's experts' share of the output), summed over tp as a Partial
            from torch.distributed.tensor import Partial

            logits = F.linear(x, self.router.weight.to_local(grad_placements=(Partial(),)))
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return probs, weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_mesh is not None:
            x = self._gather(x)
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        probs, weights, experts = self.route(flat)
        counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts)  # the experts' rows; the load
        out = self.experts(flat, experts, weights, counts)
        if self.shared is not None:
            out = out + (self.shared(flat) if self.tp_mesh is None else self._shared_partial(flat))
        if torch.is_grad_enabled():  # training: evaluation neither differentiates the loss nor counts the load
            aux = sequence_balance_loss(probs.view(b, t, -1), experts.view(b, t, -1), self.num_experts,
                                        self.sequence_group)
            out = _BalanceGradient.apply(out, aux, self, counts.float())
        out = out.view(b, t, d)
        return out if self.tp_mesh is None else self._reduce(out)

    # ---- tensor parallelism ----------------------------------------------------------------------------
    def shard_tensor_parallel(self, tp_mesh, layout) -> None:
        """Split this block over `tp_mesh` (Megatron's MLP split inside every expert): the experts' gate and
        up stacks (E, F, D) by F (Shard(1)), the down stack (E, D, F) by F (Shard(2)), a shared expert's gate
        and up by rows and down by columns; the router is replicated. Every tp rank routes the same tokens
        (the input is gathered over the sequence under sequence parallelism, `layout` Shard(1)), runs its F / tp
        slice of each chosen expert and sums a partial output, reduced over tp into `layout` (an all-reduce,
        or a reduce-scatter under SP); the input's gradient is likewise a partial sum reduced in backward.
        The balance loss, computed alike on every tp rank, gives each rank 1 / tp of its gradient
        (`aux_share`), so the reduction sums it once."""
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        def split(holder, placement) -> None:
            weight = holder.weight
            holder.weight = nn.Parameter(distribute_tensor(weight.detach(), tp_mesh, (placement,), src_data_rank=None),
                                         requires_grad=weight.requires_grad)

        gate, up, down = self.experts.stacks()
        for holder, placement in ((gate, Shard(1)), (up, Shard(1)), (down, Shard(2)), (self.router, Replicate())):
            split(holder, placement)
        if self.shared is not None:
            gate, up, down = self.shared.projections()
            for holder, placement in ((gate, Shard(0)), (up, Shard(0)), (down, Shard(1))):
                split(holder, placement)
        self.tp_mesh, self.tp_layout, self.aux_share = tp_mesh, layout, 1.0 / tp_mesh.size()

    def tensor_parallel_splits(self) -> dict[str, int | None]:
        """{parameter name in this module: which side of its (dim 0, the rest) view `shard_tensor_parallel`
        splits (0 rows, 1 the rest, None replicated)}: the planner's memory model (raydist.planner.memory)."""
        splits: dict[int, int | None] = {id(self.router.weight): None}
        splits.update({id(w.weight): 1 for w in self.experts.stacks()})  # F is in (F, D) or (D, F)
        if self.shared is not None:
            gate, up, down = self.shared.projections()
            splits.update({id(gate.weight): 0, id(up.weight): 0, id(down.weight): 1})
        return {name: splits[id(p)] for name, p in self.named_parameters()}

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream (in `tp_layout`) as the whole (B, T, D) on every tp rank; its gradient, a partial
        sum on each rank, is reduced back into the layout."""
        from torch.distributed.tensor import DTensor, Partial, Replicate

        whole = DTensor.from_local(x, self.tp_mesh, (self.tp_layout,), run_check=False)
        return whole.redistribute(placements=(Replicate(),)).to_local(grad_placements=(Partial(),))

    def _reduce(self, out: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial

        partial = DTensor.from_local(out, self.tp_mesh, (Partial(),), run_check=False)
        return partial.redistribute(placements=(self.tp_layout,)).to_local()

    def _shared_partial(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's SwiGLU on this rank's F / tp hidden units: a partial sum of its output."""
        gate, up, down = (_local(p.weight) for p in self.shared.projections())
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)

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


def take_all_to_all_seconds(module: nn.Module) -> float:
    """Seconds `module`'s expert-parallel all-to-alls took (forward and backward) since the last call."""
    return sum(block.experts.clock.take() for block in moe_blocks(module))
