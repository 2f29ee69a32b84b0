"""Each tensor-parallel layer against the plain layer (2 gloo ranks, fp32): the sharded forward equals the
plain output's slice for this rank, and backward gives the slices of the plain input and weight gradients.

Layers are parallelized with the plan's own styles (`tensor.block_plan`, `tensor.root_plan`), with and
without sequence parallelism; the head's fused vocabulary-parallel loss; then `apply_tensor_parallel` on a
whole GPT (tied and untied head, with the plan's vocabulary-parallel loss) and on two pipeline stages of
one. All cases run in one `spawn`; each test reads its case's outcome."""

from __future__ import annotations

import copy
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raydist.parallel.runtime import spawn

TP = 2
B, T, D, H, F_, V = 2, 8, 32, 4, 64, 40  # F_ ffn, V vocab; H heads of dim 8
LAYOUTS = ("replicate", "sequence")  # residual stream whole (plain TP) or split over T (SP)


def _close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """fp32 sums in a different order: relative 1e-4, absolute 1e-5 of the tensor's largest entry."""
    atol = 1e-5 * max(float(expected.abs().max()), 1e-3)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=atol, msg=lambda m: f"{what}: {m}")


def _local(full: torch.Tensor, placement, rank: int) -> torch.Tensor:
    """This rank's piece of `full` under `placement` (Replicate: all of it)."""
    if placement.is_replicate():
        return full
    return full.chunk(TP, dim=placement.dim)[rank]


def _check_layer(plain, sharded, x_full, in_placement, out_placement, *args):
    """Run plain and sharded forward + backward with the same output gradient; compare slices."""
    from torch.distributed.tensor import DTensor

    rank = torch.distributed.get_rank()
    xp = x_full.clone().requires_grad_(x_full.is_floating_point())
    yp = plain(xp, *args)
    g = torch.randn(yp.shape, generator=torch.Generator().manual_seed(3))
    (yp * g).sum().backward()

    xs = _local(x_full, in_placement, rank).clone().requires_grad_(x_full.is_floating_point())
    ys = sharded(xs, *args)
    ys = ys.to_local() if isinstance(ys, DTensor) else ys
    (ys * _local(g, out_placement, rank)).sum().backward()

    _close(ys, _local(yp.detach(), out_placement, rank), "forward")
    if xp.grad is not None:
        _close(xs.grad, _local(xp.grad, in_placement, rank), "input gradient")
    plain_grads = {n: p.grad for n, p in plain.named_parameters()}
    checked = 0
    for name, param in sharded.named_parameters():
        assert isinstance(param, DTensor), f"{name} was not distributed"
        grad = param.grad
        assert grad.placements == param.placements, f"{name}: gradient {grad.placements} vs {param.placements}"
        expected = _local(plain_grads[name], param.placements[0], rank)
        assert param.to_local().shape == expected.shape, f"{name}: local shape {param.to_local().shape}"
        _close(grad.to_local(), expected, f"gradient of {name}")
        checked += 1
    assert checked == len(plain_grads), (checked, sorted(plain_grads))


def _prefixed(plan: dict, prefix: str) -> tuple:
    """(style for the module itself, plan of its children) from a block plan's entries under `prefix`."""
    children = {k[len(prefix) + 1:]: v for k, v in plan.items() if k.startswith(prefix + ".")}
    return plan.get(prefix), children


def _cases(layout_name: str):
    """(name, plain module, sharding fn, input, in placement, out placement, extra forward args)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from raydist.config import ModelConfig
    from raydist.models.gpt import Attention, FeedForward, RMSNorm, TransformerBlock, block_roles, rope_tables
    from raydist.parallel.tensor import NormParallel, block_plan, root_plan

    layout = Shard(1) if layout_name == "sequence" else Replicate()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, D, generator=gen)
    cos, sin = rope_tables(D // H, T, 10000.0)

    def cfg(kv):
        return ModelConfig(num_layers=1, d_model=D, num_heads=H, num_kv_heads=kv, ffn_hidden=F_, vocab_size=V)

    def init(module):
        torch.manual_seed(1)
        for p in module.parameters():
            nn.init.normal_(p, 0.0, 0.3) if p.ndim > 1 else nn.init.uniform_(p, 0.5, 1.5)
        return module

    def sub(prefix, kv=2):
        def shard(module, mesh):
            from torch.distributed.tensor.parallel import parallelize_module

            own, children = _prefixed(block_plan(block_roles(cfg(kv)), cfg(kv), TP, layout), prefix)
            if own is not None:
                parallelize_module(module, mesh, own)
            parallelize_module(module, mesh, children)
        return shard

    def style(s):
        def shard(module, mesh):
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(module, mesh, s)
        return shard

    def whole_block(module, mesh):
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(module, mesh, block_plan(block_roles(cfg(2)), cfg(2), TP, layout))

    class Root(nn.Module):  # the plan's embedding style on its own
        def __init__(self):
            super().__init__()
            self.tok_embeddings, self.norm, self.output = nn.Embedding(V, D), None, None

        def forward(self, tokens):
            return self.tok_embeddings(tokens)

    tokens = torch.randint(0, V, (B, T), generator=gen)
    cases = [
        ("attention_norm", init(RMSNorm(D, 1e-5)), style(NormParallel(layout)), x, layout, layout, ()),
        ("wo_row", init(nn.Linear(D, D, bias=False)), style(RowwiseParallel(output_layouts=layout)), x,
         Shard(-1), layout, ()),
        ("mlp", init(FeedForward(cfg(2))), sub("feed_forward"), x, layout, layout, ()),
        ("attention_gqa", init(Attention(cfg(2))), sub("attention"), x, layout, layout, (cos, sin)),
        ("attention_kv_replicated", init(Attention(cfg(1))), sub("attention", kv=1), x, layout, layout, (cos, sin)),
        ("block", init(TransformerBlock(cfg(2))), whole_block, x, layout, layout, (cos, sin)),
        ("embedding", init(Root()), lambda m, mesh: style(root_plan({"tok_embeddings": "vocab_embedding"}, layout))(m, mesh), tokens, Replicate(),
         layout, ()),
    ]
    if layout_name == "replicate":  # the column split does not depend on the residual layout
        cases.insert(1, ("wq_column", init(nn.Linear(D, D, bias=False)), style(ColwiseParallel()), x,
                         Replicate(), Shard(-1), ()))
    return cases


def _cross_entropy_case(mesh, ignored: bool = False):
    """The vocabulary-parallel loss of sharded logits against F.cross_entropy of the whole logits; `ignored`:
    a third of the targets are IGNORE (prompt tokens), which add nothing while N stays all B T targets."""
    from torch.distributed.tensor import DTensor, Shard

    from raydist.models.loss import IGNORE
    from raydist.parallel.vocab_loss import vocab_parallel_cross_entropy

    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(5)
    logits = (4 * torch.randn(B, T, V, generator=gen)).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=gen)
    if ignored:
        targets[torch.rand(B, T, generator=gen) < 1 / 3] = IGNORE
    counted = targets[targets != IGNORE]
    assert set((counted // (V // TP)).flatten().tolist()) == {0, 1}  # targets on both ranks' columns
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE,
                               reduction="sum") / targets.numel()
    expected.backward()
    local = _local(logits.detach(), Shard(-1), rank).clone().requires_grad_()
    got = vocab_parallel_cross_entropy(DTensor.from_local(local, mesh, (Shard(-1),)), targets)
    got.backward()
    assert not isinstance(got, DTensor)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(local.grad, _local(logits.grad, Shard(-1), rank), rtol=1e-5, atol=1e-7)


def _fused_head_case(mesh, sequence_parallel: bool, rows: int | None = None):
    """The head's fused loss (`forward(x, targets)`) under the plan's column-parallel head style, against
    F.linear + cross_entropy of the whole logits: the loss (a plain scalar out of the style, the same on both
    ranks), the input's gradient in its layout (summed over tp: all-reduced, or reduce-scattered back to
    the sequence shards) and each rank's rows of the weight's gradient. With `rows`, the loss is called
    directly in chunks of `rows` tokens (not dividing B T) and a third of the targets are IGNORE."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from raydist.kernels.select import TorchLinear
    from raydist.models.loss import IGNORE, cross_entropy, linear_cross_entropy
    from raydist.parallel.tensor import root_plan

    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(9)
    plain = TorchLinear(D, V, bias=False)
    with torch.no_grad():
        plain.weight.copy_(torch.randn(V, D, generator=gen) / D ** 0.5)
    x = torch.randn(B, T, D, generator=gen)
    targets = torch.randint(0, V, (B, T), generator=gen)
    if rows:
        targets[torch.rand(B, T, generator=gen) < 1 / 3] = IGNORE
    xr = x.clone().requires_grad_()
    expected = cross_entropy(F.linear(xr, plain.weight), targets)
    expected.backward()
    layout = Shard(1) if sequence_parallel else Replicate()
    head = copy.deepcopy(plain)
    head.weight.grad = None
    parallelize_module(head, mesh, root_plan({"": "vocab_head"}, layout)[""])
    local = _local(x, layout, rank).clone().requires_grad_()
    if rows:
        h = DTensor.from_local(local, mesh, (layout,)).redistribute(placements=(Replicate(),))
        got = linear_cross_entropy(h, head.weight, targets, rows=rows)
    else:
        got = head(local, targets=targets)
    assert not isinstance(got, DTensor) and got.ndim == 0
    got.backward()
    _close(got, expected.detach(), "loss")
    _close(local.grad, _local(xr.grad, layout, rank), "input gradient")
    _close(head.weight.grad.to_local(), _local(plain.weight.grad, Shard(0), rank), "weight gradient rows")


def _model_config(tied: bool, sequence_parallel: bool):
    from raydist.config import Config
    from raydist.testing import tiny_config

    return Config.from_dict(tiny_config(
        "unused", seq_len=T, model={"num_layers": 2, "d_model": D, "num_heads": H, "num_kv_heads": 2,
                                    "ffn_hidden": F_, "vocab_size": V, "tie_embeddings": tied},
        parallel={"tp": TP, "dp_replicate": 1, "sequence_parallel": sequence_parallel}))


def _compare_models(plain, sharded_parts, loss_fn) -> None:
    """plain GPT vs the TP `sharded_parts` run one after another (one part: a whole model; two: pipeline
    stages): logits, loss and every parameter's full gradient by name."""
    from raydist.models.loss import cross_entropy

    gen = torch.Generator().manual_seed(2)
    tokens, targets = torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen)
    expected_logits = plain(tokens)
    expected = cross_entropy(expected_logits, targets)
    expected.backward()
    h = tokens
    for part in sharded_parts:
        h = part(h)  # between stages: a plain local tensor, (B, T/tp, D) under SP
    loss = loss_fn(h, targets)
    loss.backward()
    _close(h.full_tensor(), expected_logits.detach(), "logits")
    _close(loss, expected.detach(), "loss")
    plain_grads = {n: p.grad for n, p in plain.named_parameters()}
    got = {n: p.grad.full_tensor() for part in sharded_parts for n, p in part.named_parameters()}
    assert got.keys() == plain_grads.keys(), sorted(got)
    for name, grad in got.items():
        _close(grad, plain_grads[name], f"gradient of {name}")


def _pipeline_stages_case(sequence_parallel: bool) -> None:
    """The plan on pipeline stages: stage 0 (embedding, block 0) hands a local tensor to stage 1 (block 1,
    norm, head), which must still give RoPE the whole sequence's positions."""
    from raydist.parallel.mesh import MeshSpec
    from raydist.models.gpt import build_model
    from raydist.parallel.tensor import apply_tensor_parallel

    cfg = _model_config(False, sequence_parallel)
    plain = build_model(cfg.model, T, seed=0)
    first, last = build_model(cfg.model, T, seed=0), build_model(cfg.model, T, seed=0)
    first.norm = first.output = None
    del first.layers["1"]
    last.tok_embeddings = None
    del last.layers["0"]
    mesh = MeshSpec(tp=TP).build("cpu")
    apply_tensor_parallel(first, mesh, sequence_parallel)
    _compare_models(plain, [first, last], apply_tensor_parallel(last, mesh, sequence_parallel))


def _whole_model_case(tied: bool, sequence_parallel: bool) -> None:
    """`apply_tensor_parallel` on a whole GPT (embedding, blocks, final norm, tied or untied head, the
    plan's loss) against the plain model: logits, loss and every parameter's full gradient."""
    from raydist.parallel.mesh import MeshSpec
    from raydist.models.gpt import build_model
    from raydist.parallel.tensor import apply_tensor_parallel

    cfg = _model_config(tied, sequence_parallel)
    plain = build_model(cfg.model, T, seed=0)
    sharded = build_model(cfg.model, T, seed=0)
    loss_fn = apply_tensor_parallel(sharded, MeshSpec(tp=TP).build("cpu"), sequence_parallel)
    assert (sharded.output.weight is sharded.tok_embeddings.weight) == tied
    _compare_models(plain, [sharded], loss_fn)


def _run_cases() -> dict[str, str | None]:
    from torch.distributed.device_mesh import init_device_mesh

    from raydist.parallel.tensor import register_gradient_layout

    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    outcome: dict[str, str | None] = {}
    for layout_name in LAYOUTS:
        for name, plain, shard, x, in_p, out_p, args in _cases(layout_name):
            key = f"{name}-{layout_name}"
            try:
                sharded = copy.deepcopy(plain)
                shard(sharded, mesh)
                register_gradient_layout(sharded)
                _check_layer(plain, sharded, x, in_p, out_p, *args)
                outcome[key] = None
            except Exception:
                outcome[key] = traceback.format_exc()
    extra = [("cross_entropy", lambda: _cross_entropy_case(mesh)),
             ("cross_entropy_ignored", lambda: _cross_entropy_case(mesh, ignored=True)),
             ("fused_head_chunked_ignored", lambda: _fused_head_case(mesh, False, rows=5))] + [
        (f"fused_head-{layout_name}", lambda sp=layout_name == "sequence": _fused_head_case(mesh, sp))
        for layout_name in LAYOUTS] + [
        (f"model-{'tied' if tied else 'untied'}-{layout_name}",
         lambda tied=tied, sp=layout_name == "sequence": _whole_model_case(tied, sp))
        for tied in (True, False) for layout_name in LAYOUTS] + [
        (f"pipeline_stages-{layout_name}", lambda sp=layout_name == "sequence": _pipeline_stages_case(sp))
        for layout_name in LAYOUTS]
    for key, case in extra:
        try:
            case()
            outcome[key] = None
        except Exception:
            outcome[key] = traceback.format_exc()
    return outcome


@pytest.fixture(scope="module")
def outcomes():
    return spawn(_run_cases, TP)


CASES = ["wq_column-replicate"] + [f"{n}-{lay}" for lay in LAYOUTS for n in (
    "attention_norm", "wo_row", "mlp", "attention_gqa", "attention_kv_replicated", "block", "embedding")] + [
    "cross_entropy", "cross_entropy_ignored", "fused_head_chunked_ignored"] + [
    f"fused_head-{lay}" for lay in LAYOUTS] + [
    f"model-{tie}-{lay}" for tie in ("tied", "untied") for lay in LAYOUTS] + [
    f"pipeline_stages-{lay}" for lay in LAYOUTS]


@pytest.mark.parametrize("case", CASES)
def test_sharded_layer_matches_plain_slices(outcomes, case):
    for rank, outcome in enumerate(outcomes):
        assert case in outcome, f"case {case} did not run"
        assert outcome[case] is None, f"rank {rank}, {case}:\n{outcome[case]}"
    assert len(outcomes[0]) == len(CASES)
