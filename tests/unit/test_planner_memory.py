"""The planner's memory model against measurement.

- Model state: DDP 4, FSDP 4 and HSDP 2x2 on 4 gloo ranks (the mesh/FSDP benchmark's layouts), bytes of
  parameters, gradients and AdamW state each rank holds after a training step
  (raydist.metrics.memory.state_bytes) against the planner's per-rank estimate: within 10% (the model
  counts torch.chunk shards exactly, so it is exact here, uneven shards included).
- Activations: the bytes autograd saves for backward (every saved tensor's storage, once) for each
  recompute policy, in one process, against memory.activation_bytes + head_bytes.
- PEFT: LoRA and freeze layouts among the measured ones (gradients and AdamW state for the trained
  parameters only), LoRA's saved activations, and the trained set against the runtime's own (`apply_peft`)
  and a count by hand from the model's shape.
"""

from __future__ import annotations

import pytest
import torch

from raydist.config import Config, ModelConfig, PeftConfig
from raydist.parallel.runtime import spawn
from raydist.planner.memory import (activation_bytes, head_bytes, rank_memory, stage_elements, stage_trained_elements,
                                    state_bytes_per_rank)
from raydist.planner.placement import Layout, Workload, trained_layer_counts
from raydist.planner.policy import plan_layout
from raydist.testing import TINY_MODEL, tiny_config

LAYOUTS = {
    "ddp4": {"dp_replicate": 4, "dp_shard": 1},
    "fsdp4": {"dp_replicate": 1, "dp_shard": 4},
    "hsdp2x2": {"dp_replicate": 2, "dp_shard": 2},
}
# vocab 330 and ffn 132 do not split into 4 equal row blocks: FSDP2's last rank holds fewer rows.
UNEVEN = dict(TINY_MODEL, vocab_size=330, ffn_hidden=132)
# trained sets: rank-3 adapters on every projection (A's 3 rows do not split into 4: one rank holds none),
# and the last block of 2 with the final norm (the tied head stays frozen with the embedding)
PEFT = {"fsdp4_lora": ("fsdp4", {"method": "lora", "lora_rank": 3, "lora_targets": "all"}),
        "ddp4_freeze": ("ddp4", {"method": "freeze", "trainable_last_layers": 1})}


def _measure_all(raws: dict) -> dict:
    """On every rank: one training step per layout, then one more forward/backward so gradients exist;
    the state bytes each layout's rank holds."""
    import torch.distributed as dist

    from raydist.metrics.memory import state_bytes
    from raydist.training.trainer import Trainer

    out = {}
    for name, raw in raws.items():
        trainer = Trainer(Config.from_dict(raw), torch.device("cpu"))
        trainer.train_step()
        tokens, _ = trainer.next_batch()
        trainer.runner.forward_loss(trainer.runner.micro_batches(tokens)[0]).backward()
        out[name] = state_bytes(trainer.pm.model, trainer.optimizer)
        trainer.close()
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def measured(tiny_data):
    raws = {}
    for name, parallel in LAYOUTS.items():
        raws[name] = tiny_config(tiny_data, parallel=parallel, train={"steps": 2, "micro_batch": 2})
    raws["fsdp4_uneven"] = tiny_config(tiny_data, model=UNEVEN, parallel=LAYOUTS["fsdp4"],
                                       train={"steps": 2, "micro_batch": 2})
    for name, (layout, peft) in PEFT.items():
        raws[name] = tiny_config(tiny_data, parallel=LAYOUTS[layout], train={"steps": 2, "micro_batch": 2}, peft=peft)
    return spawn(_measure_all, 4, raws), raws


@pytest.mark.slow  # each case reads `measured`, one spawn per world size over every layout (~8 s)
@pytest.mark.parametrize("name", [*LAYOUTS, "fsdp4_uneven", *PEFT])
def test_state_bytes_estimate_within_10_percent(measured, name):
    per_rank, raws = measured
    cfg = Config.from_dict(raws[name])
    workload = Workload.from_config(cfg, compute_dtype_bytes=4)
    layout = plan_layout(cfg, 4)
    for rank in range(4):
        got = per_rank[rank][name]
        want = state_bytes_per_rank(workload, layout, rank)
        for key in ("params", "grads", "optimizer", "total"):
            error = abs(want[key] - got[key]) / got[key]
            print(f"{name} rank {rank} {key}: estimated {want[key]} measured {got[key]} ({error:.2%})")
            assert error <= 0.10, (name, rank, key, want[key], got[key])


@pytest.mark.slow  # reads `measured` (one spawn over every layout)
def test_sharding_cuts_the_estimate_as_measured(measured):
    """The worst rank's estimate (padded chunks) bounds every measured rank, and FSDP4 holds ~1/4 of DDP."""
    per_rank, raws = measured
    ddp = per_rank[0]["ddp4"]["total"]
    fsdp = max(r["fsdp4"]["total"] for r in per_rank)
    assert 0.2 < fsdp / ddp < 0.3
    cfg = Config.from_dict(raws["fsdp4_uneven"])
    mem = rank_memory(Workload.from_config(cfg, 4), plan_layout(cfg, 4), num_microbatches=1)
    worst = mem["params"] + mem["grads"] + mem["optimizer"]
    assert all(r["fsdp4_uneven"]["total"] <= worst for r in per_rank)
    assert len({r["fsdp4_uneven"]["total"] for r in per_rank}) > 1  # the shards really are uneven


# ---- activations ------------------------------------------------------------------------------------


def _saved_bytes(policy: str, model_cfg: ModelConfig, batch: int, seq_len: int, fused: bool = False) -> int:
    """Bytes of distinct storages autograd keeps for backward (parameters and buffers excluded), including
    the outputs a selective-checkpoint region caches; with `fused`, the head computes the loss with its
    matmul (kernels.loss = auto)."""
    import raydist.parallel.checkpointing as ckpt
    from raydist.models.gpt import build_model
    from raydist.models.loss import cross_entropy

    caches = []
    original = ckpt._selective_context

    def capturing():
        contexts = original()
        caches.append(contexts[0].storage)
        return contexts

    ckpt._selective_context = capturing
    try:
        model = build_model(model_cfg, seq_len, 0)
        ckpt.apply_activation_checkpointing(model, policy)
        owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        seen: dict[int, int] = {}
        alive = []

        def note(t):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in owned:
                alive.append(t)  # keep it alive so that its address is not reused
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        tokens = torch.randint(0, model_cfg.vocab_size, (batch, seq_len + 1))
        if fused:
            from raydist.kernels.select import install_torch_matmul

            install_torch_matmul(model)
        with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):
            if fused:
                loss = model(tokens[:, :-1], targets=tokens[:, 1:])
            else:
                loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        for cache in caches:
            for entries in cache.values():
                for value in (entries.values() if isinstance(entries, dict) else entries):
                    for leaf in torch.utils._pytree.tree_leaves(value):
                        note(getattr(leaf, "val", leaf))
        del loss
        return sum(seen.values())
    finally:
        ckpt._selective_context = original


@pytest.mark.parametrize("loss", ["plain", "auto"])
@pytest.mark.parametrize("policy", ["none", "full", "every_k", "selective"])
@pytest.mark.parametrize("shape", [dict(TINY_MODEL), dict(TINY_MODEL, num_kv_heads=4, ffn_hidden=256, num_layers=4)])
def test_activation_bytes_match_saved_tensors(policy, shape, loss):
    """kernels.loss = auto: the fused loss keeps each token's log-sum-exp, not the log-softmax."""
    model_cfg = ModelConfig(**shape)
    batch, seq_len = 2, 32
    got = _saved_bytes(policy, model_cfg, batch, seq_len, fused=loss == "auto")
    workload = Workload(model_cfg, seq_len, global_batch=batch, compute_dtype_bytes=4, loss=loss)
    layout = Layout(micro_batch=batch, activation_checkpoint=policy)
    want = activation_bytes(workload, layout, model_cfg.num_layers, 1)["saved"] + head_bytes(workload, layout)["saved"]
    error = abs(want - got) / got
    print(f"{policy} {shape} {loss}: estimated {want:.0f} B, saved tensors {got} B ({error:.2%})")
    assert error <= 0.10


def test_the_fused_loss_is_priced_in_every_layout():
    """The fused head saves 4 bytes a token instead of 4 V (V / tp of them under tensor parallelism's
    vocabulary-parallel head), alone, under tp 2 and on pp 2's last stage; kernels.loss = plain keeps the
    logits' price."""
    m = ModelConfig(**TINY_MODEL)
    auto, plain = (Workload(m, 32, global_batch=8, compute_dtype_bytes=4, loss=loss) for loss in ("auto", "plain"))
    for lay in (Layout(micro_batch=2), Layout.of(tp=2, micro_batch=2), Layout.of(pp=2, micro_batch=2)):
        saved = {w.loss: head_bytes(w, lay)["saved"] for w in (auto, plain)}
        assert saved["plain"] - saved["auto"] == 2 * 32 * 4 * (m.vocab_size / lay.tp - 1), lay.describe()


# ---- parameter-efficient fine-tuning ---------------------------------------------------------------------

# W's (out, in) for each projection of a Llama-style block, from the model's shape alone
def _projection_shapes(m: ModelConfig) -> dict[str, tuple[int, int]]:
    q, kv, h, f = m.num_heads * m.head_size, m.num_kv_heads * m.head_size, m.d_model, m.ffn_hidden
    return {"attention.wq": (q, h), "attention.wk": (kv, h), "attention.wv": (kv, h), "attention.wo": (h, q),
            "feed_forward.w1": (f, h), "feed_forward.w3": (f, h), "feed_forward.w2": (h, f)}


def _meta_model(m: ModelConfig, peft: PeftConfig):
    from raydist.models.gpt import GPT
    from raydist.models.peft import apply_peft

    with torch.device("meta"):
        model = GPT(m, 64)
    apply_peft(model, peft, seed=0)
    return model


LLAMA_1B = ModelConfig(num_layers=8, d_model=1024, num_heads=16, num_kv_heads=8, ffn_hidden=2816, vocab_size=32000,
                       tie_embeddings=False)


@pytest.mark.parametrize("targets", ["attention", "mlp", "all"])
def test_lora_gradients_and_adamw_state_are_the_adapters(targets):
    """Gradients (4 bytes: fp32) and AdamW's two fp32 moments (8 bytes) for r (in + out) elements per adapted
    Linear, counted from lora_targets and the model's shape; the frozen base weights are still held."""
    from raydist.models.gpt import param_counts
    from raydist.models.peft import lora_targets, parameter_counts

    m, r = LLAMA_1B, 16
    peft = PeftConfig(method="lora", lora_rank=r, lora_targets=targets)
    shapes = _projection_shapes(m)
    adapters = m.num_layers * sum(r * (inp + out) for out, inp in (shapes[t] for t in lora_targets(m, targets)))
    assert adapters == parameter_counts(_meta_model(m, peft))["trainable_params"]  # the runtime's trained set
    w = Workload(m, 2048, global_batch=8, compute_dtype_bytes=2, peft=peft)
    lay = Layout(micro_batch=1)
    state = state_bytes_per_rank(w, lay, 0)
    assert state["grads"] == 4 * adapters and state["optimizer"] == 8 * adapters
    assert state["params"] == 4 * (param_counts(m)["total"] + adapters)
    mem = rank_memory(w, lay, 8)
    assert (mem["grads"], mem["optimizer"]) == (4 * adapters, 8 * adapters)
    # FSDP shards them (A's r rows and B's out rows in torch.chunk pieces): the ranks' shares add up to all
    sharded = Layout.of(dp_shard=8, micro_batch=1)
    assert sum(state_bytes_per_rank(w, sharded, rank)["grads"] for rank in range(8)) == 4 * adapters
    # tensor parallel: B split by rows under a column-parallel W, A by columns under a row-parallel one; the
    # other factor replicated on both ranks
    tp2 = Layout.of(tp=2, dp_replicate=4, micro_batch=1)
    row = {"attention.wo", "feed_forward.w2"}
    per_tp_rank = m.num_layers * sum(r * (inp // 2 + out) if t in row else r * (inp + out // 2)
                                     for t, (out, inp) in shapes.items() if t in lora_targets(m, targets))
    assert state_bytes_per_rank(w, tp2, 0)["grads"] == 4 * per_tp_rank


@pytest.mark.parametrize("tied", [False, True])
def test_freeze_trains_the_last_blocks_and_the_final_norm(tied):
    """freeze's trained set is the last k blocks, the final norm and an untied head (models/peft.py), the
    same the runtime leaves trainable; under a pipeline only the ranks holding those blocks train them."""
    from raydist.models.gpt import param_counts
    from raydist.models.peft import parameter_counts

    m = ModelConfig(**{**LLAMA_1B.__dict__, "tie_embeddings": tied})
    k = 3
    peft = PeftConfig(method="freeze", trainable_last_layers=k)
    counts = param_counts(m)
    want = k * counts["per_block"] + m.d_model + (0 if tied else m.vocab_size * m.d_model)
    assert want == parameter_counts(_meta_model(m, peft))["trainable_params"]
    w = Workload(m, 2048, global_batch=8, compute_dtype_bytes=2, peft=peft)
    assert stage_trained_elements(w, Layout(micro_batch=1), 0) == want
    assert stage_elements(w, Layout(micro_batch=1), 0) == counts["total"]  # every weight still held
    # 8 blocks on 2 ranks of 4: rank 0 trains block 3 of its 0..3 (k = 5), rank 1 all of 4..7
    pp = Layout.of(pp=2, dp_replicate=4, micro_batch=1, stage_layers=(4, 4))
    w5 = Workload(m, 2048, 8, 2, peft=PeftConfig(method="freeze", trainable_last_layers=5))
    assert trained_layer_counts(w5, pp) == [1, 4]
    assert stage_trained_elements(w5, pp, 0) == counts["per_block"]  # the frozen embedding is not counted
    # and with k = 3 rank 0 would train nothing: the runtime refuses the layout, and so does the planner
    from raydist.planner.cost_model import layout_problems

    assert "pipeline rank 0 holds only frozen blocks" in layout_problems(w, pp)[0]
    assert layout_problems(w5, pp) == []


SHAPE = dict(TINY_MODEL, num_kv_heads=4, ffn_hidden=256, num_layers=4)


def _saved_bytes_with(peft: PeftConfig, policy: str, model_cfg: ModelConfig, monkeypatch) -> int:
    """`_saved_bytes` of the model with `peft` applied, as the Trainer applies it, batch 2 x 32 tokens."""
    from raydist.models import gpt
    from raydist.models.peft import apply_peft

    build = gpt.build_model

    def build_with_peft(*args, **kwargs):
        model = build(*args, **kwargs)
        apply_peft(model, peft, seed=0)
        return model

    monkeypatch.setattr(gpt, "build_model", build_with_peft)
    return _saved_bytes(policy, model_cfg, 2, 32)


def _estimate(workload: Workload, layout: Layout, layers: int) -> float:
    return activation_bytes(workload, layout, layers, 1)["saved"] + head_bytes(workload, layout)["saved"]


@pytest.mark.parametrize("policy", ["none", "full", "selective"])
@pytest.mark.parametrize("targets", ["attention", "all"])
def test_lora_activation_bytes_match_saved_tensors(policy, targets, monkeypatch):
    """With the adapters applied: frozen norms keep no normalised x, each adapter keeps x A^T, selective
    caches the adapters' matmul outputs too (more than full training keeps)."""
    peft = PeftConfig(method="lora", lora_rank=32, lora_targets=targets)  # (x A^T: a tenth of the bytes)
    model_cfg = ModelConfig(**SHAPE)
    got = _saved_bytes_with(peft, policy, model_cfg, monkeypatch)
    layout = Layout(micro_batch=2, activation_checkpoint=policy)
    want = _estimate(Workload(model_cfg, 32, global_batch=2, compute_dtype_bytes=4, peft=peft, loss="plain"), layout, 4)
    as_full = _estimate(Workload(model_cfg, 32, global_batch=2, compute_dtype_bytes=4, loss="plain"), layout, 4)
    error = abs(want - got) / got
    print(f"lora {targets} {policy}: estimated {want:.0f} B, saved tensors {got} B ({error:.2%}); "
          f"priced as full training {as_full:.0f} B")
    assert error <= 0.03  # (the first block keeps a little less: nothing before it needs a gradient)


def test_freeze_keeps_activations_of_the_trained_blocks_only(monkeypatch):
    """The frozen blocks before the last k build no autograd graph and keep nothing for backward."""
    peft = PeftConfig(method="freeze", trainable_last_layers=1)
    model_cfg = ModelConfig(**SHAPE)
    got = _saved_bytes_with(peft, "none", model_cfg, monkeypatch)
    workload = Workload(model_cfg, 32, global_batch=2, compute_dtype_bytes=4, peft=peft, loss="plain")
    layout = Layout(micro_batch=2)
    [trained] = trained_layer_counts(workload, layout)
    want = _estimate(workload, layout, trained)
    print(f"freeze: estimated {want:.0f} B, saved tensors {got} B")
    assert trained == 1 and abs(want - got) / got <= 0.05
