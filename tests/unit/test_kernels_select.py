"""Kernel selection from [kernels], installation into the model, and training with the Triton kernels.

The training test runs the Triton kernels under TRITON_INTERPRET=1 on CPU and compares the losses of a
few AdamW steps with the torch path (sdpa attention, nn.Linear) on the same seed and batches.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raydist.config import ConfigError, KernelsConfig, ModelConfig
from raydist.kernels import apply_kernels, kernel_calls, resolve_kernels, runtime
from raydist.kernels.select import TorchLinear, TritonFeedForward, TritonLinear
from raydist.models.gpt import build_model, eager_attention, sdpa_attention
from raydist.models.loss import cross_entropy

needs_triton = pytest.mark.skipif(runtime.triton_import_error() is not None,
                                  reason=f"triton not importable: {runtime.triton_import_error()}")
TINY = ModelConfig(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, ffn_hidden=176, vocab_size=128)


def test_auto_picks_torch_on_cpu_even_with_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_kernels(KernelsConfig(), "cpu", 32) == {"attention": "sdpa", "matmul": "torch", "loss": "fused"}


@needs_triton
def test_auto_on_cuda_is_left_to_measurement_without_touching_the_gpu():
    # resolve_kernels looks at the device *type* only; apply_kernels times the kernels at the model's shapes
    # (kernels/choice.py; tested with a fake timer in test_kernels_auto.py)
    for head_dim in (64, 48):
        assert resolve_kernels(KernelsConfig(), torch.device("cuda", 0), head_dim) == {
            "attention": "auto", "matmul": "auto", "loss": "fused"}


def test_explicit_choices_are_honoured():
    assert resolve_kernels(KernelsConfig("eager", "torch", "plain"), "cpu", 32) == {
        "attention": "eager", "matmul": "torch", "loss": "plain"}


@pytest.mark.parametrize("setting", [KernelsConfig(attention="triton", matmul="torch"),
                                     KernelsConfig(attention="sdpa", matmul="triton"),
                                     KernelsConfig(loss="triton")])
def test_triton_on_cpu_without_interpreter_is_a_config_error(monkeypatch, setting):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match=r"kernels\.(attention|matmul|loss)=triton: .*TRITON_INTERPRET=1"):
        resolve_kernels(setting, "cpu", 32)


@needs_triton
def test_triton_attention_with_unsupported_head_dim_is_a_config_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ConfigError, match=r"d_model/num_heads\) is 48"):
        resolve_kernels(KernelsConfig(attention="triton"), "cpu", 48)


def test_unknown_choice_is_a_config_error():
    with pytest.raises(ConfigError, match="kernels.matmul='cublas'"):
        resolve_kernels(KernelsConfig(matmul="cublas"), "cpu", 32)
    with pytest.raises(ConfigError, match="kernels.loss='liger'"):
        resolve_kernels(KernelsConfig(loss="liger"), "cpu", 32)


@needs_triton
def test_install_keeps_parameter_names_and_ties(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = build_model(TINY, 32, seed=0)
    names = list(model.state_dict())
    params = dict(model.named_parameters())
    chosen = apply_kernels(model, KernelsConfig("triton", "triton"), "cpu")
    assert chosen == {"attention": "triton", "matmul": "triton", "loss": "fused"}
    assert list(model.state_dict()) == names
    assert all(p is params[n] for n, p in model.named_parameters())
    assert model.output.weight is model.tok_embeddings.weight
    block = model.layers["0"]
    assert type(block.attention.wq) is TritonLinear and isinstance(block.attention.wq, nn.Linear)
    assert type(block.feed_forward) is TritonFeedForward
    assert type(block.feed_forward.w1) is TritonLinear


def test_apply_sets_attention_fn():
    model = build_model(TINY, 32, seed=0)
    assert apply_kernels(model, KernelsConfig("eager", "torch"), "cpu")["attention"] == "eager"
    assert all(b.attention.attention_fn is eager_attention for b in model.layers.values())
    apply_kernels(model, KernelsConfig("auto", "auto"), "cpu")
    assert all(b.attention.attention_fn is sdpa_attention for b in model.layers.values())
    assert type(model.layers["0"].attention.wq) is TorchLinear and isinstance(model.layers["0"].attention.wq,
                                                                              nn.Linear)


def train_losses(kernels: KernelsConfig, steps: int = 3) -> tuple[dict, list[float], torch.Tensor]:
    model = build_model(TINY, 32, seed=0)
    chosen = apply_kernels(model, kernels, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    tokens = torch.randint(0, TINY.vocab_size, (2, 33), generator=g)  # one batch: the loss must fall on it
    for _ in range(steps):
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return chosen, losses, model.layers["1"].feed_forward.w2.weight.detach().clone()


@needs_triton
def test_model_trains_with_triton_kernels_like_the_torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _, ref_losses, ref_weight = train_losses(KernelsConfig("sdpa", "torch"))
    kernel_calls(reset=True)
    chosen, losses, weight = train_losses(KernelsConfig("triton", "triton"))
    calls = kernel_calls(reset=True)
    assert chosen == {"attention": "triton", "matmul": "triton", "loss": "fused"}
    # 3 steps x 2 layers of attention; 3 x (2 x (wq, wk, wv, wo, w2) + head) linears; 3 x 2 SwiGLUs
    assert calls == {"attention.triton": 6, "matmul.triton": 33, "swiglu.triton": 6}
    assert ref_losses[-1] < ref_losses[0]  # it is training, not standing still
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert torch.allclose(weight, ref_weight, rtol=1e-4, atol=1e-6)


@needs_triton
def test_dtensor_weights_fall_back_to_torch(monkeypatch):
    """Under a tensor-parallel plan the weights are DTensors: the swapped modules run F.linear instead."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    # the suite initialises process groups only in the ranks it spawns: one here leaked from another test
    assert not dist.is_initialized(), "a process group is already initialised in the pytest process"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        layer = nn.Linear(8, 4, bias=False)
        expected = layer(torch.ones(3, 8))
        layer.__class__ = TritonLinear
        layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Replicate()]))
        kernel_calls(reset=True)
        x = distribute_tensor(torch.ones(3, 8), mesh, [Replicate()])
        out = layer(x)
        assert kernel_calls(reset=True) == {"matmul.torch_fallback": 1}
        assert torch.allclose(out.full_tensor(), expected)
    finally:
        dist.destroy_process_group()


@needs_triton
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_triton_kernels_under_activation_checkpointing(monkeypatch, policy):
    """Recomputation re-runs the Triton forward inside backward: the gradients are the torch path's."""
    from raydist.parallel.checkpointing import make_run_layers

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tokens = torch.randint(0, TINY.vocab_size, (2, 17), generator=torch.Generator().manual_seed(4))

    def grads(kernels, run_layers):
        model = build_model(TINY, 16, seed=0)
        apply_kernels(model, kernels, "cpu")
        model.run_layers = run_layers
        cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    ref = grads(KernelsConfig("sdpa", "torch"), None)
    got = grads(KernelsConfig("triton", "triton"), make_run_layers(policy, TINY.num_layers))
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.allclose(got[name], ref[name], rtol=1e-4, atol=1e-6), name
