"""Mixture of experts (raydist.models.moe): the layer against a dense reference written from the formula,
the sequence-wise balance loss, Qwen3-MoE and Mixtral against `transformers` (logits, export, greedy
generation), and training under data parallelism and FSDP equal to the single process with the balance
loss on (losses, gradient norms, gradients, parameters)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from raydist.config import Config, ConfigError, ModelConfig
from raydist.parallel.layout import Layout
from raydist.inference.generate import generate_ids
from raydist.models import hf
from raydist.models.gpt import build_model, flops_per_token, param_counts
from raydist.models.moe import MoEFeedForward, sequence_balance_loss, take_stats
from raydist.testing import assert_equivalent, run_layout, save_tiny_hf, tiny_config

MOE = dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, ffn_hidden=128, vocab_size=320,
           moe_experts=4, moe_top_k=2, moe_ffn_hidden=48)


def dense_reference(layer: MoEFeedForward, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert on every token, weighted by the renormalised top-k probabilities (zero elsewhere); and
    the balance loss of x's rows taken as one sequence."""
    w1, w3, w2 = (layer.experts.get_submodule(n).weight for n in ("w1", "w3", "w2"))
    probs = torch.softmax(x @ layer.router.weight.T, dim=-1)  # (N, E)
    top = probs.topk(layer.top_k, dim=-1)
    weights = top.values / top.values.sum(-1, keepdim=True) if layer.norm_topk else top.values
    gates = torch.zeros_like(probs).scatter(-1, top.indices, weights)  # (N, E)
    every = torch.einsum("nd,efd->nef", x, w1)
    hidden = F.silu(every) * torch.einsum("nd,efd->nef", x, w3)
    outs = torch.einsum("nef,edf->ned", hidden, w2)  # (N, E, D)
    out = (outs * gates.unsqueeze(-1)).sum(1)
    aux = sequence_balance_loss(probs[None], top.indices[None], probs.shape[-1])
    return (out + layer.shared(x) if layer.shared is not None else out), aux


@pytest.mark.parametrize("norm_topk, shared", [(True, 0), (False, 0), (True, 40)])
def test_the_layer_equals_a_dense_reference_forward_and_backward(norm_topk, shared):
    torch.manual_seed(0)
    cfg = ModelConfig(**{**MOE, "moe_norm_topk": norm_topk, "moe_shared_ffn_hidden": shared})
    layer = MoEFeedForward(cfg)
    with torch.no_grad():
        layer.router.weight.normal_(0, 0.5)
    layer.aux_weight = 0.3  # the balance loss's weight in backward (set_balance_weight's)
    x = torch.randn(1, 30, cfg.d_model, requires_grad=True)
    got = layer(x)
    x_ref = x.detach().clone().requires_grad_()
    expected, aux = dense_reference(layer, x_ref.reshape(-1, cfg.d_model))
    expected = expected.view_as(got)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(got)
    params = [p for p in layer.parameters()]
    mine = torch.autograd.grad(got, [x, *params], grad)
    theirs = torch.autograd.grad((expected * grad).sum() + 0.3 * aux, [x_ref, *params])
    for name, a, b in zip(["x", *(n for n, _ in layer.named_parameters())], mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    total, count, load = take_stats(layer)  # what the backward recorded, once
    assert count == 1 and float(total) == pytest.approx(float(aux.detach())) and load.sum() == 30 * cfg.moe_top_k
    assert take_stats(layer) == (None, 0, None)


def test_the_balance_loss_is_per_sequence_and_one_when_balanced():
    e, k = 4, 2
    # balanced: uniform probabilities, each expert chosen equally often in every sequence
    probs = torch.full((2, 4, e), 1 / e)
    experts = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]]).expand(2, 4, k)
    assert sequence_balance_loss(probs, experts, e).item() == pytest.approx(1.0)
    # written out: E * sum_e f_e P_e per sequence, then the mean over sequences
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(3, 5, e, generator=gen), -1)
    experts = probs.topk(k, -1).indices
    per_sequence = []
    for b in range(3):
        f = torch.tensor([(experts[b] == j).sum().item() / (5 * k) for j in range(e)])
        per_sequence.append(e * (f * probs[b].mean(0)).sum())
    assert sequence_balance_loss(probs, experts, e).item() == pytest.approx(torch.stack(per_sequence).mean().item())
    # over the whole batch instead of per sequence is a different number: the definition matters
    pooled = torch.tensor([(experts == j).sum().item() / (15 * k) for j in range(e)])
    assert (e * (pooled * probs.mean((0, 1))).sum()).item() != pytest.approx(torch.stack(per_sequence).mean().item())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_checkpoint_loads_exports_and_generates_as_transformers(tmp_path, family):
    ref = save_tiny_hf(tmp_path / "src", family=family, tied=False, seed=3, vocab_size=96, moe_experts=4,
                       moe_ffn_hidden=48 if family == "qwen3_moe" else 0)
    fields = hf.model_config_from_hf(tmp_path / "src")
    assert (fields["family"], fields["moe_experts"], fields["moe_top_k"]) == (family, 4, 2)
    model = build_model(ModelConfig(**fields), max_seq_len=64, seed=0)
    hf.load_hf_into(model, tmp_path / "src")
    tokens = torch.randint(0, 96, (3, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = ref(input_ids=tokens, use_cache=False).logits, model.eval()(tokens)
    assert expected.abs().max() > 1.0
    assert (got - expected).abs().max().item() < 1e-5
    # the experts are read expert by expert: swapping two experts' stacked rows changes the logits
    w1 = model.layers["0"].feed_forward.experts.w1.weight
    with torch.no_grad():
        w1[[0, 1]] = w1[[1, 0]]
        assert (model(tokens) - expected).abs().max() > 1e-3
        w1[[0, 1]] = w1[[1, 0]]
    # export: per-expert tensors under the family's names, loaded back by transformers with the same logits
    hf.save_hf(model.state_dict(), model.cfg, tmp_path / "out", max_position_embeddings=64)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == family and written["num_experts_per_tok"] == 2
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="eager").eval()
    with torch.no_grad():
        assert (again(input_ids=tokens, use_cache=False).logits - got).abs().max().item() < 1e-5
    prompt = tokens[0, :8].tolist()
    with torch.no_grad():
        # (an explicit mask: generate would otherwise mask the prompt's tokens equal to pad_token_id)
        ids = torch.tensor([prompt])
        theirs = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert generate_ids(model, prompt, 10) == theirs


def test_a_checkpoint_missing_an_expert_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny_hf(tmp_path, family="qwen3_moe", tied=False, seed=1, vocab_size=96, moe_experts=4)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = build_model(ModelConfig(**hf.model_config_from_hf(tmp_path)), max_seq_len=64, seed=0)
    with pytest.raises(ConfigError, match=r"experts \[0, 1, 2\].*4"):
        hf.load_hf_into(model, tmp_path)


def test_counts_use_active_parameters():
    dense = ModelConfig(**{**MOE, "moe_experts": 0})
    moe = ModelConfig(**MOE)
    d, f = MOE["d_model"], MOE["moe_ffn_hidden"]
    counts = param_counts(moe)
    assert counts["per_block"] - param_counts(dense)["per_block"] == 4 * 3 * d * f + d * 4 - 3 * d * 128
    assert counts["block_matmul"] - param_counts(dense)["block_matmul"] == 2 * 3 * d * f + d * 4 - 3 * d * 128
    assert flops_per_token(moe, 32) < flops_per_token(ModelConfig(**{**MOE, "moe_top_k": 4}), 32)


@pytest.mark.parametrize("model, match", [
    ({"family": "mixtral"}, "mixture of experts; set model.moe_experts"),
    ({**MOE, "moe_top_k": 5}, "moe_top_k=5 must be in 1..model.moe_experts=4"),
    ({**MOE, "moe_aux_coef": -1.0}, "moe_aux_coef=-1.0 must be >= 0"),
    ({**MOE, "parallel.ep": 3}, r"parallel.ep=3 does not divide model.moe_experts=4; pick ep from \[1, 2, 4\]"),
    ({**MOE, "moe_experts": 0, "parallel.ep": 2}, "parallel.ep=2 needs a mixture of experts"),
    ({**MOE, "parallel.ep": 0}, "parallel.ep=0 must be a positive degree"),
])
def test_bad_moe_settings_are_refused(model, match):
    parallel = {k.split(".")[1]: model.pop(k) for k in list(model) if k.startswith("parallel.")}
    with pytest.raises(ConfigError, match=match):
        Config.from_dict({"model": model, "parallel": parallel})


@pytest.mark.parametrize("degrees, match", [
    ({"dp_shard": 4, "ep": 3}, "parallel.ep=3 does not divide parallel.dp_shard=4"),
    ({"dp_shard": 10, "ep": 2}, "dp_shard / ep x cp = 5 ranks, which must divide model.moe_ffn_hidden=48"),
    ({"tp": 32}, "parallel.tp=32 does not divide model.moe_ffn_hidden=48"),
])
def test_moe_layouts_that_cannot_run_are_refused_by_name(degrees, match):
    from raydist.parallel.layout import Layout, validate
    from raydist.parallel.mesh import MeshSpec

    layout = Layout.of(**degrees, micro_batch=1, num_microbatches=1)
    assert any(match in p for p in validate(layout, ModelConfig(**{**MOE, "moe_experts": 12}), 32))
    with pytest.raises(ConfigError, match="parallel.ep=3 does not divide parallel.dp_shard=4"):
        MeshSpec(dp_shard=-1, ep=3).resolve(4)




# ---- training in parallel layouts equals the single process -------------------------------------------

def moe_config(tiny_data, **parallel) -> dict:
    # a coefficient large enough that a wrong balance loss shows (a cp rank's loss over its own tokens only
    # moved the losses by 1.2e-4 at 0.1, 2.2e-4 at 0.5)
    return tiny_config(tiny_data, model={**MOE, "moe_aux_coef": 0.5}, parallel={"dp_replicate": 1, **parallel})


_REFERENCE: list = []


def reference(tiny_data):
    if not _REFERENCE:
        _REFERENCE.extend(run_layout(moe_config(tiny_data), 1))
    return _REFERENCE[0]


def _layout_config(tiny_data, parallel: dict) -> dict:
    raw = moe_config(tiny_data, **{k: v for k, v in parallel.items() if k != "train"})
    raw["train"].update(parallel.get("train", {}))  # (recompute re-runs the all-to-alls in backward)
    return raw


@pytest.fixture(scope="module")
def layout_runs(tiny_data):
    """`runs(world)`: every layout of LAYOUTS at that world size, trained in one spawn (the first case of a
    world size pays it; a rank's start and warm-up cost more than most of these runs), per-rank results by
    layout index. A layout that raises fails every case of its world size, with its traceback."""
    from workers import patience

    from raydist.testing import run_layouts

    done: dict[int, dict[int, list]] = {}

    def runs(world: int) -> dict[int, list]:
        if world not in done:
            indices = [i for i, (_, w) in enumerate(LAYOUTS) if w == world]
            results = run_layouts([_layout_config(tiny_data, LAYOUTS[i][0]) for i in indices], world,
                                  timeout_s=patience(300))
            done[world] = dict(zip(indices, results))
        return done[world]

    return runs


LAYOUTS = [
    ({"dp_replicate": 2}, 2),
    ({"dp_shard": 2}, 2),
    ({"dp_replicate": 2, "dp_shard": 2}, 4),
    ({"pp": 2, "pp_schedule": "1f1b"}, 2),
    ({"pp": 2, "pp_schedule": "zbh1"}, 2),
    ({"pp": 2, "pp_schedule": "1f1b", "dp_shard": 2}, 4),
    ({"cp": 2, "cp_impl": "ring"}, 2),
    ({"cp": 2, "cp_impl": "ulysses", "dp_shard": 2}, 4),
    ({"dp_shard": 2, "ep": 2}, 2),
    ({"dp_shard": 4, "ep": 4}, 4),
    ({"dp_shard": 4, "ep": 2}, 4),
    ({"dp_replicate": 2, "dp_shard": 2, "ep": 2}, 4),
    ({"pp": 2, "pp_schedule": "1f1b", "dp_shard": 2, "ep": 2}, 4),
    ({"cp": 2, "cp_impl": "ring", "dp_shard": 2, "ep": 2}, 4),
    ({"tp": 2}, 2),
    ({"tp": 2, "sequence_parallel": True, "dp_shard": 2}, 4),
    ({"dp_shard": 2, "ep": 2, "tp": 2}, 4),
    ({"dp_shard": 2, "ep": 2, "train": {"activation_checkpoint": "full"}}, 2),
    ({"pp": 2, "pp_schedule": "zbh1", "dp_shard": 2, "ep": 2}, 4),
]


@pytest.mark.slow  # every case reads one spawn per world size (`layout_runs`): not for the inner loop
@pytest.mark.timeout(400)  # the first case of a world size trains all of its layouts (spawn's own bound: 300 s)
@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[
    "ddp2", "fsdp2", "hsdp2x2", "pp2-1f1b", "pp2-zbh1", "pp2xfsdp2", "cp2-ring", "cp2-ulysses-x-fsdp2", "ep2", "ep4",
    "ep2xfsdp2", "ep2-hsdp2x2", "pp2xep2", "ep2xcp2", "tp2", "tp2-sp-x-fsdp2", "ep2xtp2", "ep2-recompute",
    "pp2-zbh1xep2"])
def test_moe_layout_equals_single_process(tiny_data, layout_runs, index):
    ref = reference(tiny_data)
    router = [n for n in ref.grads if n.endswith("feed_forward.router.weight")]
    experts = [n for n in ref.grads if ".experts.w" in n]
    assert len(router) == 2 and len(experts) == 6
    assert all(ref.grads[n].abs().sum() > 0 for n in router + experts)  # every expert got tokens
    held = set()
    _, world = LAYOUTS[index]
    results = layout_runs(world)[index]
    assert len(results) == world
    for rank in results:
        assert_equivalent(ref, rank)
        held |= set(rank.grads)
    assert held == set(ref.grads)


@pytest.mark.parametrize("parallel, planted", [({"dp_shard": 2, "ep": 2}, "ep_undivided"),
                                               ({"tp": 2}, "moe_tp_aux_whole")], ids=["ep2", "tp2"])
def test_a_wrong_gradient_scale_under_expert_or_tensor_parallelism_is_caught(tiny_data, parallel, planted):
    """Planted bugs the layouts' equivalence must catch: ep 2 leaving the experts' gradients ep times too large
    (tests/unit/ep_undivided.py; it also shows the all-to-all path ran), tp 2 giving the balance loss its
    whole gradient on every tp rank (tests/unit/moe_tp_aux_whole.py)."""
    ref = reference(tiny_data)
    with pytest.raises(AssertionError, match="gradient|losses"):
        for rank in run_layout(moe_config(tiny_data, **parallel), 2, imports=(planted,)):
            assert_equivalent(ref, rank)


def test_the_balance_loss_reaches_the_router(tiny_data):
    """With the coefficient at 0 the router's gradient changes (the term is in the loss), and under
    activation checkpointing (the blocks recomputed in backward) it is the same as without."""
    ref = reference(tiny_data)
    [off] = run_layout(tiny_config(tiny_data, model={**MOE, "moe_aux_coef": 0.0}, parallel={"dp_replicate": 1}), 1,
                       steps=1)
    name = "layers.0.feed_forward.router.weight"
    [first] = run_layout(moe_config(tiny_data), 1, steps=1)
    assert not torch.allclose(off.grads[name], first.grads[name], rtol=1e-3)
    raw = moe_config(tiny_data)
    [recomputed] = run_layout({**raw, "train": {**raw["train"], "activation_checkpoint": "full"}}, 1)
    assert_equivalent(ref, recomputed)


def test_more_fsdp_shards_than_experts_split_the_experts_second_dimension(tiny_data):
    """Two experts over four FSDP shards: each stack is split along dim 1 (raydist.parallel.fsdp.
    expert_placement), no rank holds an empty shard, and training equals the single process."""
    raw = tiny_config(tiny_data, model={**MOE, "moe_experts": 2, "moe_top_k": 1, "moe_aux_coef": 0.1},
                      parallel={"dp_replicate": 1})
    [ref] = run_layout(raw, 1)
    held = set()
    for rank in run_layout({**raw, "parallel": {"dp_replicate": 1, "dp_shard": 4}}, 4):
        assert_equivalent(ref, rank)
        held |= set(rank.grads)
    assert held == set(ref.grads)


@pytest.mark.parametrize("saved, resumes", [
    ({"dp_shard": 2}, [("ddp2", {"dp_replicate": 2}, 2), ("single", {}, 1)]),
    ({"dp_shard": 2, "ep": 2}, [("ep4", {"dp_shard": 4, "ep": 4}, 4), ("ep1", {}, 1)]),
], ids=["fsdp2", "ep2"])
def test_a_checkpoint_saved_under_fsdp_resumes_in_another_layout(tiny_data, tmp_path, saved, resumes):
    """Saved at FSDP 2 (experts sharded) or at ep 2 (each rank holding half of the experts), killed, resumed
    in other layouts (DDP 2 and one process; ep 4 and ep 1): the next losses are the uninterrupted run's.
    One killed run serves both resumes: each resumes from its own copy of the killed run's directory."""
    import shutil

    import numpy as np

    from raydist.testing import run_fit

    def config(**parallel):
        return tiny_config(tiny_data, model={**MOE, "moe_aux_coef": 0.1},
                           train={"steps": 8, "global_batch": 8, "micro_batch": 1},
                           parallel={"dp_replicate": 1, **parallel},
                           checkpoint={"every_steps": 4, "keep": 2, "async_save": False})

    [ref, _] = run_fit(config(**saved), 2, str(tmp_path / "ref"))
    killed = str(tmp_path / "killed")
    assert run_fit(config(**saved), 2, killed, crash_after_step=6) is None
    for name, parallel, world in resumes:
        run_dir = str(tmp_path / name)
        shutil.copytree(killed, run_dir)
        resumed = run_fit(config(**parallel), world, run_dir)
        got, want = np.array(resumed[0].losses), np.array(ref.losses[4:])
        assert len(got) == 4 and (np.abs(got - want) / want).max() < 1e-4, (name, got, want)


def test_lora_on_attention_trains_a_moe_model_alike_under_fsdp(tiny_data):
    """LoRA adapters on the attention of a mixture-of-experts model (the experts, the router and the rest
    frozen): FSDP 2 equals the single process, and only the adapters get gradients."""
    raw = tiny_config(tiny_data, model={**MOE, "moe_aux_coef": 0.1},
                      peft={"method": "lora", "lora_rank": 4, "lora_alpha": 8.0, "lora_targets": "attention"},
                      parallel={"dp_replicate": 1})
    [ref] = run_layout(raw, 1)
    assert ref.grads and all(n.endswith((".lora_a", ".lora_b")) for n in ref.grads)
    from raydist.testing import assert_same_steps

    for rank in run_layout({**raw, "parallel": {"dp_replicate": 1, "dp_shard": 2}}, 2):
        assert_same_steps(ref, rank)
        assert set(rank.grads) == {n for n in rank.params if n in ref.grads}  # adapters only, every one
        for name, grad in rank.grads.items():
            torch.testing.assert_close(grad, ref.grads[name], rtol=1e-4, atol=1e-3 * float(ref.grads[name].abs().max()))
        for name, tensor in rank.params.items():
            if name in ref.grads:
                assert float((tensor - ref.params[name]).norm() / ref.params[name].norm()) <= 1e-4, name
            else:  # frozen: the experts, the router, everything but the adapters
                assert torch.equal(tensor, ref.params[name]), name
    with pytest.raises(ConfigError, match="LoRA on experts is not built yet"):
        Config.from_dict({"model": MOE, "peft": {"method": "lora", "lora_targets": "mlp"}})


@pytest.mark.parametrize("parallel", [{"dp_replicate": 2}, {"dp_replicate": 1, "dp_shard": 2, "ep": 2},
                                      {"dp_replicate": 1, "tp": 2}], ids=["ddp2", "ep2", "tp2"])
def test_the_metrics_log_the_balance_loss_and_every_routed_token(tiny_data, tmp_path, parallel):
    """A 2-rank run's metrics.jsonl: `moe_aux` near 1 (balanced is 1), and `moe_tokens_per_expert` counting
    each training token's k choices in every block once (tp ranks route the same tokens; evaluation's forwards
    not counted); under ep the seconds spent in the all-to-alls (`moe_all_to_all_s`), absent without it."""
    from raydist.testing import run_fit

    raw = tiny_config(tiny_data, model={**MOE, "moe_aux_coef": 0.1}, train={"steps": 4, "log_every": 2},
                      parallel=parallel)
    run_fit(raw, 2, str(tmp_path))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "moe_aux" in r]
    assert [r["step"] for r in logged] == [2, 4]
    per_step = raw["train"]["global_batch"] * 32 * MOE["moe_top_k"] * MOE["num_layers"]  # seq_len 32
    for r in logged:
        assert sum(r["moe_tokens_per_expert"]) == 2 * per_step and len(r["moe_tokens_per_expert"]) == 4
        assert 1.0 <= r["moe_aux"] < 2.0 and r["moe_load_max"] >= 1.0
        assert (r.get("moe_all_to_all_s", 0) > 0) == ("ep" in parallel), r
        assert r["mesh"].get("ep", 1) == parallel.get("ep", 1)  # the record names the split


@pytest.fixture(scope="module")
def qwen3_moe_reference(tiny_data, tmp_path_factory):
    """A Qwen3-MoE directory with 2 experts, its config (`init_from = "hf:DIR"`) and its single-process run:
    the reference of both cases below."""
    path = tmp_path_factory.mktemp("qwen3-moe")
    save_tiny_hf(path, family="qwen3_moe", tied=False, seed=6, moe_experts=2, moe_ffn_hidden=64)
    raw = tiny_config(tiny_data, model={"init_from": f"hf:{path}"}, train={"lr": 1e-3},
                      parallel={"dp_replicate": 1})
    [ref] = run_layout(raw, 1)
    return raw, ref


@pytest.mark.parametrize("parallel", [{"dp_shard": 4}, {"dp_shard": 4, "ep": 2}], ids=["fsdp4", "ep2xfsdp2"])
def test_qwen3_moe_from_hf_trains_alike_with_each_rank_reading_its_expert_slices(qwen3_moe_reference, parallel):
    """`init_from = "hf:DIR"` of a Qwen3-MoE with 2 experts under FSDP 4 (each rank reads only its slice of
    each expert, dim 1: more shards than experts) and under ep 2 x FSDP 2 (its expert's half): training
    equals the single process."""
    raw, ref = qwen3_moe_reference
    assert any(".experts.w2." in n for n in ref.grads)
    for rank in run_layout({**raw, "parallel": {"dp_replicate": 1, **parallel}}, 4):
        assert_equivalent(ref, rank)


def test_the_planner_costs_expert_parallelism():
    """ep 8 in a 32-rank FSDP run of Qwen3-30B-A3B: an all-to-all term appears, the experts' FSDP traffic and
    the gathered block shrink (E / ep experts over dp_shard / ep ranks), and the planner's search offers ep."""
    from raydist.planner.cost_model import complete, estimate
    from raydist.planner.enumerate import layout_shapes
    from raydist.planner.hardware import get_hardware
    from raydist.planner.placement import Workload

    from pathlib import Path

    cfg = Config.load(Path(__file__).parents[2] / "workloads" / "qwen3_30b_a3b.toml")
    w, hw = Workload.from_config(cfg, 32), get_hardware("h100", 8)
    by_ep = {ep: estimate(w, complete(w, Layout.of(dp_shard=32, ep=ep, micro_batch=1, num_microbatches=1,
                                                   activation_checkpoint="full")), hw) for ep in (1, 8)}
    assert by_ep[1].time["ep_comm"] == 0 < by_ep[8].time["ep_comm"]
    assert by_ep[8].time["dp_comm"] < by_ep[1].time["dp_comm"] / 4
    assert by_ep[8].memory["transient"] < by_ep[1].memory["transient"]
    assert {lay.ep for lay in layout_shapes(w, 32, hw)} == {1, 2, 4, 8, 16, 32}
