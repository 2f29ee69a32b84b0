"""The GPU check suite on a CPU machine (on a GPU machine too, its devices hidden from the suite): a clean skip
with the reason, no Ray or CUDA touched by anything it imports or runs (the CPU cases of the training tests
under its Ray blocker), its runner's time limits and failure records, and its benchmark code on tiny shapes
with the Triton kernels under TRITON_INTERPRET=1 (the figures mean nothing on a CPU; that the code runs and
the kernels agree with torch does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from raydist.kernels import runtime
from skip_policy import CUDA_SKIP

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(runtime.triton_import_error() is not None,
                                  reason=f"triton not importable: {runtime.triton_import_error()}")
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # a CPU machine, on a GPU machine too: torch sees no CUDA device


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra)
    return env


def _suite(*args, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmarks/gpu_suite.py", *args], cwd=ROOT, env=_env(**env),
                          capture_output=True, text=True, timeout=300)


def test_cpu_run_of_the_suite_skips_with_the_reason(tmp_path):
    """The entry point end to end on a CPU machine: exit 0, the reason printed and in the JSON file, and
    the same figures as the `--json` line that ends the output."""
    out = tmp_path / "figures.json"
    proc = _suite("--out", str(out), "--json", **NO_GPU)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gpu_suite: SKIPPED: no CUDA device visible to torch" in proc.stdout
    figures = json.loads(out.read_text())
    assert figures["skipped"].startswith("no CUDA device") and figures["environment"]["torch"] == torch.__version__
    assert figures["status"] == "skipped" and "tests" not in figures and "benchmarks" not in figures
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == figures


@pytest.mark.parametrize("args,says", [(["--budget-s", "0"], "error: --budget-s must be positive, got 0"),
                                       (["--out", "/no/such/folder/f.json"], "error: --out /no/such/folder/f.json: "),
                                       (["--budget"], "error: argument --budget-s: expected one argument"),
                                       (["--part", "gemm"], "error: --part needs --part-out")])
def test_bad_arguments_get_one_error_line_and_exit_2(args, says):
    proc = _suite(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(says) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def _no_ray_env(log: Path) -> dict:
    """The environment the suite gives its parts: tests/gpu/no_ray first on the path, attempts logged."""
    path = os.pathsep.join([str(ROOT / "tests" / "gpu" / "no_ray"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, RAYDIST_RAY_IMPORT_LOG=str(log))


IMPORTS = """
import sys
sys.path[:0] = [ROOT + "/benchmarks", ROOT + "/tests/gpu"]
import raydist.training.trainer, raydist.training.loop, raydist.testing, raydist.data.prepare, raydist.checkpoint
import raydist.parallel.pipeline_executor, raydist.planner.policy, raydist.planner.cost_model
import gpu_suite, kernels, mfu, test_kernels_cuda, test_training_cuda, test_pipeline_clock_cuda
import torch
print("cuda initialised:", torch.cuda.is_initialized())
"""


def test_nothing_the_suite_imports_needs_ray_or_touches_the_gpu(tmp_path):
    """Imported with `import ray` blocked as the suite blocks it (tests/gpu/no_ray): no attempt at all, not
    even one that fell back; and no CUDA context."""
    log = tmp_path / "ray_imports.txt"
    proc = subprocess.run([sys.executable, "-c", f"ROOT = {str(ROOT)!r}\n" + IMPORTS], cwd=ROOT,
                          env=_no_ray_env(log), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "cuda initialised: False" in proc.stdout
    assert not log.exists(), log.read_text()


def test_the_blocker_fails_and_records_an_import_of_ray(tmp_path):
    """The check above can fail: an `import ray` under the blocker raises as on a machine without Ray, and
    is recorded with the importing line, also from a process started by the blocked one."""
    log = tmp_path / "ray_imports.txt"
    code = ("import subprocess, sys\n"
            "try:\n    import ray.train\nexcept ModuleNotFoundError as exc:\n    print('blocked:', exc.name)\n"
            "subprocess.run([sys.executable, '-c', 'import ray'])\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_no_ray_env(log), capture_output=True,
                          text=True, timeout=120)
    assert "blocked: ray" in proc.stdout, proc.stdout + proc.stderr
    assert "No module named 'ray' (blocked: the GPU machines have no Ray)" in proc.stderr  # the child's failure
    lines = log.read_text().splitlines()
    assert len(lines) == 2 and lines[0].startswith("ray from <string>:3 (pid ") and lines[1].startswith("ray from <string>:1")


def _gpu_suite():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_suite

    return gpu_suite


def test_run_tests_reports_every_gpu_test_skipped_here(monkeypatch):
    """What the suite runs (`-m cuda`) is exactly the tests that need CUDA: without one all skipped, with the
    reason, the one kind of skip a CI run allows (tests/skip_policy.py)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", NO_GPU["CUDA_VISIBLE_DEVICES"])  # the suite's pytest inherits it
    gpu_suite = _gpu_suite()
    paths = gpu_suite.test_paths()
    assert paths[-1] == "tests/gpu/test_kernels_cuda.py" and "tests/gpu/test_training_cuda.py" in paths
    result = gpu_suite.run_tests(paths, 120)
    assert result["exit_status"] == 0 and "error" not in result and result["failed"] == 0 and result["passed"] == 0
    assert result["skipped"] == len(result["cases"]) >= 20
    assert all(case["message"].startswith(CUDA_SKIP) for case in result["cases"]), result["cases"][:2]
    assert result["ray_imports"] == []


def test_cpu_parts_of_the_training_tests_run_without_ray():
    """The CPU cases of the training tests (Trainer, fit, FSDP, the executor, checkpoints: the paths with
    lazy imports, in forked ranks too) under the suite's runner with `import ray` blocked: all pass, and
    nothing tried to import Ray."""
    gpu_suite = _gpu_suite()
    result = gpu_suite.run_tests(["tests/gpu/test_training_cuda.py"], 300, marker="not cuda")
    assert result["exit_status"] == 0 and "error" not in result, result.get("output_tail")
    assert result["passed"] == 5 and result["failed"] == result["errors"] == 0
    assert all(case["test"].endswith("cpu]") or "cpu-" in case["test"] for case in result["cases"]), result["cases"]
    assert result["ray_imports"] == []


def test_a_part_past_its_budget_is_killed_with_its_children():
    """run_limited kills the whole process group at the limit (a child's own child too) and keeps the
    output so far."""
    gpu_suite = _gpu_suite()
    code = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            "print('grandchild', child.pid, flush=True)\ntime.sleep(120)\n")
    done = gpu_suite.run_limited([sys.executable, "-c", code], timeout_s=3)
    assert done.timed_out and done.exit_status is None and 3 <= done.wall_s < 30
    [pid] = [int(line.split()[1]) for line in done.lines if line.startswith("grandchild")]
    for _ in range(50):  # killed; reaped by init shortly after
        if not Path(f"/proc/{pid}").exists() or "State:\tZ" in Path(f"/proc/{pid}/status").read_text():
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"grandchild {pid} still running")


def test_run_tests_keeps_the_finished_outcomes_when_killed(tmp_path):
    (tmp_path / "test_slow.py").write_text("import time\n\ndef test_quick():\n    pass\n\n"
                                           "def test_hangs():\n    time.sleep(120)\n")
    gpu_suite = _gpu_suite()
    result = gpu_suite.run_tests([str(tmp_path / "test_slow.py")], 8, marker="not cuda")
    assert result["exit_status"] is None and result["error"].startswith("timed out after 8 s")
    assert [(c["test"].split("::")[-1], c["outcome"]) for c in result["cases"]] == [("test_quick", "passed")]
    assert result["passed"] == 1 and "output_tail" in result


def test_main_records_each_part_and_writes_the_json_after_each(tmp_path, monkeypatch, capsys):
    """The suite's loop with its parts faked and a fake clock: a failing part is recorded and the next one
    still runs; the JSON on disk holds every part finished so far; a part that would start with under
    MIN_PART_S of the budget left is recorded as not run; exit 1, and the --json line is the file."""
    gpu_suite = _gpu_suite()
    clock = {"now": 0.0}
    out = tmp_path / "figures.json"
    written = []

    def part(seconds, result):
        def run(*args, **kwargs):
            written.append(json.loads(out.read_text()) if out.exists() else None)
            clock["now"] += seconds
            return result
        return run

    monkeypatch.setattr(gpu_suite, "skip_reason", lambda: None)
    monkeypatch.setattr(gpu_suite, "environment", lambda: {"device": "fake", "device_count": 1, "torch": "t",
                                                           "cuda": "c", "triton": "tr"})
    monkeypatch.setattr(gpu_suite, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    monkeypatch.setattr(gpu_suite, "run_tests", part(100, {"exit_status": 0, "passed": 3, "failed": 0, "errors": 0,
                                                          "skipped": 0, "ray_imports": [], "cases": []}))
    benchmarks = {"attention": part(50, {"rows": [{"T": 2048}]}),
                  "gemm": part(40, {"error": "the gemm benchmark exited with status 1", "output_tail": "boom"})}
    monkeypatch.setattr(gpu_suite, "run_benchmark", lambda name, quick, limit: benchmarks[name](limit))
    status = gpu_suite.main(["--out", str(out), "--json", "--budget-s", "200"])
    assert status == 1
    figures = json.loads(out.read_text())
    assert [(n, p["status"]) for n, p in figures["parts"].items()] == [
        ("tests", "passed"), ("attention", "passed"), ("gemm", "failed"), ("auto", "not run"), ("mfu", "not run"),
        ("loss", "not run"), ("moe", "not run")]
    assert figures["parts"]["gemm"]["budget_s"] == 40 and figures["parts"]["mfu"]["why"] == "10 s of the suite's budget left"
    assert figures["benchmarks"]["gemm"]["output_tail"] == "boom" and figures["tests"]["passed"] == 3
    assert figures["status"] == "failed" and figures["wall_s"] == 190
    assert written[0] is None and list(written[1]["parts"]) == ["tests"] and list(written[2]["parts"]) == ["tests", "attention"]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == figures

    # a CUDA test skipped on a CUDA machine (Triton missing, say) fails the tests part
    monkeypatch.setattr(gpu_suite, "run_tests", part(10, {"exit_status": 0, "passed": 2, "failed": 0, "errors": 0,
                                                         "skipped": 1, "ray_imports": [], "cases": []}))
    assert gpu_suite.main(["--out", str(out), "--skip-tests"]) == 1  # (--skip-tests: the benchmarks alone)
    assert "tests" not in json.loads(out.read_text())["parts"]
    assert gpu_suite.main(["--out", str(out), "--budget-s", "200"]) == 1
    assert json.loads(out.read_text())["parts"]["tests"]["status"] == "failed"


@needs_triton
def test_benchmark_code_runs_under_the_interpreter(monkeypatch):
    """The suite's kernel rows and MFU measurement on tiny shapes, Triton through TRITON_INTERPRET=1 on CPU."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if runtime.triton_unusable_reason("cpu") is not None:
        pytest.skip(runtime.triton_unusable_reason("cpu"))
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
    # what `auto` picks: one block's distinct shapes, each measured (the head: the fused loss, untimed)
    auto = kernel_bench.llama_auto_rows(16, device="cpu", vocab_size=128, models={
        "tiny": {"d_model": 64, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden": 96}})
    assert [r["kind"] for r in auto] == ["attention", "matmul", "matmul", "swiglu", "matmul", "matmul", "matmul"]
    assert all(r["source"] == "measured" and r["triton_speedup"] > 0 for r in auto[:-1])
    assert auto[-1]["modules"] == ["output"] and auto[-1]["triton_ms"] is None

    cfg = ModelConfig(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, ffn_hidden=96, vocab_size=128)
    row = mfu_bench.measure_mfu(cfg, 16, 2, steps=1, warmup=1, device="cpu", kernels=("triton", "triton"),
                                dtype=torch.float32)
    assert row["kernels"]["attention"] == {"triton": 2} and set(row["kernels"]["matmul"]) == {"triton"}
    assert row["peak_source"] == "measured:cpu_fp32_matmul" and 0 < row["mfu"] < 1
    assert row["achieved_tflops"] == pytest.approx(row["tokens_per_s"] * row["flops_per_token"] / 1e12)
    assert mfu_bench.llama3_8b_stack(4).ffn_hidden == 14336
