"""Step time of a layout: compute, recompute, the pipeline bubble and each parallelism's communication.

Collectives (Hockney 1994's alpha-beta model; the bandwidth terms of the ring algorithms, Thakur,
Rabenseifner & Gropp 2005 and Patarasuk & Yuan 2009; n = bytes of the full tensor, p ranks):
    all-reduce        alpha * ceil(log2 p) + 2 (p-1)/p * n / beta
    all-gather, reduce-scatter, all-to-all
                      alpha * ceil(log2 p) + (p-1)/p * n / beta
    point-to-point    alpha + n / beta
beta is the intra-node link when the group's ranks share a node, else the inter-node one: the mesh is
(pp, dp_replicate, dp_shard, cp, tp) with tp innermost, so a group of degree d whose inner degrees
multiply to `stride` spans d * stride consecutive ranks.

Per step, per rank (the busiest pipeline stage), with m micro-batches of b samples:
- compute: model FLOPs (6 N_matmul + 12 L h T per token, raydist.models.gpt.flops_per_token) on this
  rank's share, at peak * compute_efficiency; full / every_k recompute add one forward of the blocks (a
  third of their FLOPs); selective re-runs only elementwise ops: their bytes over memory bandwidth.
  A CPU calibration of the workload (`raydist plan CONFIG --calibrate`) replaces the efficiency with the
  measured rate, adds the measured fixed cost per block per micro-batch, and takes the measured recompute
  ratio per policy where it exceeds the analytic cost.
- data parallel (Li et al. 2020 for DDP; Rajbhandari et al. 2020 (ZeRO) and Zhao et al. 2023 (PyTorch FSDP)
  for the sharded volume): DDP all-reduces the fp32 gradients once per step (2 (p-1)/p x 4N bytes); FSDP
  all-gathers the parameters in forward and again in backward (when resharding) for every micro-batch and
  reduce-scatters the gradients once (no-sync accumulation; per micro-batch in a pipeline): about 3x the
  parameter bytes (ZeRO-3's 3 Psi against DP's 2 Psi); HSDP adds an all-reduce of the shards across replicas.
  A fraction `comm_overlap` of it hides behind compute (FSDP prefetch, DDP buckets), all but the first
  unit's all-gather and the last unit's reduce-scatter (DDP: its last bucket), which nothing overlaps.
- tensor parallel (Shoeybi et al. 2019, Megatron-LM; Korthikanti et al. 2022 for sequence parallelism): 2
  all-reduces of the block's activations (b s h) in forward and 2 in backward; with sequence parallelism each
  becomes an all-gather + reduce-scatter (same bytes, twice the latency); the forward's are repeated by
  recompute. On the critical path. A CPU calibration times the model split over tp ranks against one
  rank's whole model (`tp_factors`); where that measured ratio says more, the tp term is what it adds over
  the analytic compute (on CPU each DTensor op pays Python dispatch, and without sequence parallelism every
  rank repeats the norms, residuals and loss: a profiled TP 2 step of the default workload waited on 38
  functional collectives and ran about 6,000 DTensor wrapper calls).
- context parallel: ring passes the local K/V block to the next rank cp-1 times in forward and twice as
  much (K/V and their gradients) in backward, overlapped with the attention it feeds; its attention runs as
  cp blocks of T / cp keys for T / cp queries, at the kernel rate measured at length T / cp (at 8B, T 8192,
  cp 8: 0.70 of the peak for 1024-long calls, against 0.89 for one 8192-long call). Ulysses all-to-alls
  q, k, v and the output in forward and backward, not overlapped, and attends over the whole sequence.
- expert parallel (Lepikhin et al. 2020, GShard): each MoE block all-to-alls the k routed copies of each
  token (b s k h) out to the experts' ranks and the outputs back, in forward and again in backward (and in
  recompute), over ep ranks of stride cp x tp; on the critical path. The experts' FSDP all-gathers then move
  E / ep experts over dp_shard / ep x cp ranks.
- pipeline: one activation send per micro-batch per boundary each way (T / cp tokens, a tp-th of them
  under sequence parallelism); bubble fraction (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m+p-1)
  interleaved with v chunks per rank (Huang et al., "GPipe", 2019; Narayanan et al. 2021; an idle share
  p/(p+k) counts the same bubble from the other side), and for the zero-bubble schedules (Qi et al.,
  "Zero Bubble Pipeline Parallelism", ICLR 2024) at F = B = W: (p-1)/(3m+p-1) for ZB-H1, (p-1)/(6m+p-1)
  for ZB-V (`schedule.timeline`).
- optimizer: AdamW and the gradient clip read and write ~36 bytes per locally trained element, bound by
  memory bandwidth.

Parameter-efficient fine-tuning (the workload's [peft]; what trains: memory.py). A frozen weight the
gradient still flows through (LoRA's base weights; a head frozen by lora, or tied under freeze) skips its
weight-gradient GEMM: its matmuls cost 4 FLOPs per element and token instead of 6, so a LoRA block's
matmuls cost 4 N_block + 6 N_adapters, N_adapters the rank's A and B elements (A replicated under a
column-parallel W and B under a row-parallel one, so adapters are not divided by tp); attention's QK^T and
AV keep their backward (the input gradient needs it). Under freeze the blocks before the last k build no
graph: one forward each (compute, tensor- and context-parallel traffic), no backward and no recompute.
The DP all-reduce and the FSDP reduce-scatters carry the trained elements only (4 N_trained bytes; the
all-gathers still carry every held weight), over the units that train. MFU's model FLOPs are the method's
(`training_flops_per_token`). Not modelled: the zero-bubble schedules' bubbles assume F = B = W, and
LoRA's W is nearly empty.
"""

from __future__ import annotations

import math
from dataclasses import replace

from raydist.models.gpt import flops_per_token, param_counts
from raydist.planner.hardware import Hardware, Link
from raydist.planner.memory import (adapter_elements, block_activation_bytes, block_selective_bytes,
                                    expert_elements, mlp_hidden, stage_elements, stage_trained_elements,
                                    trained_root_parts, trained_unit_elements)
from raydist.planner.placement import Layout, Workload, holders, rank_layer_counts, trained_layer_counts
from raydist.schedule.registry import schedule_kind
from raydist.schedule.timeline import theoretical_bubble

DDP_BUCKET_BYTES = 25 * 2**20
OPTIMIZER_BYTES_PER_ELEMENT = 36.0


def _log2(p: int) -> int:
    return max(1, math.ceil(math.log2(p))) if p > 1 else 0


def all_reduce_s(n_bytes: float, p: int, link: Link) -> float:
    return 0.0 if p <= 1 else link.alpha_s * _log2(p) + 2 * (p - 1) / p * n_bytes / link.beta_bytes_per_s


def all_gather_s(n_bytes: float, p: int, link: Link) -> float:
    """Also reduce-scatter and all-to-all: each rank moves (p-1)/p of the full tensor."""
    return 0.0 if p <= 1 else link.alpha_s * _log2(p) + (p - 1) / p * n_bytes / link.beta_bytes_per_s


def p2p_s(n_bytes: float, link: Link) -> float:
    return link.alpha_s + n_bytes / link.beta_bytes_per_s


def crosses_nodes(degree: int, stride: int, hw: Hardware) -> bool:
    return degree * stride > hw.gpus_per_node


def bubble_fraction(lay: Layout, num_microbatches: int) -> float:
    """Idle / step on each rank: `raydist.schedule.timeline.theoretical_bubble` (exact for the executor's
    schedules at F = B = W, a transformer's split backward: B + W = 2 F)."""
    if lay.pp == 1:
        return 0.0
    return float(theoretical_bubble(lay.pp_schedule, lay.pp, num_microbatches, lay.virtual_stages))


def step_time(w: Workload, lay: Layout, hw: Hardware, num_microbatches: int,
              per_op_recompute: float | None = None) -> dict[str, float]:
    """Seconds per optimizer step by term; 'total' is the estimate, 'model_flops' this rank's share.

    per_op_recompute: price a per-op recompute policy (not one raydist runs: a published run's, such as
    torchtitan's, `torchtitan_op_sac_share`) in place of the layout's: this share of each block's forward
    matmul FLOPs, and every forward elementwise op, re-run in backward; attention is saved."""
    m_cfg, a = w.model, w.compute_dtype_bytes
    m = num_microbatches
    tokens = lay.micro_batch * w.seq_len / lay.cp  # per micro-batch on this rank
    h, tp, cp = m_cfg.d_model, lay.tp, lay.cp
    counts = param_counts(m_cfg)
    stage_layers = rank_layer_counts(w, lay)
    trained_layers = trained_layer_counts(w, lay)  # blocks in the autograd graph (all but freeze's prefix)
    layers = max(stage_layers)

    def busiest(cost) -> float:
        """The largest cost(blocks, blocks in the graph) over the pipeline ranks."""
        return max(cost(n, t) for n, t in zip(stage_layers, trained_layers))
    rate = hw.peak_flops * hw.compute_efficiency
    # ring attention runs cp x cp blocks of T / cp queries and keys each, so its kernels run at the rate of
    # that length (Ulysses attends over the whole sequence with H / cp heads on each rank)
    kernel_len = w.seq_len // cp if cp > 1 and lay.cp_impl == "ring" else w.seq_len
    attention_rate = hw.peak_flops * hw.attention_share(kernel_len)
    bandwidth = hw.memory_bandwidth_bytes_per_s

    # ---- compute per micro-batch on the busiest stage ----------------------------------------------------
    def compute_terms(tp: int) -> tuple[float, float, float, float, float]:
        """(seconds of one micro-batch's compute, of a block's forward, of its matmuls' forward, of its
        adapters' forward, a block's elementwise bytes) on the busiest rank, its matmuls split tp ways.
        Forward seconds of one block and of the head (with the loss); forward + backward is 3x the FLOPs and
        the elementwise bytes of elementwise_bytes(), less the weight-gradient GEMMs of frozen weights."""
        split = lay if tp == lay.tp else replace(lay, spec=replace(lay.spec, tp=tp), sequence_parallel=False)
        matmul_fwd = 2 * tokens * counts["block_matmul"] / tp / rate
        block_fwd = matmul_fwd + 4 * tokens * w.seq_len * h / tp / attention_rate
        head_fwd = 2 * tokens * m_cfg.vocab_size * h / tp / rate
        adapter_fwd = 2 * tokens * adapter_elements(w, tp) / rate  # LoRA's x A^T and (x A^T) B^T
        frozen_weight_grads = matmul_fwd if w.peft.method == "lora" else 0.0
        block_moved = head_moved = 0.0
        if hw.elementwise:
            block_moved, head_moved = elementwise_bytes(w, split, tokens)
        # the busiest rank: its blocks, plus the head on the rank holding the last stage (every rank's
        # blocks, and the head's holders' blocks plus the head: the same maximum, without asking each of up
        # to a hundred pipeline ranks whether it holds the head)
        block_s = 3 * block_fwd + (3 * adapter_fwd - frozen_weight_grads) + block_moved / bandwidth
        forward_only_s = block_fwd + block_moved / 3 / bandwidth  # freeze's frozen prefix
        head_s = ((3 if "head" in trained_root_parts(m_cfg, w.peft.method) else 2) * head_fwd
                  + head_moved / bandwidth)

        def blocks_s(n: int, t: int) -> float:
            return t * block_s + (n - t) * forward_only_s

        compute = (max(busiest(blocks_s), *(blocks_s(stage_layers[r], trained_layers[r]) + head_s
                                            for r in holders(lay, "last")))
                   + (layers + 1) * hw.block_overhead_s + weight_cast_bytes(w, split, counts["total"]) / bandwidth)
        return compute, block_fwd, matmul_fwd, adapter_fwd, block_moved

    compute_mb, block_fwd, matmul_fwd, adapter_fwd, block_moved = compute_terms(tp)
    recompute_mb = 0.0
    policy = lay.activation_checkpoint
    recomputed = max(trained_layers)  # (frozen blocks outside the graph are not recomputed)
    if per_op_recompute is not None:
        recompute_mb = recomputed * (per_op_recompute * matmul_fwd + block_moved / 3 / bandwidth)
    elif policy in ("full", "every_k"):
        recompute_mb = recomputed * (block_fwd + adapter_fwd + block_moved / 3 / bandwidth)
    elif policy == "selective":  # the elementwise ops full training re-runs (LoRA's frozen ones too)
        base = w.fully_trained()
        elementwise = block_activation_bytes(base, lay) - block_selective_bytes(base, lay)
        recompute_mb = recomputed * 2 * max(0.0, elementwise) / hw.memory_bandwidth_bytes_per_s
    if per_op_recompute is None and policy != "none" and hw.recompute_factors and policy in hw.recompute_factors:
        # measured on this machine; never below the work the policy must redo (a noisy calibration can
        # time the recomputing model faster than the plain one)
        recompute_mb = max(recompute_mb, hw.recompute_factors[policy] * compute_mb)

    # ---- tensor parallel ------------------------------------------------------------------------------------
    tp_mb = tp_measured_mb = 0.0  # (the measured part scales with the compute rate: from_run's fit)
    if tp > 1:
        link = hw.link(crosses_nodes(tp, 1, hw))
        act = a * tokens * h
        one = 2 * all_gather_s(act, tp, link) if lay.sequence_parallel else all_reduce_s(act, tp, link)
        per_block_fwd = 2 * one
        refwd = lay.activation_checkpoint != "none"
        tp_mb = busiest(lambda n, t: t * per_block_fwd * (2 + (1 if refwd else 0))
                        + (n - t) * per_block_fwd) + 2 * one  # + embedding / head
        measured = (hw.tp_factors or {}).get(str(tp))
        if measured:  # on CPU (--calibrate): what tp ranks together took over one rank's unsplit model
            over = measured * compute_terms(1)[0] - compute_mb
            if over > tp_mb:
                tp_mb = tp_measured_mb = over

    # ---- context parallel ----------------------------------------------------------------------------------
    cp_mb = 0.0
    if cp > 1:
        link = hw.link(crosses_nodes(cp, tp, hw))
        kv_bytes = 2 * a * tokens * m_cfg.num_kv_heads * w.head_dim / tp
        if lay.cp_impl == "ring":
            ring = 3 * (cp - 1) * p2p_s(kv_bytes, link)
            attention_time = 3 * 4 * tokens * w.seq_len * h / tp / rate
            cp_mb = busiest(lambda n, t: t * max(0.0, ring - attention_time)
                            + (n - t) * max(0.0, ring / 3 - attention_time / 3))
        else:
            qkvo = a * tokens * (2 * h + 2 * m_cfg.num_kv_heads * w.head_dim) / tp
            cp_mb = busiest(lambda n, t: t * 2 * all_gather_s(qkvo, cp, link) + (n - t) * all_gather_s(qkvo, cp, link))

    # ---- expert parallel -----------------------------------------------------------------------------------
    ep_mb = 0.0
    if lay.ep > 1:
        link = hw.link(crosses_nodes(lay.ep, cp * tp, hw))
        one = all_gather_s(a * tokens * m_cfg.moe_top_k * h, lay.ep, link)  # dispatch or combine
        refwd = lay.activation_checkpoint != "none"
        ep_mb = busiest(lambda n, t: t * 2 * one * (2 + (1 if refwd else 0)) + (n - t) * 2 * one)

    # ---- pipeline ------------------------------------------------------------------------------------------
    pp_mb = 0.0
    if lay.pp > 1:
        sp = tp if lay.sequence_parallel and tp > 1 else 1
        link = hw.link(crosses_nodes(lay.pp, lay.world_size // lay.pp, hw))
        v = lay.virtual_stages
        pp_mb = 2 * v * p2p_s(a * tokens * h / sp, link)

    per_mb = compute_mb + recompute_mb + tp_mb + cp_mb + ep_mb + pp_mb
    bubble = bubble_fraction(lay, m)
    pipeline_total = per_mb * m / (1 - bubble)
    bubble_s = pipeline_total - per_mb * m

    # ---- data parallel -------------------------------------------------------------------------------------
    # gathers move every held element, gradient reductions the trained ones, over the units that train
    trained_local = stage_trained_elements(w, lay, 0) if lay.pp == 1 else max(
        stage_trained_elements(w, lay, 0), stage_trained_elements(w, lay, lay.pp - 1))
    n_unsharded = stage_elements(w, lay, 0, sharded=False)
    trained_blocks, trained_block, trained_root = trained_unit_elements(w, lay, 0, sharded=False)
    trained_unsharded = trained_blocks * trained_block + trained_root
    units = layers + 1
    grad_units = max(trained_layers) + (trained_root > 0)
    dp_s = edge_s = 0.0  # edge: what no compute can hide (the first gather, the last gradient reduction)
    kind = lay.data_parallel_kind
    if kind == "ddp":
        p = lay.dp_replicate * cp
        link = hw.link(crosses_nodes(p, tp, hw))
        grad = 4.0 * trained_unsharded
        buckets = max(1, math.ceil(grad / DDP_BUCKET_BYTES))
        dp_s = all_reduce_s(grad, p, link) + (buckets - 1) * link.alpha_s * _log2(p)
        edge_s = all_reduce_s(min(grad, DDP_BUCKET_BYTES), p, link)
    elif kind in ("fsdp", "hsdp"):
        s = lay.fsdp_size
        link = hw.link(crosses_nodes(s, tp, hw))
        reduce_scatters = m if lay.pp > 1 else 1
        per_unit_param = n_unsharded / units
        per_unit_grad = trained_unsharded / grad_units
        ag = all_gather_s(a * per_unit_param, s, link) * units
        rs = all_gather_s(4.0 * per_unit_grad, s, link) * grad_units
        if lay.ep > 1:  # a block's experts: E / ep of them over s / ep ranks, not all E over s
            held = expert_elements(m_cfg)
            ag += layers * (all_gather_s(a * held / lay.ep, s // lay.ep, link) - all_gather_s(a * held, s, link))
            if w.peft.method != "lora":  # (LoRA freezes the experts: no gradient to reduce)
                rs += max(trained_layers) * (all_gather_s(4.0 * held / lay.ep, s // lay.ep, link)
                                             - all_gather_s(4.0 * held, s, link))
        dp_s = ag * fsdp_gathers_per_step(lay, m) + rs * reduce_scatters
        edge_s = ag / units + rs / grad_units
        if lay.dp_replicate > 1:
            rlink = hw.link(crosses_nodes(lay.dp_replicate, tp * s, hw))
            replicas = all_reduce_s(4.0 * per_unit_grad / s, lay.dp_replicate, rlink)
            dp_s += replicas * grad_units * reduce_scatters
            edge_s += replicas
    compute_all = (compute_mb + recompute_mb) * m
    # overlap hides the rest behind compute (FSDP's prefetch, DDP's buckets), but not the first unit's
    # gather, before any compute, nor the last unit's reduction, after the last backward
    dp_exposed = dp_s - hw.comm_overlap * min(max(0.0, dp_s - edge_s), compute_all)

    optimizer_s = OPTIMIZER_BYTES_PER_ELEMENT * trained_local / hw.memory_bandwidth_bytes_per_s
    total = pipeline_total + dp_exposed + optimizer_s
    model_flops = training_flops_per_token(w) * w.tokens_per_step / lay.world_size
    return {
        "compute": compute_mb * m, "recompute": recompute_mb * m, "bubble": bubble_s,
        "tp_comm": tp_mb * m, "tp_measured": tp_measured_mb * m, "cp_comm": cp_mb * m, "ep_comm": ep_mb * m,
        "pp_comm": pp_mb * m,
        "dp_comm": dp_s, "dp_comm_exposed": dp_exposed, "optimizer": optimizer_s,
        "bubble_fraction": bubble, "total": total, "model_flops": model_flops,
    }


def fsdp_gathers_per_step(lay: Layout, m: int) -> int:
    """All-gathers of each FSDP unit per step over `m` micro-batches, as the runtime runs them: resharding
    after forward gathers again for backward (2 per micro-batch); otherwise once per micro-batch (resharded
    after each backward), except a pipeline without a split backward, whose chunks stay gathered from their
    first forward to their last backward (raydist.parallel.data_parallel.fsdp_grad_sync): once per step."""
    if lay.fsdp_reshard_after_forward:
        return 2 * m
    if lay.pp > 1 and not schedule_kind(lay.pp_schedule).split_backward:
        return 1
    return m


def elementwise_bytes(w: Workload, lay: Layout, tokens: float) -> tuple[float, float]:
    """Bytes the memory-bound work of one micro-batch moves on a rank, forward and backward: (per block,
    the head's loss).

    raydist's blocks run their elementwise work as eager PyTorch (raydist.models.gpt, as torchtitan's Llama
    does without torch.compile): every op is its own kernel, which reads its inputs from memory and writes
    its output back. Per element of the op's input, with a the compute dtype's bytes and r the residual
    stream's (fp32 under autocast; the compute dtype under FSDP's mixed-precision policy, whose bf16
    weights make the embedding's output bf16), `up` = 4 + a for a cast to fp32 or back (0 when r is 4):
    - RMSNorm, `x * rsqrt(mean(x^2) + eps)` in fp32 then `* weight`: the cast up, pow (8), mean (4), the
      product (8), the cast back and the weight's product (2 r): 20 + 2 up + 2 r. Under autocast each
      Linear that reads a norm's fp32 output casts it again (4 + a): q, k and v after the first norm,
      gate and up after the second, over the whole width on every tensor-parallel rank (with sequence
      parallelism too: the block's input is gathered to Replicate, in fp32, before the projections);
    - RoPE on q and k (apply_rope: cast up, four products and a sum and a difference of half-width
      views, the stack, the cast back): 36 + 2 up;
    - two residual adds (read r and a, write r): 2 (2 r + a);
    - SwiGLU, silu(gate) * up: 5 a per hidden element.
    (Attention's transposes are views: SDPA reads q, k, v strided and writes its output in the layout the
    output projection reads.) The backward's kernels move about twice the forward's bytes (each reads the
    output's gradient and a saved input, writes the input's gradient, and sums the gradients of a tensor
    read twice), so forward + backward is 3x. Without sequence parallelism every tensor-parallel rank
    repeats the norms and residual adds over the whole width; with it each takes 1/tp of the tokens; the
    heads and the hidden width are split tp ways either way.

    Measured against (one H100 80GB SXM, benchmarks/results/gpu_suite_h100.json): the suite's 4-block
    Llama-3-8B-shaped stack at T 8192 under autocast stepped in 190 ms; priced at 165 ms when the forward
    was counted at one read and write per fused op (422 kB per token and block), at 177 ms now (823 kB).

    The loss: the logits cast up to fp32, log-softmax, its gradient and the cast back, 24 V + 2 a V per
    token (V / tp under tensor parallelism)."""
    m, a = w.model, w.compute_dtype_bytes
    r = a if lay.fsdp_size > 1 else 4
    up = 0 if r == 4 else 4 + a
    cast_in = 4 + a if (r == 4 and a < 4) else 0
    width = m.d_model / (lay.tp if lay.sequence_parallel and lay.tp > 1 else 1)  # norms, residual adds
    qk = (m.num_heads + m.num_kv_heads) * w.head_dim / lay.tp
    f = mlp_hidden(m) / lay.tp
    norms = 2 * (20 + 2 * up + 2 * r) * width + 5 * cast_in * m.d_model
    rope = (36 + 2 * up) * qk
    forward = norms + rope + 2 * (2 * r + a) * width + 5 * a * f
    loss = (24 + 2 * a) * m.vocab_size / lay.tp
    return 3 * forward * tokens, loss * tokens


def weight_cast_bytes(w: Workload, lay: Layout, params: int) -> float:
    """Bytes of one micro-batch's bf16 casts of this rank's fp32 weights (autocast casts each weight at each
    use: read 4, write 2) and its gradients' accumulation into fp32 (read 2 + 4, write 4): 6 per held
    element and 10 more per trained one (16 per element in full training); none in fp32, and none under
    FSDP, whose mixed-precision policy casts each shard once per all-gather and keeps the gradients in the
    compute dtype until the reduction. `params`: the model's total (LoRA's adapters not included)."""
    if w.compute_dtype_bytes >= 4 or lay.fsdp_size > 1:
        return 0.0
    held = params + w.model.num_layers * adapter_elements(w, 1)
    return (6.0 * held + 10.0 * (held - frozen_parameters(w))) / (lay.tp * lay.pp)


def frozen_parameters(w: Workload) -> int:
    """Parameters the method freezes (raydist.models.peft): none; every base weight under lora; under freeze
    the blocks before the last k and the embedding (a tied head with it)."""
    counts = param_counts(w.model)
    if w.peft.method == "lora":
        return counts["total"]
    if w.peft.method == "freeze":
        return (w.model.num_layers - w.peft.trainable_last_layers) * counts["per_block"] + counts["embedding"]
    return 0


def training_flops_per_token(w: Workload) -> float:
    """MFU's model FLOPs per token for the workload's method: `flops_per_token` (6 N_matmul + 12 L H E T)
    under none. LoRA's frozen base weights and head skip their weight-gradient GEMMs (2 FLOPs per element
    less) and its adapters add 6 per element; freeze's frozen blocks run forward only (4 per matmul element
    and 8 H E T of attention less), its head skips the weight gradient when tied."""
    m, peft = w.model, w.peft
    full = flops_per_token(m, w.seq_len)
    if peft.method == "none":
        return full
    counts = param_counts(m)
    frozen_head = 0.0 if "head" in trained_root_parts(m, peft.method) else 2.0 * m.vocab_size * m.d_model
    if peft.method == "lora":
        return full - m.num_layers * (2.0 * counts["block_matmul"] - 6.0 * adapter_elements(w, 1)) - frozen_head
    frozen_blocks = m.num_layers - peft.trainable_last_layers
    return full - frozen_blocks * (4.0 * counts["block_matmul"] + 8.0 * m.q_width * w.seq_len) - frozen_head
