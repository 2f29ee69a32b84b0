"""The GPU check suite on a CPU machine: a clean skip with the reason, no Ray or CUDA touched by anything it
imports, and its code paths exercised on tiny shapes with the Triton kernels under TRITON_INTERPRET=1 (the
figures mean nothing on a CPU; that the code runs and the kernels agree with torch does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from raydist.kernels import runtime

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(runtime.triton_import_error() is not None,
                                  reason=f"triton not importable: {runtime.triton_import_error()}")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the suite would run")


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra)
    return env


@no_cuda
def test_cpu_run_of_the_suite_skips_with_the_reason(tmp_path):
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--out", str(out)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gpu_suite: SKIPPED: no CUDA device visible to torch" in proc.stdout
    figures = json.loads(out.read_text())
    assert figures["skipped"].startswith("no CUDA device") and figures["environment"]["torch"] == torch.__version__
    assert "tests" not in figures and "benchmarks" not in figures


BLOCK_RAY = """
import importlib.abc, sys
class BlockRay(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(name + " is blocked: the GPU machines have no Ray")
sys.meta_path.insert(0, BlockRay())
sys.path[:0] = [ROOT + "/benchmarks", ROOT + "/tests/gpu"]
import raydist.trainer, raydist.train_loop, raydist.testing, raydist.data.prepare, raydist.checkpoint
import raydist.schedule.executor, raydist.elastic.policy, raydist.planner.cost_model
import gpu_suite, kernels, mfu, test_kernels_cuda, test_training_cuda
import torch
assert not any(m == "ray" or m.startswith("ray.") for m in sys.modules)
print("cuda initialised:", torch.cuda.is_initialized())
"""


def test_nothing_the_suite_imports_needs_ray_or_touches_the_gpu():
    proc = subprocess.run([sys.executable, "-c", f"ROOT = {str(ROOT)!r}\n" + BLOCK_RAY], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "cuda initialised: False" in proc.stdout


@no_cuda
def test_run_tests_reports_every_gpu_test_skipped_here():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_suite

    result = gpu_suite.run_tests(["tests/gpu"])
    assert result["exit_status"] == 0 and result["failed"] == 0 and result["passed"] == 0
    assert result["skipped"] == len(result["cases"]) >= 10
    assert all("needs a CUDA GPU" in case["message"] for case in result["cases"])


@needs_triton
def test_benchmark_code_runs_under_the_interpreter(monkeypatch):
    """The suite's kernel rows and MFU measurement on tiny shapes, Triton through TRITON_INTERPRET=1 on CPU."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import kernels as kernel_bench
    import mfu as mfu_bench

    from raydist.config import ModelConfig

    [attention] = kernel_bench.llama_attention_rows([32], torch.float32, 64, device="cpu",
                                                    shapes={"tiny": {"heads": 4, "kv_heads": 2, "head_dim": 16}})
    assert attention["B"] == 2 and attention["sdpa_gqa"] == "enable_gqa"
    assert attention["max_rel_err"] < 1e-4  # the Triton kernel agrees with sdpa over grouped-query heads
    assert attention["triton_fwdbwd_ms"] > 0 and attention["sdpa_fwdbwd_tflops"] > 0
    gemms = kernel_bench.llama_gemm_rows(40, torch.float32, device="cpu", shapes={"tiny": {"d_model": 64, "ffn": 96}})
    assert [(g["proj"], g["K"], g["N"]) for g in gemms] == [("up", 64, 96), ("down", 96, 64)]
    assert all(g["max_rel_err"] < 1e-4 and g["triton_fwd_tflops"] > 0 for g in gemms)

    cfg = ModelConfig(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, ffn_hidden=96, vocab_size=128)
    row = mfu_bench.measure_mfu(cfg, 16, 2, steps=1, warmup=1, device="cpu", kernels=("triton", "triton"),
                                dtype=torch.float32)
    assert row["kernels"]["attention"] == {"triton": 2} and set(row["kernels"]["matmul"]) == {"triton"}
    assert row["peak_source"] == "measured:cpu_fp32_matmul" and 0 < row["mfu"] < 1
    assert row["achieved_tflops"] == pytest.approx(row["tokens_per_s"] * row["flops_per_token"] / 1e12)
    assert mfu_bench.llama3_8b_stack(4).ffn_hidden == 14336
