"""On a GPU, unlogged steps never make the host wait for the device: run under
`torch.cuda.set_sync_debug_mode("error")`, any stream synchronisation or blocking copy in them raises, and
`raydist.testing.HostSyncCounter` (which also sees event and device syncs) counts none. Reading the figures
afterwards (what a logged step does) gives the numbers.

World size 1 (one GPU): the Trainer with its accumulation runner (NCCL group, bf16, Triton kernels), and the
pipeline executor on a 1-stage schedule. The first step runs before the checks: lazy initialisation (Triton
autotuning, cuBLAS handles, the pinned-memory pool) is not a per-step cost. tests/unit/test_host_syncs.py
counts the same on the CPU for every layout. Skipped without CUDA (tests/gpu/conftest.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from raydist.parallel.runtime import spawn
from raydist.testing import HostSyncCounter, tiny_config

pytestmark = pytest.mark.cuda  # every test here needs a GPU (tests/gpu/conftest.py skips them without one)

SMALL = dict(num_layers=2, d_model=128, num_heads=2, num_kv_heads=1, ffn_hidden=352, vocab_size=320)
UNLOGGED = 4


def _unlogged_trainer_steps(raw: dict) -> dict:
    from raydist.config import Config
    from raydist.elastic.session import LocalSession
    from raydist.parallel.runtime import pick_device
    from raydist.training.trainer import Trainer

    cfg = Config.from_dict(raw)
    trainer = Trainer(cfg, pick_device(), LocalSession().start(cfg))
    try:
        trainer.train_step().loss  # warm-up, read
        torch.cuda.synchronize()
        with HostSyncCounter() as counter:
            torch.cuda.set_sync_debug_mode("error")
            try:
                steps = [trainer.train_step() for _ in range(UNLOGGED)]
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counted = list(counter.calls)
        return {"counted": counted, "losses": [s.loss for s in steps], "norms": [s.grad_norm for s in steps],
                "busy": [s.busy_s for s in steps], "device": str(trainer.device)}
    finally:
        trainer.close()


def test_unlogged_trainer_steps_do_not_sync_on_cuda(tiny_data):
    raw = tiny_config(tiny_data, model=SMALL, train={"steps": UNLOGGED + 1, "log_every": UNLOGGED + 1})
    raw["train"]["dtype"] = "auto"  # bf16 autocast on the GPU
    [r] = spawn(_unlogged_trainer_steps, 1, raw, device="cuda")
    assert r["device"].startswith("cuda")
    assert r["counted"] == [], r["counted"]
    assert all(math.isfinite(x) for x in r["losses"] + r["norms"]) and all(b > 0 for b in r["busy"])


def _unlogged_pipeline_steps(microbatches: int) -> dict:
    from raydist.config import ModelConfig
    from raydist.models.gpt import build_model
    from raydist.models.loss import cross_entropy
    from raydist.parallel.runtime import pick_device
    from raydist.parallel.pipeline_executor import PipelineExecutor, stage_timings
    from raydist.schedule.registry import make_schedule

    device = pick_device()
    cfg = ModelConfig(**SMALL)
    tokens = torch.randint(0, cfg.vocab_size, (2 * microbatches, 65), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(device)
    inputs, targets = list(tokens[:, :-1].chunk(microbatches)), list(tokens[:, 1:].chunk(microbatches))
    model = build_model(cfg, 64, seed=0, device=device)
    executor = PipelineExecutor([model], make_schedule("1f1b", 1, microbatches), 0, None,
                                activation_shape=(2, 64, cfg.d_model), loss_fn=cross_entropy, device=device)
    executor.step(inputs, targets).loss.item()  # warm-up, read
    with HostSyncCounter() as counter:
        torch.cuda.set_sync_debug_mode("error")
        try:
            steps = [executor.step(inputs, targets) for _ in range(UNLOGGED)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    counted = list(counter.calls)
    timings = stage_timings(steps, None, device)
    return {"counted": counted, "losses": [float(s.loss) for s in steps], "timings": timings,
            "timeline": steps[-1].timeline}


def test_unlogged_pipeline_steps_do_not_sync_on_cuda():
    [r] = spawn(_unlogged_pipeline_steps, 1, 4, device="cuda")
    assert r["counted"] == [], r["counted"]
    assert all(math.isfinite(x) for x in r["losses"])
    assert len(r["timings"]) == UNLOGGED and all(0 < t["pp_busy_s"][0] for t in r["timings"])
    assert len(r["timeline"]) == 8 and all(a["end_s"] >= a["start_s"] >= 0 for a in r["timeline"])
