"""Pipeline parallelism equals the single-process run (fp32, gloo, 6 AdamW steps, 1e-4 relative).

Layouts: PP2 and PP4 with GPipe, 1F1B, interleaved 1F1B (V=2) and the zero-bubble ZB-H1 and ZB-V (split
backward; ZB-V's V placement with the tied embedding on one rank); PP2 x DP2 (DDP per chunk); PP2 x
FSDP2; M < P with 1F1B; untied embeddings; and the data-parallel reduction runs exactly once per chunk per
step under a split backward too (PP2 x TP2 with the real tensor-parallel plan runs through the Trainer in
test_pipeline_trainer.py). Every layout of one world size runs in one `spawn` (each rank builds
the same seeded model, splits it, runs the executor on its dp slice of the same batches); the reference
is one process training the unsplit model on the whole batch.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist

from raydist.config import ConfigError, ModelConfig
from raydist.models.gpt import build_model
from raydist.models.loss import cross_entropy
from raydist.parallel.data_parallel import (apply_ddp, ddp_grad_sync, fsdp_grad_sync, fsdp_param_groups,
                                            fsdp_split_grad_sync)
from raydist.parallel.pipeline import TiedEmbeddingSync, clip_grad_norm_pipeline, split_model
from raydist.parallel.pipeline_executor import PipelineExecutor, stage_timings
from raydist.parallel.runtime import spawn
from raydist.schedule.registry import make_schedule, placement_of

CFG = ModelConfig(num_layers=4, d_model=32, num_heads=4, num_kv_heads=2, ffn_hidden=64, vocab_size=64)
# Six steps: the references' gradient norms fall both under and over CLIP (0.85-1.44; each reference has steps of
# both), and their losses fall by 0.18-0.29 (the check below asks 0.1); ten steps cost 7 s more of CPU.
SEQ, BATCH, STEPS, LR, CLIP = 16, 8, 6, 3e-3, 1.0


def model_config(num_layers: int = 4, tie: bool = True) -> ModelConfig:
    return dataclasses.replace(CFG, num_layers=num_layers, tie_embeddings=tie)


def token_batch(step: int) -> torch.Tensor:
    """(BATCH, SEQ + 1) learnable sequences: x_i = (start + i * stride) mod vocab, stride 1..3 per row."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, CFG.vocab_size, (BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % CFG.vocab_size


def make_optimizer(params) -> torch.optim.Optimizer:
    params = list(params)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=LR, betas=(0.9, 0.95))


def reference_run(cfg: ModelConfig) -> dict:
    """The unsplit model on the whole batch in one process."""
    model = build_model(cfg, SEQ, seed=0)
    opt = make_optimizer(model.parameters())
    losses, norms, grads = [], [], {}
    for step in range(STEPS):
        tokens = token_batch(step)
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        if step == STEPS - 1:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    with torch.no_grad():
        held_out = token_batch(STEPS)
        eval_loss = cross_entropy(model(held_out[:, :-1]), held_out[:, 1:]).item()
    return {"losses": losses, "norms": norms, "grads": grads, "eval_loss": eval_loss}


# ---- what each rank runs ----------------------------------------------------------------------------


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


# FSDP2's gradient reduce-scatter: `dist.reduce_scatter_single` since torch 2.13, `reduce_scatter_tensor` before
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


@contextlib.contextmanager
def _counting_reduce_scatter(counts: list[int]):
    """Count FSDP2's gradient reduce-scatters (its calls of `dist.<REDUCE_SCATTER>`) into counts[0]."""
    original = getattr(dist, REDUCE_SCATTER)

    def counted(*args, **kwargs):
        counts[0] += 1
        return original(*args, **kwargs)

    setattr(dist, REDUCE_SCATTER, counted)
    try:
        yield
    finally:
        setattr(dist, REDUCE_SCATTER, original)


def _run_layout(kind: str, pp: int, virtual: int, microbatches: int, dp_mode: str, num_layers: int,
                tie: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    inner = world // pp  # the data-parallel mesh axis inside a stage
    mesh = init_device_mesh("cpu", (pp, inner), mesh_dim_names=("pp", "dp"))  # pp outermost
    pp_rank = mesh.get_local_rank("pp")
    dp, dp_rank = inner, mesh.get_local_rank("dp")
    model = build_model(model_config(num_layers, tie), SEQ, seed=0)
    chunks = split_model(model, pp_rank, pp, virtual, placement=placement_of(kind))
    schedule = make_schedule(kind, pp, microbatches, virtual)
    modules, before, after = chunks, None, None
    reductions: list[int] = []  # per chunk: data-parallel gradient reductions in the current step
    if dp_mode == "ddp":  # the project's own wrappers, as Trainer applies them to each chunk
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        modules = [apply_ddp(c, mesh["dp"].get_group(), torch.device("cpu")) for c in chunks]
        for i, module in enumerate(modules):
            def counted(group, bucket, i=i):
                reductions[i] += 1
                return allreduce_hook(group, bucket)
            module.register_comm_hook(mesh["dp"].get_group(), counted)
        before = ddp_grad_sync(modules)
    elif dp_mode == "fsdp":
        from raydist.parallel.fsdp import apply_fsdp

        for c in chunks:
            apply_fsdp(c, mesh["dp"], torch.float32)
        if schedule.split_backward:
            after = fsdp_split_grad_sync(chunks)
        else:
            before = fsdp_grad_sync(chunks)
    tied = TiedEmbeddingSync(chunks, mesh["pp"].get_group())
    rows = BATCH // dp
    executor = PipelineExecutor(modules, schedule, pp_rank, mesh["pp"].get_group(),
                                activation_shape=(rows // microbatches, SEQ, CFG.d_model),
                                loss_fn=cross_entropy, before_backward=before, after_backward=after)
    params = [p for c in chunks for p in c.parameters()]
    opt = make_optimizer(params)
    losses, norms, grads, busy, per_step = [], [], {}, [], []
    for step in range(STEPS):
        tokens = token_batch(step)[dp_rank * rows:(dp_rank + 1) * rows]
        micro = tokens.chunk(microbatches)
        reductions[:] = [0] * len(chunks)
        with _counting_reduce_scatter(reductions):
            stats = executor.step([m[:, :-1] for m in micro], [m[:, 1:] for m in micro])
        per_step.append(list(reductions) if dp_mode == "ddp" else [sum(reductions)])
        tied()
        if step == STEPS - 1:
            grads = {n: _full(p.grad) for c in chunks for n, p in c.named_parameters()}
        norms.append(float(clip_grad_norm_pipeline(chunks, CLIP, mesh["pp"].get_group())))
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = stats.loss.clone()  # a device tensor: nothing in the step read it
        dist.all_reduce(loss, group=mesh["dp"].get_group())  # mean over dp (tp ranks hold equal losses)
        losses.append(float(loss) / inner)
        busy.append(stats.busy_s)
    [timings] = stage_timings([stats], mesh["pp"].get_group())
    held_out = token_batch(STEPS)[dp_rank * rows:(dp_rank + 1) * rows].chunk(microbatches)
    eval_loss = executor.evaluate([m[:, :-1] for m in held_out], [m[:, 1:] for m in held_out])
    dist.all_reduce(eval_loss, group=mesh["dp"].get_group())
    params_equal = True
    if tie and pp > 1:  # the two copies of the tied matrix stayed equal
        mine = [_full(p.data) for p in tied.params]  # empty on middle stages
        gathered: list = [None] * pp
        dist.all_gather_object(gathered, mine, group=mesh["pp"].get_group())
        copies = [t for part in gathered for t in part]
        params_equal = len(copies) == 2 and bool(torch.equal(copies[0], copies[1]))
    groups = 0  # FSDP2 parameter groups on this rank: one reduce-scatter each per step when synced once
    if dp_mode == "fsdp":
        groups = sum(len(fsdp_param_groups(m._get_fsdp_state())) for c in chunks for m in c.modules()
                     if hasattr(m, "_get_fsdp_state"))
    return {"losses": losses, "norms": norms, "grads": grads, "pp_rank": pp_rank, "reductions": per_step,
            "fsdp_groups": groups,
            "busy_s": busy, "tied_copies_equal": params_equal, "eval_loss": float(eval_loss) / inner,
            "timings": timings}


def _run_layouts(layouts: list[tuple]) -> list[dict]:
    return [_run_layout(*layout) for layout in layouts]


# ---- fixtures: one spawn per world size ---------------------------------------------------------------

PP2 = [("gpipe", 2, 1, 4, "none", 4, True), ("1f1b", 2, 1, 4, "none", 4, True),
       ("interleaved", 2, 2, 4, "none", 4, True), ("1f1b", 2, 1, 4, "none", 4, False),
       ("zbh1", 2, 1, 4, "none", 4, True), ("zbv", 2, 2, 4, "none", 4, True), ("zbv", 2, 2, 4, "none", 4, False)]
PP4 = [("gpipe", 4, 1, 4, "none", 8, True), ("1f1b", 4, 1, 4, "none", 8, True),
       ("interleaved", 4, 2, 4, "none", 8, True), ("1f1b", 4, 1, 2, "none", 8, True),  # M=2 < P=4
       ("zbh1", 4, 1, 4, "none", 8, True), ("zbv", 4, 2, 8, "none", 8, True),
       ("1f1b", 2, 1, 2, "ddp", 4, True), ("1f1b", 2, 1, 2, "fsdp", 4, True),
       ("interleaved", 2, 2, 2, "fsdp", 4, True), ("zbh1", 2, 1, 2, "ddp", 4, True),
       ("zbh1", 2, 1, 2, "fsdp", 4, True), ("zbv", 2, 2, 2, "ddp", 4, True), ("zbv", 2, 2, 2, "fsdp", 4, True)]


@pytest.fixture(scope="module")
def results():
    """{layout: per-rank results} for every layout, and the references by (num_layers, tie)."""
    out = {}
    for layouts, world in ((PP2, 2), (PP4, 4)):
        per_rank = spawn(_run_layouts, world, layouts, timeout_s=300)
        for i, layout in enumerate(layouts):
            out[layout] = [rank[i] for rank in per_rank]
    refs = {(n, tie): reference_run(model_config(n, tie)) for n, tie in {(l[5], l[6]) for l in PP2 + PP4}}
    return out, refs


def _check(results, layout) -> None:
    out, refs = results
    ref = refs[(layout[5], layout[6])]
    assert ref["losses"][-1] < ref["losses"][0] - 0.1, "the reference does not learn; the test would be weak"
    seen = set()
    for rank in out[layout]:
        torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=0)
        torch.testing.assert_close(torch.tensor(rank["norms"]), torch.tensor(ref["norms"]), rtol=1e-4, atol=0)
        assert rank["tied_copies_equal"]
        assert all(b > 0 for b in rank["busy_s"])
        assert rank["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-4)
        timings = rank["timings"]
        assert len(timings["pp_busy_s"]) == layout[1] and all(0 <= b < 1 for b in timings["pp_bubble"])
        for name, grad in rank["grads"].items():
            ref_name = "tok_embeddings.weight" if name == "output.weight" and layout[6] else name
            torch.testing.assert_close(grad, ref["grads"][ref_name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name: f"{layout} gradient of {n}: {m}")
            seen.add(ref_name)
    assert seen == set(ref["grads"]), f"parameters held by no rank: {set(ref['grads']) - seen}"


@pytest.mark.slow  # each case reads `results`, whose one spawn per world size trains every layout (~36 s)
@pytest.mark.timeout(400)  # (the first case pays `results`; its spawns have their own 300 s bounds)
@pytest.mark.parametrize("layout", PP2 + PP4, ids=lambda l: f"{l[0]}-pp{l[1]}-v{l[2]}-m{l[3]}-{l[4]}"
                         + ("" if l[6] else "-untied"))
def test_pipeline_equals_single_process(results, layout):
    _check(results, layout)


@pytest.mark.slow  # reads `results` (every layout trained in one spawn per world size)
@pytest.mark.timeout(400)  # (as above: the first case to run may pay `results`)
@pytest.mark.parametrize("layout", [l for l in PP4 if l[4] != "none"], ids=lambda l: f"{l[0]}-{l[4]}")
def test_data_parallel_reduces_once_per_chunk_per_step(results, layout):
    """DDP: exactly one bucket all-reduce per chunk per step (the tiny chunks fit one bucket), counted by a
    comm hook; FSDP: one reduce-scatter per FSDP parameter group per step. With a split backward the
    weight gradients arrive in W, outside FSDP's backward hooks: the reduction must still run, once."""
    for rank in results[0][layout]:
        for counts in rank["reductions"]:
            if layout[4] == "ddp":
                assert counts == [1] * layout[2], rank["reductions"]
            else:
                assert counts == [rank["fsdp_groups"]] and rank["fsdp_groups"] > 0, rank["reductions"]


# ---- splitting (single process) -----------------------------------------------------------------------


@pytest.mark.parametrize("pp,virtual,placement", [(2, 1, "loop"), (4, 1, "loop"), (2, 2, "loop"), (1, 2, "loop"),
                                                   (2, 2, "v"), (4, 2, "v")])
def test_chunks_compose_to_the_full_model(pp, virtual, placement):
    """Running the chunks in stage order equals the unsplit model; names and parameters are a partition.
    Under the V placement rank r holds stages r and 2P - 1 - r: rank 0 the first and the last."""
    model = build_model(model_config(8), SEQ, seed=0)
    tokens = token_batch(0)[:, :-1]
    expected = model(tokens)
    names = {n for n, _ in model.named_parameters()}
    all_chunks = [split_model(build_model(model_config(8), SEQ, seed=0), r, pp, virtual, placement=placement)
                  for r in range(pp)]
    at = {}  # stage -> (rank, chunk index)
    for r in range(pp):
        stages = [r, 2 * pp - 1 - r] if placement == "v" else [c * pp + r for c in range(virtual)]
        at.update({stage: (r, c) for c, stage in enumerate(stages)})
    h = tokens
    held = set()
    for stage in range(pp * virtual):
        rank, c = at[stage]
        chunk = all_chunks[rank][c]
        h = chunk(h)
        held |= {n for n, _ in chunk.named_parameters()}
    torch.testing.assert_close(h, expected, rtol=0, atol=0)
    assert held - {"output.weight"} == names
    first, last = all_chunks[0][0], all_chunks[at[pp * virtual - 1][0]][-1]
    if placement == "v":
        assert last is all_chunks[0][1]  # the V comes back to rank 0
    assert first.tok_embeddings is not None and first.norm is None
    assert last.output is not None and last.tok_embeddings is None
    if pp > 1:
        assert last.output.weight is not first.tok_embeddings.weight  # a copy on another rank
        torch.testing.assert_close(last.output.weight, first.tok_embeddings.weight, rtol=0, atol=0)
    else:
        assert last.output.weight is first.tok_embeddings.weight  # one rank: one shared matrix


def test_partition_balances_and_rejects_too_many_stages():
    from raydist.parallel.pipeline import partition_layers

    model = build_model(model_config(8), SEQ, seed=0)
    parts = partition_layers(model, 4, "params")
    assert [k for p in parts for k in p] == [str(i) for i in range(8)] and all(parts)
    # A huge vocabulary makes the embedding and head stages heavy: they get fewer blocks.
    big = build_model(dataclasses.replace(model_config(8), vocab_size=4096), SEQ, seed=0)
    sizes = [len(p) for p in partition_layers(big, 4, "params")]
    assert sizes[0] < sizes[1] and sizes[-1] < sizes[1], sizes
    # FLOPs: the embedding lookup is free, so the first stage takes more blocks than the last.
    sizes = [len(p) for p in partition_layers(big, 4, "flops")]
    assert sizes[0] > sizes[-1], sizes
    with pytest.raises(ConfigError, match="num_layers=8 is less than pp x virtual_stages=16"):
        split_model(model, 0, 4, 4)
    with pytest.raises(ConfigError, match="balance='time' is not one of params, flops"):
        partition_layers(model, 2, "time")


def test_executor_rejects_mismatches():
    model = build_model(model_config(4), SEQ, seed=0)
    chunks = split_model(model, 0, 1, 2)
    schedule = make_schedule("interleaved", 1, 2, 2)
    with pytest.raises(ConfigError, match="got 1 chunks for a schedule with virtual_stages=2"):
        PipelineExecutor(chunks[:1], schedule, 0, None, activation_shape=(2, SEQ, 32), loss_fn=cross_entropy)
    executor = PipelineExecutor(chunks, schedule, 0, None, activation_shape=(4, SEQ, 32), loss_fn=cross_entropy)
    with pytest.raises(ConfigError, match="needs 2 input micro-batches, got 1"):
        executor.step([token_batch(0)[:4, :-1]], None)
    with pytest.raises(ConfigError, match="use M=4 or 8"):
        make_schedule("interleaved", 4, 6, 2)


def test_single_rank_interleaved_equals_plain_model():
    """P=1, V=2: chunks hand tensors over in memory; loss and gradients equal the plain model's."""
    model = build_model(model_config(4), SEQ, seed=0)
    tokens = token_batch(0)
    loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    chunks = split_model(build_model(model_config(4), SEQ, seed=0), 0, 1, 2)
    executor = PipelineExecutor(chunks, make_schedule("interleaved", 1, 4, 2), 0, None,
                                activation_shape=(2, SEQ, 32), loss_fn=cross_entropy)
    micro = tokens.chunk(4)
    stats = executor.step([m[:, :-1] for m in micro], [m[:, 1:] for m in micro])
    assert float(stats.loss) == pytest.approx(loss.item(), rel=1e-5)
    got = {n: p.grad for c in chunks for n, p in c.named_parameters()}
    assert got.pop("output.weight") is got["tok_embeddings.weight"]  # one shared matrix on one rank
    assert set(got) == set(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6)
