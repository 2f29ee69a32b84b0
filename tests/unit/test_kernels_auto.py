"""`kernels.* = auto` decided by measurement (raydist.kernels.choice, raydist.kernels.select), on a CPU.

The decision logic runs with a fake timer (a table of milliseconds per kind of shape and candidate) on a
device that *says* cuda: choosing and installing touch no GPU (the model is built on the meta device and the
kernel classes are only swapped, never run). The real timer (CUDA events) runs in tests/gpu and the suite.
"""

from __future__ import annotations

import json

import pytest
import torch

from raydist.config import KernelsConfig, ModelConfig
from raydist.kernels import apply_kernels, runtime
from raydist.kernels.attention import triton_causal_attention
from raydist.kernels.choice import (AttentionShape, ChoiceCache, KernelChooser, MatmulShape, Pick,
                                    choice_cache_path, forward_backward)
from raydist.kernels.select import (KernelChoices, TorchLinear, TritonFeedForward, TritonLinear, Workload,
                                    choose_auto, shared_choices)
from raydist.metrics.kernels import kernel_choices
from raydist.models.gpt import GPT, FeedForward, sdpa_attention
from raydist.models.peft import LoRALinear, add_lora

pytestmark = pytest.mark.skipif(runtime.triton_import_error() is not None,
                                reason=f"triton not importable: {runtime.triton_import_error()}")
TINY = ModelConfig(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, ffn_hidden=176, vocab_size=128)
CUDA = torch.device("cuda", 0)
WORKLOAD = Workload(micro_batch=2, seq_len=32, dtype=torch.bfloat16)


class FakeTimer:
    """Milliseconds per (kind, candidate) from a table; counts the calls per shape key."""

    def __init__(self, table: dict[tuple[str, str], float]):
        self.table = table
        self.calls: dict[str, int] = {}

    def __call__(self, shape, candidate: str) -> float:
        self.calls[shape.key()] = self.calls.get(shape.key(), 0) + 1
        return self.table[(shape.kind, candidate)]


def never(shape, candidate):
    raise AssertionError(f"timed {shape.key()} {candidate}, which must not be timed")


def meta_model(cfg: ModelConfig = TINY) -> GPT:
    with torch.device("meta"):
        return GPT(cfg, 32)


def test_auto_on_cpu_stays_torch_and_times_nothing(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton could run here, through the interpreter: still torch
    model = meta_model()
    chooser = KernelChooser("cpu", never)
    assert apply_kernels(model, KernelsConfig(), "cpu", WORKLOAD, chooser=chooser) == {
        "attention": "sdpa", "matmul": "torch", "loss": "fused"}
    assert shared_choices(model, KernelsConfig(), torch.device("cpu"), WORKLOAD) is None


def test_auto_picks_the_faster_kernel_per_shape():
    timer = FakeTimer({("attention", "triton"): 2.0, ("attention", "torch"): 3.0,  # Triton faster
                       ("matmul", "triton"): 5.0, ("matmul", "torch"): 4.0,  # cuBLAS faster
                       ("swiglu", "triton"): 1.0, ("swiglu", "torch"): 1.5})  # the fused SwiGLU faster
    model = meta_model()
    kernel_choices(reset=True)
    chosen = apply_kernels(model, KernelsConfig(), CUDA, WORKLOAD, chooser=KernelChooser("Fake GPU", timer))
    assert chosen == {"attention": "triton", "matmul": "torch+triton", "loss": "fused"}
    block = model.layers["0"]
    assert block.attention.attention_fn is triton_causal_attention
    assert type(block.feed_forward) is TritonFeedForward  # silu(x W1) * (x W3): Triton's
    assert type(block.attention.wq) is TorchLinear and type(block.feed_forward.w2) is TorchLinear  # cuBLAS's
    assert type(model.output) is TorchLinear  # the head computes the fused loss: torch's, untimed
    # each distinct shape timed once per candidate: attention; wq = wo (64 -> 64), wk = wv (64 -> 32), w2,
    # w1 = w3 (run alone only if the SwiGLU were torch's, decided anyway); the SwiGLU
    assert sorted(timer.calls.values()) == [2] * 6 and len(timer.calls) == 6
    tokens = WORKLOAD.micro_batch * WORKLOAD.seq_len
    assert f"matmul m{tokens} k64 n32 bfloat16 x[64,1] w[64,1]" in timer.calls
    assert "attention b2 h4 kv2 t32 e16 bfloat16 causal" in timer.calls
    # the metrics record each shape's pick with both times
    records = {r["shape"]: r for r in kernel_choices()}
    assert records["attention b2 h4 kv2 t32 e16 bfloat16 causal"] == {
        "kind": "attention", "shape": "attention b2 h4 kv2 t32 e16 bfloat16 causal", "kernel": "triton",
        "triton_ms": 2.0, "torch_ms": 3.0, "source": "measured"}
    assert records[f"swiglu m{tokens} k64 n176 bfloat16 x[64,1] w[64,1]"]["kernel"] == "triton"
    head = [r for r in records.values() if "n128 " in r["shape"]]
    assert head and head[0]["source"].startswith("the head computes the fused loss") and head[0]["torch_ms"] is None


def test_slower_triton_keeps_torchs_kernels_and_a_tie_goes_to_torch():
    timer = FakeTimer({("attention", "triton"): 3.0, ("attention", "torch"): 3.0,
                       ("matmul", "triton"): 9.0, ("matmul", "torch"): 4.0,
                       ("swiglu", "triton"): 2.0, ("swiglu", "torch"): 1.0})
    model = meta_model()
    chosen = apply_kernels(model, KernelsConfig(), CUDA, WORKLOAD, chooser=KernelChooser("Fake GPU", timer))
    assert chosen == {"attention": "sdpa", "matmul": "torch", "loss": "fused"}
    assert model.layers["1"].attention.attention_fn is sdpa_attention
    assert not any(isinstance(m, (TritonLinear, TritonFeedForward)) for m in model.modules())


def test_a_shape_is_measured_once_and_a_new_shape_again():
    timer = FakeTimer({("matmul", "triton"): 1.0, ("matmul", "torch"): 2.0})
    chooser = KernelChooser("Fake GPU", timer)
    first = chooser.choose(MatmulShape(64, 32, 16, "bfloat16"))
    again = chooser.choose(MatmulShape(64, 32, 16, "bfloat16"))
    assert first == again and first.source == "measured" and first.kernel == "triton"
    assert timer.calls == {"matmul m64 k32 n16 bfloat16 x[32,1] w[32,1]": 2}
    for other in (MatmulShape(128, 32, 16, "bfloat16"), MatmulShape(64, 32, 16, "float16"),
                  MatmulShape(64, 32, 16, "bfloat16", weight_strides=(1, 16))):  # M, dtype, a transposed W
        chooser.choose(other)
        assert timer.calls[other.key()] == 2
    assert len(timer.calls) == 4


def test_the_cache_file_round_trips_per_device_and_versions(tmp_path):
    path = tmp_path / "kernel_choices.json"
    shape = AttentionShape(1, 8, 2, 1024, 64, "bfloat16")
    timer = FakeTimer({("attention", "triton"): 1.25, ("attention", "torch"): 1.5})
    pick = KernelChooser("Fake GPU", timer, ChoiceCache(path), software="torch 9, triton 9").choose(shape)
    saved = json.loads(path.read_text())
    assert saved["version"] == 1
    assert saved["picks"] == {f"Fake GPU | torch 9, triton 9 | {shape.key()}": {
        "kind": "attention", "shape": shape.key(), "kernel": "triton", "triton_ms": 1.25, "torch_ms": 1.5}}
    # a new process on the same device and versions reads it instead of timing
    cached = KernelChooser("Fake GPU", never, ChoiceCache(path), software="torch 9, triton 9").choose(shape)
    assert cached == Pick("attention", shape.key(), "triton", 1.25, 1.5, "cache")
    assert pick.source == "measured"
    # another device, or another Triton, measures again and keeps both entries
    for device, software in (("Other GPU", "torch 9, triton 9"), ("Fake GPU", "torch 9, triton 10")):
        timer.calls.clear()
        KernelChooser(device, timer, ChoiceCache(path), software=software).choose(shape)
        assert timer.calls == {shape.key(): 2}
    assert len(json.loads(path.read_text())["picks"]) == 3
    assert not list(tmp_path.glob(".kernel_choices.json.*"))  # no temporary left behind


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"version": 7, "picks": {}}', "\x00\x01"])
def test_a_corrupt_cache_file_is_ignored_and_replaced(tmp_path, content, caplog):
    path = tmp_path / "kernel_choices.json"
    path.write_text(content)
    timer = FakeTimer({("matmul", "triton"): 3.0, ("matmul", "torch"): 2.0})
    pick = KernelChooser("Fake GPU", timer, ChoiceCache(path)).choose(MatmulShape(64, 32, 16, "float32"))
    assert pick.source == "measured" and pick.kernel == "torch" and len(timer.calls) == 1
    assert "kernel choice cache" in caplog.text
    assert len(ChoiceCache(path).load()) == 1  # rewritten whole


def test_malformed_cache_entries_are_skipped(tmp_path):
    path = tmp_path / "kernel_choices.json"
    shape = MatmulShape(64, 32, 16, "float32")
    key = f"Fake GPU | torch 9, triton 9 | {shape.key()}"
    entry = {"kind": "matmul", "shape": shape.key(), "kernel": "triton", "triton_ms": 1.0, "torch_ms": 2.0}
    bad = [dict(entry, kernel="torch"),  # not the faster of its own times
           dict(entry, triton_ms="fast"), dict(entry, torch_ms=float("nan")), dict(entry, torch_ms=True),
           dict(entry, shape="matmul m1 k1 n1 float32 x[1,1] w[1,1]"),  # another shape's entry under this key
           "triton"]
    for value in bad:
        path.write_text(json.dumps({"version": 1, "picks": {key: value}}))
        assert ChoiceCache(path).load() == {}, value
    path.write_text(json.dumps({"version": 1, "picks": {key: entry}}))
    assert ChoiceCache(path).load()[key].kernel == "triton"


def test_unsupported_shapes_take_torch_untimed():
    chooser = KernelChooser("Fake GPU", never)
    # a head dim the Triton attention lacks (48), tensor parallelism's DTensors, the fused-loss head
    cfg = ModelConfig(num_layers=1, d_model=96, num_heads=2, num_kv_heads=2, ffn_hidden=128, vocab_size=64)
    choices = choose_auto(meta_model(cfg), KernelsConfig(), Workload(1, 32, torch.bfloat16, tp=2), chooser)
    assert choices.attention.kernel == "torch" and "head dim 48" in choices.attention.source
    assert {p.source for p in choices.modules.values()} == {
        "tensor parallelism hands it DTensors", "the head computes the fused loss (torch's chunked matmuls)"}
    model = meta_model()
    timer = FakeTimer({("attention", "triton"): 1.0, ("attention", "torch"): 2.0})
    choices = choose_auto(model, KernelsConfig(matmul="torch"), Workload(1, 32, torch.bfloat16, cp=2),
                          KernelChooser("Fake GPU", timer))
    assert choices.attention.source == "context parallelism runs its own attention" and not choices.modules
    assert not timer.calls


def test_the_budget_bounds_measuring_and_unmeasured_picks_are_not_cached(tmp_path):
    clock = iter(range(0, 1000, 30)).__next__  # every measurement takes 30 "seconds"
    timer = FakeTimer({("matmul", "triton"): 1.0, ("matmul", "torch"): 2.0})
    cache = ChoiceCache(tmp_path / "c.json")
    chooser = KernelChooser("Fake GPU", timer, cache, budget_s=50, clock=clock)
    picks = [chooser.choose(MatmulShape(64 * i, 32, 16, "bfloat16")) for i in (1, 2, 3)]
    assert [p.source for p in picks[:2]] == ["measured", "measured"]
    assert picks[2].kernel == "torch" and picks[2].source == "not measured: the 50 s measuring budget was spent"
    assert len(timer.calls) == 2 and len(cache.load()) == 2


def test_a_failing_triton_kernel_falls_back_to_torch():
    def timer(shape, candidate):
        if candidate == "triton":
            raise RuntimeError("out of resource: shared memory\nmore")
        return 1.0

    pick = KernelChooser("Fake GPU", timer).choose(MatmulShape(64, 32, 16, "bfloat16"))
    assert pick.kernel == "torch" and pick.source == "the Triton kernel failed: RuntimeError: out of resource: shared memory"


def test_choices_survive_json_and_install_the_same_kernels():
    timer = FakeTimer({("attention", "triton"): 2.0, ("attention", "torch"): 3.0,
                       ("matmul", "triton"): 5.0, ("matmul", "torch"): 4.0,
                       ("swiglu", "triton"): 1.0, ("swiglu", "torch"): 1.5})
    choices = choose_auto(meta_model(), KernelsConfig(), WORKLOAD, KernelChooser("Fake GPU", timer))
    again = KernelChoices.from_json(choices.to_json())
    assert again == choices
    model = meta_model()
    assert apply_kernels(model, KernelsConfig(), CUDA, WORKLOAD, choices=again)["matmul"] == "torch+triton"
    assert type(model.layers["1"].feed_forward) is TritonFeedForward


def test_the_default_cache_sits_beside_the_calibration(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYDIST_CACHE", str(tmp_path))
    assert choice_cache_path() == tmp_path / "kernel_choices.json"


def _agree(tmp: str) -> dict:
    """Each rank's fake timer says the opposite of the other's; the ranks must install rank 0's picks."""
    import torch.distributed as dist

    rank = dist.get_rank()
    slow = 1.0 if rank == 0 else 3.0
    timer = FakeTimer({("attention", "triton"): slow, ("attention", "torch"): 2.0,
                       ("matmul", "triton"): slow, ("matmul", "torch"): 2.0,
                       ("swiglu", "triton"): slow, ("swiglu", "torch"): 2.0})
    model = meta_model()
    choices = shared_choices(model, KernelsConfig(), CUDA, WORKLOAD, None, KernelChooser(f"GPU {rank}", timer))
    chosen = apply_kernels(model, KernelsConfig(), CUDA, WORKLOAD, choices=choices)
    return {"chosen": chosen, "timed": len(timer.calls), "ffn": type(model.layers["0"].feed_forward).__name__}


def test_ranks_install_rank_0s_decision():
    from raydist.parallel.runtime import spawn

    first, second = spawn(_agree, 2, "")
    assert first["timed"] > 0 and second["timed"] == 0  # only rank 0 measures
    # (the head's fused loss is torch's matmul whatever was measured)
    assert first["chosen"] == second["chosen"] == {"attention": "triton", "matmul": "torch+triton", "loss": "fused"}
    assert first["ffn"] == second["ffn"] == "TritonFeedForward"


@pytest.mark.parametrize("shape", [AttentionShape(1, 4, 2, 16, 16, "float32"),
                                   MatmulShape(24, 32, 16, "float32", bias=True),
                                   MatmulShape(24, 32, 16, "float32", swiglu=True, weight_strides=(1, 16))])
def test_the_timed_step_runs_forward_and_backward_of_both_candidates(monkeypatch, shape):
    """What cuda_timer times, run once here: the Triton candidate under the interpreter, torch's on the CPU."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if runtime.triton_unusable_reason("cpu") is not None:
        pytest.skip(runtime.triton_unusable_reason("cpu"))
    from raydist.metrics.kernels import kernel_calls

    before = kernel_calls()
    for candidate in ("triton", "torch"):
        forward_backward(shape, candidate, torch.device("cpu"))()
    ran = {k: v - before.get(k, 0) for k, v in kernel_calls().items() if v != before.get(k, 0)}
    assert ran == {f"{'attention' if shape.kind == 'attention' else shape.kind}.triton": 1}
    if isinstance(shape, MatmulShape):  # the layouts asked for: the transposed weights are strided views
        assert shape.key().endswith(f"w[{shape.weight_strides[0]},{shape.weight_strides[1]}]")


def test_feedforward_with_lora_is_left_alone():
    model = meta_model()
    ff = model.layers["0"].feed_forward
    add_lora(ff.w1, 2, 4.0, 0, "layers.0.feed_forward.w1")
    timer = FakeTimer({("attention", "triton"): 1.0, ("attention", "torch"): 2.0,
                       ("matmul", "triton"): 1.0, ("matmul", "torch"): 2.0,
                       ("swiglu", "triton"): 1.0, ("swiglu", "torch"): 2.0})
    choices = choose_auto(model, KernelsConfig(), WORKLOAD, KernelChooser("Fake GPU", timer))
    # the fused SwiGLU reads the gate and up weights directly: it would skip the adapter; the adapted
    # linear keeps its own class
    assert "layers.0.feed_forward" not in choices.modules and "layers.0.feed_forward.w1" not in choices.modules
    assert "layers.1.feed_forward" in choices.modules and "layers.0.feed_forward.w3" in choices.modules
    apply_kernels(model, KernelsConfig(), CUDA, WORKLOAD, choices=choices)
    assert type(ff) is FeedForward and type(ff.w1) is LoRALinear
