"""Training on one CUDA GPU: `Trainer` + `fit` under a 1-rank NCCL process group, FSDP2 with bf16 mixed
precision, the pipeline executor with a 1-stage schedule, and checkpoints saved from and loaded into GPU
memory (async saves stage through pinned host memory).

World size 1 everywhere (one GPU is what a check machine has), but with the backends and devices of a real
run: NCCL initialised eagerly on cuda:0 (`raydist.parallel.runtime.spawn(device="cuda")`), CUDA tensors, the
device's default kernels (`kernels = auto`: on CUDA whichever of Triton and SDPA / cuBLAS the run measured
faster at its shapes, raydist.kernels.choice; the Triton kernels' own tests are test_kernels_cuda.py's), bf16. Each test also runs on the CPU (gloo, fp32, torch's kernels), so that its body is proven to run; the
CUDA cases are skipped without a GPU (tests/gpu/conftest.py).
"""

from __future__ import annotations

import json

import pytest
import torch

from raydist.parallel.runtime import spawn
from raydist.testing import run_fit, tiny_config

SMALL = dict(num_layers=2, d_model=128, num_heads=2, num_kv_heads=1, ffn_hidden=352, vocab_size=320)  # head dim 64
# what `kernels = auto` runs on the CPU (on CUDA: measured, `check_auto_kernels`)
CPU_AUTO_KERNELS = {"attention": "sdpa", "matmul": "torch", "loss": "fused"}


def check_auto_kernels(selected: dict, ran: dict, measured: list[dict] | None, device: str) -> None:
    """`auto`'s selection on `device`, and that what ran is what was selected (no fallback). On CUDA the
    selection is the measured picks: each measured shape's kernel is the faster of its two times."""
    if device == "cpu":
        assert selected == CPU_AUTO_KERNELS
    else:
        assert selected["attention"] in ("triton", "sdpa") and selected["loss"] == "fused", selected
        assert set(selected["matmul"].split("+")) <= {"torch", "triton"}, selected
    assert set(ran["attention"]) == {selected["attention"]}, ran
    assert set(ran["matmul"]) <= set(selected["matmul"].split("+")), ran  # never torch_fallback
    if measured is not None:
        timed = [m for m in measured if m["source"] in ("measured", "cache")]
        assert bool(timed) == (device == "cuda"), measured
        for m in timed:
            assert m["kernel"] == ("triton" if m["triton_ms"] < m["torch_ms"] else "torch"), m


def cuda_config(data: str, **sections) -> dict:
    """tiny_config on the device's defaults (train.dtype auto: bf16 autocast on CUDA, fp32 on the CPU;
    kernels auto: SDPA and cuBLAS on CUDA)."""
    sections.setdefault("model", SMALL)
    raw = tiny_config(data, **sections)
    raw["train"]["dtype"] = sections.get("train", {}).get("dtype", "auto")
    return raw


# ---- Trainer + fit under NCCL -----------------------------------------------------------------------


def test_fit_on_cuda_with_nccl(tiny_data, tmp_path, monkeypatch, device):
    """The whole loop on cuda:0 with an NCCL group: logging (its collectives), evaluation, async checkpoints
    (pinned staging), the final checkpoint and summary; then a run killed after step 7 resumes from its
    newest committed checkpoint in GPU memory and matches the uninterrupted run."""
    monkeypatch.setenv("RAYDIST_TEST_DEVICE", device)  # run_fit: NCCL on cuda:0, or gloo on the CPU
    raw = cuda_config(tiny_data, train={"steps": 8, "eval_every": 4, "eval_batches": 1, "log_every": 2},
                      checkpoint={"every_steps": 2, "async_save": True})
    [reference] = run_fit(raw, 1, str(tmp_path / "reference"))
    summary = json.loads((tmp_path / "reference" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 8
    check_auto_kernels(summary["kernels_selected"], summary["kernels"], summary["kernels_measured"], device)
    assert summary["final_val_loss"] < summary["first_val_loss"]
    assert all(torch.isfinite(torch.tensor(reference.losses)))
    committed = sorted(p.parent.name for p in (tmp_path / "reference" / "checkpoints").glob("step_*/COMMIT.json"))
    assert committed[-1] == "step_00000008", committed

    run_dir = str(tmp_path / "killed")
    assert run_fit(raw, 1, run_dir, crash_after_step=7) is None
    [resumed] = run_fit(raw, 1, run_dir)  # from step 4 or 6, whichever had committed
    redone = len(resumed.losses)
    assert redone in (2, 4), redone
    # the same samples from the restored data position, and the same losses up to kernel autotuning noise
    # (each process picks its own Triton tile configs, so bf16 roundings may differ)
    assert [ids.tolist() for ids in resumed.sample_ids] == [ids.tolist() for ids in reference.sample_ids[-redone:]]
    assert resumed.losses == pytest.approx(reference.losses[-redone:], rel=5e-3)


# ---- FSDP2 with bf16 mixed precision ----------------------------------------------------------------


def _fsdp_bf16(steps: int) -> dict:
    """AdamW steps of the same model as FSDP2 (bf16 parameters in compute, fp32 master shards and fp32
    reduction) and as plain bf16 autocast, both with the device's kernels; the dtypes FSDP computes and
    stores in, and the kernels that ran under FSDP."""
    from raydist.config import KernelsConfig, ModelConfig
    from raydist.kernels import apply_kernels
    from raydist.kernels.choice import default_chooser
    from raydist.kernels.select import Workload
    from raydist.parallel.layout import Layout
    from raydist.metrics.kernels import kernel_calls, kernels_ran
    from raydist.models.gpt import build_model
    from raydist.parallel.parallelize import _parallelize_module
    from raydist.parallel.data_parallel import FSDP, NoDataParallel
    from raydist.parallel.runtime import pick_device

    device = pick_device()  # cuda:0 under NCCL, else the CPU
    cfg = ModelConfig(**SMALL)
    layout = Layout(micro_batch=2)
    mesh = layout.spec.build(device.type)
    # one batch every step: the model memorises it, so the loss must fall (on fresh random tokens it need not)
    tokens = torch.randint(0, cfg.vocab_size, (2, 65), generator=torch.Generator().manual_seed(0)).to(device)
    out = {}
    chooser = default_chooser(device) if device.type == "cuda" else None  # one decision for both models
    for name, strategy in (("fsdp", FSDP(mesh, device, torch.bfloat16)),
                           ("autocast", NoDataParallel(mesh, device, torch.bfloat16))):
        model = build_model(cfg, 64, seed=0)
        chosen = apply_kernels(model, KernelsConfig(), device, Workload(2, 64, torch.bfloat16), chooser=chooser)
        module, loss_fn = _parallelize_module(model, mesh, layout, strategy, device)
        seen = []
        hook = model.layers["0"].attention.wq.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        before, losses = kernel_calls(), []
        for _ in range(steps):
            with strategy.autocast(device.type):
                loss = loss_fn(module(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        hook.remove()
        param = model.layers["0"].attention.wq.weight
        out[name] = {"losses": losses, "compute_dtype": str(seen[0]), "param_dtype": str(param.dtype),
                     "param_type": type(param).__name__, "kernels": kernels_ran(since=before), "chosen": chosen}
    return out


def test_fsdp_bf16_mixed_precision_on_cuda(device):
    [result] = spawn(_fsdp_bf16, 1, 3, device=device)
    fsdp, autocast = result["fsdp"], result["autocast"]
    assert fsdp["param_type"] == "DTensor" and fsdp["param_dtype"] == "torch.float32"  # fp32 master shards
    assert fsdp["compute_dtype"] == "torch.bfloat16" and autocast["compute_dtype"] == "torch.bfloat16"
    # FSDP2 hands the blocks plain unsharded tensors in forward: the selected kernels run, no fallback
    check_auto_kernels(fsdp["chosen"], fsdp["kernels"], None, device)
    assert fsdp["chosen"] == autocast["chosen"]  # the second model's decision: the first's, from memory
    assert fsdp["losses"][-1] < fsdp["losses"][0]
    for a, b in zip(fsdp["losses"], autocast["losses"]):  # two bf16 paths: close, not equal
        assert abs(a - b) <= 2e-2 * abs(b), (fsdp["losses"], autocast["losses"])


# ---- the pipeline executor with one stage -----------------------------------------------------------


def _pipeline_one_stage(microbatches: int) -> dict:
    from raydist.config import ModelConfig
    from raydist.models.gpt import build_model
    from raydist.models.loss import cross_entropy
    from raydist.parallel.runtime import pick_device
    from raydist.parallel.pipeline_executor import PipelineExecutor
    from raydist.schedule.registry import make_schedule

    device = pick_device()
    cfg = ModelConfig(**SMALL)
    tokens = torch.randint(0, cfg.vocab_size, (2 * microbatches, 65), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(device)
    inputs, targets = list(tokens[:, :-1].chunk(microbatches)), list(tokens[:, 1:].chunk(microbatches))
    reference = build_model(cfg, 64, seed=0, device=device)
    ref_loss = cross_entropy(reference(tokens[:, :-1]), tokens[:, 1:])
    ref_loss.backward()
    model = build_model(cfg, 64, seed=0, device=device)
    executor = PipelineExecutor([model], make_schedule("1f1b", 1, microbatches), 0, None,
                                activation_shape=(2, 64, cfg.d_model), loss_fn=cross_entropy, device=device)
    stats = executor.step(inputs, targets)
    worst = max(float((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12))
                for p, q in zip(model.parameters(), reference.parameters()))
    return {"loss": float(stats.loss), "ref_loss": ref_loss.item(), "busy_s": stats.busy_s, "wall_s": stats.wall_s,
            "timeline": stats.timeline, "worst_grad_rel": worst}


def test_pipeline_executor_one_stage_on_cuda(device):
    """pp needs 2 ranks in a layout, but the executor runs a 1-stage 1F1B schedule (every action local):
    on CUDA it must give the single-process loss and gradients, and time its actions."""
    [r] = spawn(_pipeline_one_stage, 1, 4, device=device)
    assert abs(r["loss"] - r["ref_loss"]) <= 1e-4 * abs(r["ref_loss"])
    assert r["worst_grad_rel"] < 1e-3
    assert [(a["kind"], a["microbatch"]) for a in r["timeline"][:2]] == [("F", 0), ("B", 0)]
    assert len(r["timeline"]) == 8 and all(a["end_s"] >= a["start_s"] >= 0 for a in r["timeline"])
    assert 0 < r["busy_s"] <= r["wall_s"]


# ---- checkpoints from GPU memory --------------------------------------------------------------------


def _checkpoint_roundtrip(raw: dict, run_dir: str, blocking: bool) -> dict:
    from raydist.checkpoint import CheckpointManager, staging
    from raydist.config import Config
    from raydist.parallel.runtime import pick_device
    from raydist.training.trainer import Trainer

    pinned = []
    real_pinned_copy = staging._pinned_copy

    def recording(tensor):
        host = real_pinned_copy(tensor)
        pinned.append((host.to_local() if hasattr(host, "to_local") else host).is_pinned())
        return host

    staging._pinned_copy = recording  # `stage` (the async save's host copy) looks it up at each call
    device = pick_device()
    cfg = Config.from_dict(raw)
    trainer = Trainer(cfg, device)
    for _ in range(2):
        trainer.train_step()
    assert next(trainer.pm.model.parameters()).device == device
    manager = CheckpointManager(run_dir, keep=2, group=trainer.checkpoint_group, log=lambda *_: None)
    manager.save(trainer.step, trainer.state_parts(), blocking=blocking)
    manager.wait()
    saved = trainer.full_parameters()
    saved_moments = _moments(trainer)
    trainer.close()
    fresh = Trainer(cfg, device)  # untrained, step 0, on the GPU
    manager.load(manager.latest(), fresh.state_parts())
    loaded = fresh.full_parameters()
    fresh_moments = _moments(fresh)
    on_gpu = all(p.device == device for p in fresh.pm.model.parameters())
    fresh.close()
    return {"step": fresh.step, "pinned": pinned, "on_device": on_gpu, "device": str(device),
            "params_equal": saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved),
            "moments": len(saved_moments), "moments_equal": saved_moments.keys() == fresh_moments.keys() and
            all(torch.equal(saved_moments[k], fresh_moments[k]) for k in saved_moments)}


def _moments(trainer) -> dict[tuple[str, str], torch.Tensor]:
    """AdamW's exp_avg / exp_avg_sq by (parameter name, key), on the CPU."""
    out = {}
    for name, param in trainer.pm.model.named_parameters():
        for key, value in trainer.optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor) and value.ndim:
                out[(name, key)] = value.detach().cpu().clone()
    return out


@pytest.mark.parametrize("blocking", [False, True], ids=["async-pinned", "blocking"])
def test_checkpoint_save_and_load_from_gpu_memory(tiny_data, tmp_path, blocking, device):
    raw = cuda_config(tiny_data, train={"steps": 4})
    [r] = spawn(_checkpoint_roundtrip, 1, raw, str(tmp_path), blocking, device=device)
    assert r["device"] == ("cuda:0" if device == "cuda" else "cpu") and r["on_device"]
    assert r["step"] == 2 and r["params_equal"] and r["moments"] > 0 and r["moments_equal"]
    if blocking or device == "cpu":
        assert r["pinned"] == []  # blocking saves copy as before (pageable), and host tensors need no staging DMA
    else:
        assert r["pinned"] and all(r["pinned"])  # every CUDA tensor went through pinned host memory


# ---- eager NCCL initialisation of a group created without device_id (as Ray Train creates it) ----------


def _bind_after_plain_init() -> tuple[bool, str, float]:
    import torch.distributed as dist

    from raydist.parallel.runtime import bind_device, free_port

    dist.destroy_process_group()  # spawn's group was created with device_id; start again as Ray Train does
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    bound = bind_device(torch.device("cuda", 0))
    group = dist.new_group([0])  # split from the bound communicator
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x, group=group)
    torch.cuda.synchronize()
    return bound, str(dist.distributed_c10d._get_default_group().bound_device_id), float(x.sum())


@pytest.mark.cuda  # NCCL: no CPU counterpart (a gloo group cannot be bound: tests/unit/test_devices.py)
def test_bind_device_connects_a_plain_nccl_group_eagerly():
    [(bound, device, total)] = spawn(_bind_after_plain_init, 1, device="cuda")
    assert bound and device == "cuda:0" and total == 4.0
