"""The GPU check suite: one command that checks and measures raydist on a CUDA machine, one JSON of figures.

    python benchmarks/gpu_suite.py [--out gpu_suite.json] [--quick] [--skip-tests]

On any CUDA machine, in order:
1. `pytest tests/gpu`: the Triton kernels against their references in bf16/fp16, `Trainer` + `fit` under a
   1-rank NCCL group, FSDP2 with bf16 mixed precision, the pipeline executor with a 1-stage schedule, and
   checkpoints saved from and loaded into GPU memory (counts and every test's outcome go to the JSON);
2. the kernel benchmark at Llama 3 8B/70B shapes (benchmarks/kernels.py `--llama`): causal GQA attention
   forward+backward, Triton vs `F.scaled_dot_product_attention`, T = 2k, 4k, 8k; the MLP GEMMs of
   4096 x 14336 and 8192 x 28672, Triton vs `torch.matmul`; bf16;
3. the MFU of a Llama-3-8B-shaped block stack (benchmarks/mfu.py), Triton kernels and torch's.

Exit status: 0 when every test passed (or, without CUDA, after the skip), 1 when a test failed; the
benchmarks' own failures are recorded in the JSON and fail the run too. Without CUDA it prints why it
skipped and exits 0 (and writes {"skipped": reason} with --out): nothing here means anything on a CPU.
The suite needs no Ray and no network: it imports none, and the tests prepare a tiny corpus on the fly.
`--quick` shortens the benchmarks (one sequence length, fewer steps) for a first look.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def skip_reason() -> str | None:
    """Why the suite cannot run here (no CUDA device visible to torch), or None."""
    import torch

    if torch.cuda.is_available():
        return None
    build = torch.version.cuda or "none (a CPU-only build)"
    return (f"no CUDA device visible to torch {torch.__version__} (CUDA build: {build}); the GPU check suite "
            "runs tests/gpu, the kernel benchmark and the MFU measurement on a CUDA machine only")


def environment() -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "host": platform.node()}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as exc:  # reported, not fatal: the tests say what needs it
        info["triton"] = f"not importable: {exc}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), device_count=torch.cuda.device_count(),
                    memory_gb=round(props.total_memory / 1e9, 1), capability=f"{props.major}.{props.minor}")
    return info


def run_tests(paths: list[str]) -> dict:
    """pytest on `paths` in a subprocess; counts and every test case's outcome from its JUnit XML."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "junit.xml")
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", *paths, "-q", "-rfEs", "-p", "no:cacheprovider",
                               f"--junitxml={report}"], cwd=ROOT, text=True)
        wall = time.perf_counter() - start
        out = {"paths": paths, "exit_status": proc.returncode, "wall_s": round(wall, 1)}
        if not os.path.exists(report):
            out["error"] = "pytest wrote no report (did it start? is pytest installed?)"
            return out
        cases = []
        for case in ET.parse(report).getroot().iter("testcase"):
            outcome, message = "passed", ""
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                    message = (child.get("message") or "").splitlines()[0][:300] if child.get("message") else ""
            cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                          "time_s": float(case.get("time") or 0), **({"message": message} if message else {})})
    for key in ("passed", "failed", "error", "skipped"):
        out[key] = sum(c["outcome"] == key for c in cases)
    out["cases"] = cases
    return out


def run_benchmarks(quick: bool) -> dict:
    """The kernel benchmark at Llama shapes and the MFU rows; a failure is recorded with its traceback."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import kernels as kernel_bench
    import mfu as mfu_bench

    out: dict = {}
    seq_lens = [4096] if quick else [2048, 4096, 8192]
    for name, fn in (("attention", lambda: kernel_bench.llama_attention_rows(seq_lens, torch.bfloat16, 16384)),
                     ("gemm", lambda: kernel_bench.llama_gemm_rows(8192, torch.bfloat16)),
                     ("mfu", lambda: mfu_bench.mfu_rows(layers=4, seq_len=8192, batch=1, steps=3 if quick else 10))):
        try:
            out[name] = fn()
        except Exception:
            out[name] = {"error": traceback.format_exc()}
            print(f"gpu_suite: the {name} benchmark failed:\n{out[name]['error']}", flush=True)
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="", help="write the figures here (JSON)")
    parser.add_argument("--quick", action="store_true", help="one sequence length, fewer timed steps")
    parser.add_argument("--skip-tests", action="store_true", help="only the benchmarks")
    args = parser.parse_args(argv)
    figures: dict = {"suite": "raydist GPU check suite", "environment": environment()}
    reason = skip_reason()
    if reason is not None:
        print(f"gpu_suite: SKIPPED: {reason}")
        figures["skipped"] = reason
        if args.out:
            Path(args.out).write_text(json.dumps(figures, indent=1))
        return 0
    env = figures["environment"]
    print(f"gpu_suite: {env['device']} x{env['device_count']}, torch {env['torch']} (CUDA {env['cuda']}), "
          f"triton {env['triton']}", flush=True)
    ok = True
    if not args.skip_tests:
        figures["tests"] = tests = run_tests(["tests/gpu"])
        ok = tests["exit_status"] == 0
        print(f"gpu_suite: tests/gpu: {tests.get('passed', 0)} passed, {tests.get('failed', 0)} failed, "
              f"{tests.get('error', 0)} errors, {tests.get('skipped', 0)} skipped", flush=True)
    figures["benchmarks"] = bench = run_benchmarks(args.quick)
    ok = ok and not any(isinstance(v, dict) and "error" in v for v in bench.values())
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
        print(f"gpu_suite: figures written to {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
