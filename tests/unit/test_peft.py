"""LoRA (Hu et al., 2021) and layer freezing: LoRA under FSDP 2, TP 2, DDP 2, PP 2 (1F1B and ZB-H1) and with
activation checkpointing (selective, full) equals LoRA in one process (losses every step, adapters after the
last), base weights stay bit-identical (a pipeline's tied output copy included), frozen weights hold no
optimizer state; exports merge the adapters or write PEFT's adapter format."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from raydist.config import Config, ConfigError
from raydist.parallel.runtime import spawn
from raydist.testing import assert_same_steps, run_layout, save_tiny_hf, tiny_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LORA = {"method": "lora", "lora_rank": 4, "lora_alpha": 8.0, "lora_targets": "all"}
STEPS = 4


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny_hf(path, tied=True, seed=5)
    return str(path)


def lora_config(tiny_data, llama_dir, parallel=None, **peft):
    return tiny_config(tiny_data, model={"init_from": f"hf:{llama_dir}"}, parallel=parallel or {},
                       train={"lr": 1e-2, "warmup_steps": 0}, peft={**LORA, **peft})


@pytest.fixture(scope="module")
def single_lora(tiny_data, llama_dir):
    [ref] = run_layout(lora_config(tiny_data, llama_dir), 1, steps=STEPS)
    return ref


def _adapters(params: dict) -> dict:
    return {n: t for n, t in params.items() if n.endswith((".lora_a", ".lora_b"))}


def test_lora_single_process_trains_only_adapters(single_lora, llama_dir):
    from raydist.models.hf import iter_hf_tensors

    adapters = _adapters(single_lora.params)
    assert len(adapters) == 2 * 7 * 2  # A and B on 7 projections in each of 2 blocks
    assert set(single_lora.grads) == set(adapters)  # only adapters receive gradients
    assert all(adapters[n].abs().max() > 0 for n in adapters if n.endswith("lora_b"))  # B left zero
    assert single_lora.losses[-1] < single_lora.losses[0]
    for name, tensor in iter_hf_tensors(llama_dir):
        assert torch.equal(single_lora.params[name], tensor), name  # base weights bit-identical


def _assert_peft_equal(reference, ranks, base: dict) -> None:
    """Every rank's losses and gradient norms before clipping equal the single process's at every step; the
    trainable parameters it holds (the ones the single process trained) received a gradient, and only they
    did, the last step's equal to the single process's, and equal the single process's after the last step; the frozen ones it holds are bit-identical to the checkpoint's; the ranks together
    hold every parameter."""
    for rank in ranks:
        assert_same_steps(reference, rank)  # losses and gradient norms before clipping
        trained = {n: t for n, t in rank.params.items() if n in reference.grads}
        assert set(rank.grads) == set(trained), sorted(set(rank.grads) ^ set(trained))
        for name, grad in rank.grads.items():  # the last step's, before clipping
            want = reference.grads[name]
            torch.testing.assert_close(grad, want, rtol=1e-4, atol=max(1e-6, 1e-3 * float(want.abs().max())))
        for name, tensor in trained.items():
            want = reference.params[name]
            error = float((tensor - want).norm() / want.norm())
            assert error <= 1e-4, f"{name} differs by {error:.2e} (relative norm)"
        for name in set(rank.params) - set(trained):
            assert torch.equal(rank.params[name], base[name]), f"{name} changed"
    held = set().union(*(rank.params for rank in ranks))
    assert held == set(reference.params), sorted(held ^ set(reference.params))


@pytest.mark.parametrize("parallel", [{"dp_shard": 2}, {"tp": 2}, {"dp_replicate": 2}, {"pp": 2},
                                      {"pp": 2, "pp_schedule": "zbh1"}],
                         ids=["fsdp2", "tp2", "ddp2", "pp2-1f1b", "pp2-zbh1"])
def test_lora_layouts_equal_single_process(tiny_data, llama_dir, single_lora, parallel):
    from raydist.models.hf import iter_hf_tensors

    ranks = run_layout(lora_config(tiny_data, llama_dir, parallel), 2, steps=STEPS)
    _assert_peft_equal(single_lora, ranks, dict(iter_hf_tensors(llama_dir)))


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_lora_with_activation_checkpointing_equals_single_process(tiny_data, llama_dir, single_lora, policy):
    """Recompute re-runs the adapted projections in backward: the adapters' gradients must come out the same."""
    from raydist.models.hf import iter_hf_tensors

    raw = lora_config(tiny_data, llama_dir)
    raw["train"]["activation_checkpoint"] = policy
    ranks = run_layout(raw, 1, steps=STEPS)
    _assert_peft_equal(single_lora, ranks, dict(iter_hf_tensors(llama_dir)))


def test_freeze_under_pipeline_equals_single_process(tiny_data, llama_dir):
    """`freeze` with the tied embedding frozen: the last stage's output copy of it stays frozen too."""
    from raydist.models.hf import iter_hf_tensors

    raw = lora_config(tiny_data, llama_dir, method="freeze", trainable_last_layers=2)
    [reference] = run_layout(raw, 1, steps=STEPS)
    assert "tok_embeddings.weight" not in reference.grads and "layers.0.attention.wq.weight" in reference.grads
    ranks = run_layout(lora_config(tiny_data, llama_dir, {"pp": 2}, method="freeze", trainable_last_layers=2), 2,
                       steps=STEPS)
    _assert_peft_equal(reference, ranks, dict(iter_hf_tensors(llama_dir)))


def test_freeze_leaving_a_pipeline_rank_nothing_to_train_is_refused(tiny_data, llama_dir, tmp_path):
    from raydist.driver.launcher import plan

    raw = lora_config(tiny_data, llama_dir, {"pp": 2}, method="freeze", trainable_last_layers=1)
    raw["ray"] = {"num_workers": 2}
    raw["checkpoint"] = {"storage": str(tmp_path)}
    with pytest.raises(ConfigError, match=r"pipeline rank 0 holds only frozen blocks .* set "
                                          r"peft.trainable_last_layers >= 2 or a smaller parallel.pp"):
        plan(Config.from_dict(raw), log=lambda *_: None)  # on the driver, before any worker starts


def _optimizer_view(raw: dict) -> dict:
    from raydist.parallel.runtime import pick_device
    from raydist.training.trainer import Trainer

    trainer = Trainer(Config.from_dict(raw), pick_device())
    try:
        in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
        return {"optimized": sorted(n for n, p in trainer.pm.model.named_parameters() if id(p) in in_optimizer),
                "frozen_sharded": all(hasattr(p, "to_local") for n, p in trainer.pm.model.named_parameters()
                                      if not p.requires_grad),
                **trainer.param_counts}
    finally:
        trainer.close()


def test_frozen_weights_have_no_optimizer_state_and_stay_sharded(tiny_data, llama_dir):
    [view, _] = spawn(_optimizer_view, 2, lora_config(tiny_data, llama_dir, {"dp_shard": 2}, lora_targets="mlp"))
    assert view["optimized"] and all(n.endswith((".lora_a", ".lora_b")) for n in view["optimized"])
    assert len(view["optimized"]) == 2 * 3 * 2 and view["frozen_sharded"]
    r, d, f = 4, 64, 128
    assert view["trainable_params"] == 2 * (2 * (r * d + f * r) + (r * f + d * r))
    [freeze] = spawn(_optimizer_view, 1, lora_config(tiny_data, llama_dir, method="freeze", trainable_last_layers=1))
    assert {n.split(".")[0] + "." + n.split(".")[1] for n in freeze["optimized"] if n.startswith("layers.")} \
        == {"layers.1"} and "norm.weight" in freeze["optimized"]
    assert "tok_embeddings.weight" not in freeze["optimized"]


def test_lora_targets_come_from_the_familys_tensor_parallel_roles():
    from raydist.config import ModelConfig
    from raydist.models.peft import lora_targets

    attention = ("attention.wq", "attention.wk", "attention.wv", "attention.wo")
    mlp = ("feed_forward.w1", "feed_forward.w3", "feed_forward.w2")
    for family in ("llama", "qwen2", "qwen3"):  # Qwen3's q_norm / k_norm sit under the attention: not Linear
        cfg = ModelConfig(family=family)
        assert lora_targets(cfg, "attention") == attention and lora_targets(cfg, "mlp") == mlp
        assert lora_targets(cfg, "all") == attention + mlp


def test_peft_config_errors():
    with pytest.raises(ConfigError, match="peft.method='prefix' is not one of none, lora, freeze"):
        Config.from_dict({"peft": {"method": "prefix"}})
    with pytest.raises(ConfigError, match="peft.lora_rank=0"):
        Config.from_dict({"peft": {"method": "lora", "lora_rank": 0}})
    with pytest.raises(ConfigError, match="peft.trainable_last_layers=9 must be in 1..model.num_layers=4"):
        Config.from_dict({"peft": {"method": "freeze", "trainable_last_layers": 9}})


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    save_tiny_hf(path, family="qwen3", tied=False, seed=6, head_dim=32)
    return str(path)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_lora_export_merges_and_adapter_only_is_peft_format(tiny_data, llama_dir, qwen3_dir, tmp_path, capsys,
                                                            family):
    """A LoRA run (FSDP 2) exported merged loads in transformers, as the family's model, with raydist's
    logits; the adapter-only export, applied to the base model by PEFT's rule W + (lora_alpha / r) B A on the
    named modules, gives the same. Qwen3: heads of 32 on a 64-wide model; its q/k norms stay frozen with the base weights."""
    from safetensors.torch import load_file

    from raydist.cli import main
    from raydist.testing import logits_after_load, run_fit

    llama_dir = qwen3_dir if family == "qwen3" else llama_dir
    run_dir, merged, adapter = str(tmp_path / "run"), str(tmp_path / "merged"), str(tmp_path / "adapter")
    raw = lora_config(tiny_data, llama_dir, {"dp_shard": 2}, lora_targets="all")
    raw["train"].update(steps=3)
    raw["checkpoint"] = {"every_steps": 0, "async_save": False}
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "config.toml"), "w") as f:
        f.write(Config.from_dict(raw).to_toml())
    [summary, _] = [r.summary for r in run_fit(raw, 2, run_dir)]
    assert 0 < summary["trainable_params"] < summary["total_params"] / 10

    assert main(["export", run_dir, "--hf", merged]) == 0
    assert main(["export", run_dir, "--hf", adapter, "--adapter-only"]) == 0
    capsys.readouterr()
    tokens = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(4))
    ours = spawn(logits_after_load, 2, raw, run_dir, tokens, 3)[0]
    with torch.no_grad():
        exported = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
        assert exported.config.model_type == family
        theirs = exported(input_ids=tokens).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()
        untrained = base(input_ids=tokens).logits
    assert (ours - untrained).abs().max() > 1e-2  # the adapters changed the model
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)

    config = json.loads(open(os.path.join(adapter, "adapter_config.json")).read())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"])
    tensors = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    modules = dict(base.named_modules())
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." in key:
                name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = tensors[key.replace("lora_A", "lora_B")]
                modules[name].weight += config["lora_alpha"] / config["r"] * (b @ a)
        applied = base(input_ids=tokens).logits
    torch.testing.assert_close(applied, ours, rtol=1e-5, atol=1e-5)


def test_lora_run_resumes_exactly(tiny_data, llama_dir, tmp_path):
    """A LoRA run killed after step 3 resumes from its checkpoint (adapters, their AdamW state; the
    checkpoint wins over init_from) with the losses of an uninterrupted run."""
    from raydist.testing import run_fit

    raw = lora_config(tiny_data, llama_dir, {"dp_shard": 2})
    raw["train"].update(steps=5)
    raw["checkpoint"] = {"every_steps": 3, "async_save": False}
    reference = run_fit(raw, 2, str(tmp_path / "reference"))[0].losses
    assert run_fit(raw, 2, str(tmp_path / "run"), crash_after_step=4) is None
    resumed = run_fit(raw, 2, str(tmp_path / "run"))[0].losses
    assert resumed == pytest.approx(reference[3:], rel=1e-6)


def test_finetune_workload_loads_and_takes_the_model_from_init_from(llama_dir):
    from pathlib import Path

    path = Path(__file__).parents[2] / "workloads" / "finetune_lora.toml"
    cfg = Config.load(path)
    assert cfg.peft.method == "lora" and cfg.model.init_from == ""
    tuned = Config.load(path, [f"model.init_from=hf:{llama_dir}"])
    assert (tuned.model.vocab_size, tuned.model.d_model, tuned.model.num_layers) == (320, 64, 2)
