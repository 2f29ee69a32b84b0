"""The GPU check suite: one command that checks and measures raydist on a CUDA machine, one JSON of figures.

    python benchmarks/gpu_suite.py [--out gpu_suite.json] [--json] [--quick] [--skip-tests] [--budget-s 550]

On a machine with no network and no Ray (the GPU machines this project borrows), from the repository root:

    python3 -m pip install -q --no-deps --no-build-isolation -e . && \
        python3 benchmarks/gpu_suite.py --out $OUT/gpu_suite.json --json

(`--no-build-isolation`: pip's isolated build would download setuptools.) On any CUDA machine, in order,
each part in its own process under its own time budget:
1. tests: `pytest -m cuda` on tests/gpu (the kernel tests last: they spend most of their time compiling and
   autotuning Triton kernels): `Trainer` + `fit` under a 1-rank NCCL group, FSDP2 with bf16 mixed
   precision, the pipeline executor with a 1-stage schedule, checkpoints saved from and loaded into GPU
   memory, no host sync on unlogged steps, the Triton kernels against their references in bf16/fp16.
   Every test's outcome and time go to the JSON, and every attempt to import Ray (blocked, as the GPU
   machines have none: tests/gpu/no_ray) is listed;
2. attention: benchmarks/kernels.py's causal GQA attention at the Llama 3 8B/70B heads, forward+backward,
   Triton vs `F.scaled_dot_product_attention`, T = 2k, 4k, 8k (4k with --quick), bf16;
3. gemm: the MLP GEMMs of 4096 x 14336 and 8192 x 28672 over 8192 tokens, Triton vs `torch.matmul`, bf16;
   auto: what `kernels = auto` picks at one Llama 3 8B and 70B block over one sequence of T = 8192 (4096
   with --quick), bf16: the run's own decision (raydist.kernels.choice: Triton against SDPA / cuBLAS,
   forward + backward, CUDA events), each distinct shape's pick and both times (benchmarks/kernels.py);
4. mfu: the MFU of a Llama-3-8B-shaped stack of 4 blocks at T = 8192 (benchmarks/mfu.py), Triton kernels
   and torch's, 10 timed steps (3 with --quick);
5. loss: the loss of 8,192 tokens (4,096 with --quick) at V = 128256, D = 4096 under bf16 autocast, plain,
   fused (torch's chunk work) and fused with the Triton chunk kernels (benchmarks/fused_loss.py): seconds and
   peak memory of forward + backward.
6. moe: a mixture of experts' expert SwiGLU over 8,192 tokens (4,096 with --quick) at Qwen3-30B-A3B's and
   Mixtral 8x7B's shapes in bf16: the loop over experts, torch._grouped_mm and the Triton grouped GEMM
   (benchmarks/grouped_gemm.py): forward + backward seconds, TFLOP/s, speedup and error against the loop.

Budgets (seconds): tests 400, attention 50, gemm 40, auto 60 (40 of it measuring), mfu 60, loss 40, moe 30,
and all together at most --budget-s (550):
a part that runs out is killed with its processes and recorded as timed out (with the outcomes of the
tests that finished), and a part with under 15 s of the total left is not started. The JSON is rewritten
after every part, so a failure or a kill leaves what was measured. So the command ends within about 9.5
minutes on any machine (budgets plus the interpreter's and pip's start), inside one 10-minute device call.
Measured on one H100 (2026-11-27, cold Triton cache, when `kernels = auto` still meant Triton on CUDA):
the tests took about 485 s (by the order they ran in, about 200 s the training tests and 290 s the kernel
tests, most of it
Triton compiling and autotuning: the model test 79 s, bf16 autocast 34 s, the GELU matmuls 20-28 s), the
attention part 45 s, gemm 23 s, mfu 36 s. `auto` now means SDPA and cuBLAS there, so the training tests
compile no Triton kernel. If the tests part still runs out of budget on a cold Triton cache, the kernel
tests (run last) are the ones cut, and the JSON says which finished.

Exit status: 0 when every test passed (none skipped) and every part finished (or, without CUDA, after the skip), 1 when a
test failed or a part failed or timed out, 2 on bad arguments. Without CUDA it prints why it skipped and
exits 0 (writing {"skipped": reason} with --out): nothing here means anything on a CPU.
`--json` ends the output with one line: the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_RAY = ROOT / "tests" / "gpu" / "no_ray"  # a sitecustomize that blocks `import ray` and logs each attempt
BUDGET_S = {"tests": 400.0, "attention": 50.0, "gemm": 40.0, "auto": 60.0, "mfu": 60.0, "loss": 40.0, "moe": 30.0}
TOTAL_BUDGET_S = 550.0
MIN_PART_S = 15.0  # a part is not started with less of the total budget left
PER_TEST_TIMEOUT_S = 150.0  # pytest-timeout, where installed: one hung test does not eat the whole budget
BENCHMARKS = ("attention", "gemm", "auto", "mfu", "loss", "moe")


def test_paths() -> list[str]:
    """Every test file of tests/gpu, the kernel tests last: they spend most of their time compiling Triton
    kernels, so a tests part that runs out of budget cuts them, not the training tests."""
    files = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests" / "gpu").glob("test_*.py"))
    return sorted(files, key=lambda f: f.endswith("/test_kernels_cuda.py"))


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


# ---- running a part: a subprocess under a time limit ------------------------------------------------

@dataclass
class Finished:
    """How a subprocess ended: exit status (None: killed at the limit), its output lines, seconds, and the
    Ray imports it (or any process it started) tried."""

    exit_status: int | None
    lines: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    ray_imports: list[str] = field(default_factory=list)

    @property
    def timed_out(self) -> bool:
        return self.exit_status is None

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.lines[-n:])


def run_limited(cmd: list[str], timeout_s: float) -> Finished:
    """Runs `cmd` in the repository root in a new process group, echoing its output as it comes; at
    `timeout_s` the whole group (the forked ranks of a test included) is killed. Whatever the group left
    running when `cmd` ends is killed too, so a part never outlives its budget. The repository is on its
    PYTHONPATH (the suite runs without `pip install` too), and so is tests/gpu/no_ray: `import ray` fails
    in it and in every process it starts, as on the GPU machines, and each attempt is recorded."""
    with tempfile.TemporaryDirectory() as tmp:
        ray_log = os.path.join(tmp, "ray_imports.txt")
        path = os.pathsep.join(p for p in (str(NO_RAY), str(ROOT), os.environ.get("PYTHONPATH")) if p)
        done = _run_group(cmd, timeout_s, dict(os.environ, PYTHONPATH=path, RAYDIST_RAY_IMPORT_LOG=ray_log))
        if os.path.exists(ray_log):
            done.ray_imports = sorted(set(Path(ray_log).read_text().splitlines()))
    return done


def _run_group(cmd: list[str], timeout_s: float, env: dict) -> Finished:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    lines: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        status: int | None = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        status = None
    _kill_group(proc.pid)
    proc.wait()
    reader.join(timeout=10)
    return Finished(status, lines, round(time.perf_counter() - start, 1))


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # nothing left in the group
        pass


# ---- the parts --------------------------------------------------------------------------------------

def run_tests(paths: list[str], timeout_s: float, marker: str = "cuda") -> dict:
    """pytest on `paths` (the tests selected by `-m marker`) in a subprocess under `timeout_s`: counts and
    every test's outcome from its JUnit XML, or, when it was killed at the limit, from its verbose output
    (the tests that finished); `error` says what went wrong beyond failed tests."""
    import importlib.util

    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", *paths, "-m", marker, "-v", "-rfEs", "-p", "no:cacheprovider",
               f"--junitxml={report}"]
        if importlib.util.find_spec("pytest_timeout") is not None:
            cmd += ["-o", f"timeout={PER_TEST_TIMEOUT_S:g}"]
        done = run_limited(cmd, timeout_s)
        wrote_report = os.path.exists(report)
        cases = _junit_cases(report) if wrote_report else _verbose_cases(done.lines)
    out: dict = {"paths": paths, "marker": marker, "exit_status": done.exit_status, "wall_s": done.wall_s}
    if done.timed_out:
        out["error"] = f"timed out after {timeout_s:.0f} s (the budget); the outcomes of the tests that finished"
    elif not wrote_report:
        out["error"] = f"pytest exited with status {done.exit_status} and wrote no report (is pytest installed?)"
    elif not cases:
        out["error"] = f"pytest selected no test (-m {marker})"
    if out.get("error") or done.exit_status != 0:
        out["output_tail"] = done.tail(40)
    for outcome, key in (("passed", "passed"), ("failed", "failed"), ("error", "errors"), ("skipped", "skipped")):
        out[key] = sum(c["outcome"] == outcome for c in cases)
    out["ray_imports"] = done.ray_imports
    out["cases"] = cases
    return out


def _junit_cases(report: str) -> list[dict]:
    cases = []
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or "").splitlines()[0][:300] if child.get("message") else ""
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "time_s": round(float(case.get("time") or 0), 2), **({"message": message} if message else {})})
    return cases


def _verbose_cases(lines: list[str]) -> list[dict]:
    """`path::test[id] PASSED [ 10%]` lines of `pytest -v`."""
    words = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped"}
    cases = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and "::" in parts[0] and parts[1] in words:
            cases.append({"test": parts[0], "outcome": words[parts[1]]})
    return cases


def benchmark(name: str, quick: bool) -> list[dict]:
    """One benchmark part, in this process (the `--part` child): its rows."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import fused_loss as loss_bench
    import grouped_gemm as moe_bench
    import kernels as kernel_bench
    import mfu as mfu_bench

    if name == "attention":
        return kernel_bench.llama_attention_rows([4096] if quick else [2048, 4096, 8192], torch.bfloat16, 16384)
    if name == "gemm":
        return kernel_bench.llama_gemm_rows(8192, torch.bfloat16)
    if name == "auto":
        return kernel_bench.llama_auto_rows(4096 if quick else 8192, budget_s=BUDGET_S["auto"] - 20.0)
    if name == "mfu":
        return mfu_bench.mfu_rows(layers=4, seq_len=8192, batch=1, steps=3 if quick else 10)
    if name == "loss":
        return loss_bench.gpu_rows(tokens=4096 if quick else 8192)
    if name == "moe":
        return moe_bench.gpu_rows(tokens=4096 if quick else 8192, repeats=3 if quick else 5)
    raise ValueError(f"no benchmark part {name!r}")


def run_benchmark(name: str, quick: bool, timeout_s: float) -> dict:
    """The benchmark part `name` in a child process under `timeout_s`: {"rows": [...]}, or {"error": ...}
    with the child's last output lines."""
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = os.path.join(tmp, f"{name}.json")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--part-out", rows_file]
        done = run_limited(cmd + (["--quick"] if quick else []), timeout_s)
        rows = json.loads(Path(rows_file).read_text()) if done.exit_status == 0 and os.path.exists(rows_file) else None
    if rows is not None:
        return {"rows": rows, "wall_s": done.wall_s, "ray_imports": done.ray_imports}
    why = (f"timed out after {timeout_s:.0f} s (the budget)" if done.timed_out
           else f"exited with status {done.exit_status}")
    return {"error": f"the {name} benchmark {why}", "wall_s": done.wall_s, "ray_imports": done.ray_imports,
            "output_tail": done.tail(30)}


# ---- the suite --------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one `error:` line and exit 2, as every raydist command
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="", help="write the figures here (JSON), after every part")
    parser.add_argument("--json", action="store_true", help="end with one line: the figures as JSON")
    parser.add_argument("--quick", action="store_true", help="one sequence length, fewer timed steps")
    parser.add_argument("--skip-tests", action="store_true", help="only the benchmarks")
    parser.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S,
                        help=f"seconds for all parts together (default {TOTAL_BUDGET_S:g})")
    parser.add_argument("--part", choices=BENCHMARKS, help=argparse.SUPPRESS)  # a child: one benchmark
    parser.add_argument("--part-out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s:g}")
    if args.part and not args.part_out:
        parser.error("--part needs --part-out")
    out_dir = Path(args.out).resolve().parent if args.out else None
    if out_dir is not None and not out_dir.is_dir():
        parser.error(f"--out {args.out}: folder {out_dir} does not exist")
    return args


def write(figures: dict, out: str) -> None:
    if out:
        tmp = f"{out}.tmp"
        Path(tmp).write_text(json.dumps(figures, indent=1))
        os.replace(tmp, out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.part:  # a child process: one benchmark, its rows to --part-out
        rows = benchmark(args.part, args.quick)
        Path(args.part_out).write_text(json.dumps(rows))
        return 0
    started = time.perf_counter()
    figures: dict = {"suite": "raydist GPU check suite", "environment": environment()}
    reason = skip_reason()
    if reason is not None:
        print(f"gpu_suite: SKIPPED: {reason}")
        figures["skipped"] = reason
        return finish(figures, args, ok=True)
    env = figures["environment"]
    print(f"gpu_suite: {env['device']} x{env['device_count']}, torch {env['torch']} (CUDA {env['cuda']}), "
          f"triton {env['triton']}; budget {args.budget_s:g} s", flush=True)
    figures.update(budget_s=args.budget_s, parts={}, benchmarks={})
    deadline = started + args.budget_s
    plan = ([] if args.skip_tests else ["tests"]) + list(BENCHMARKS)
    ok = True
    for name in plan:
        left = deadline - time.perf_counter()
        limit = min(BUDGET_S[name], left)
        if limit < MIN_PART_S:
            figures["parts"][name] = {"status": "not run", "why": f"{left:.0f} s of the suite's budget left"}
            print(f"gpu_suite: {name}: not run ({left:.0f} s of the budget left)", flush=True)
            ok = False
            continue
        print(f"gpu_suite: {name} (budget {limit:.0f} s)", flush=True)
        part_start = time.perf_counter()
        try:
            result = run_tests(test_paths(), limit) if name == "tests" else run_benchmark(name, args.quick, limit)
        except Exception:  # the suite's own failure in a part: recorded, and the next part still runs
            result = {"error": traceback.format_exc()}
        if name == "tests":
            figures["tests"] = result
            print(f"gpu_suite: tests/gpu: {result.get('passed', 0)} passed, {result.get('failed', 0)} failed, "
                  f"{result.get('errors', 0)} errors, {result.get('skipped', 0)} skipped", flush=True)
        else:
            figures["benchmarks"][name] = result
        error = result.get("error")
        # on a CUDA machine every selected test must run: a skip there (Triton missing, say) is a failure
        passed = error is None and (name != "tests" or (result["exit_status"] == 0 and result["skipped"] == 0))
        status = "passed" if passed else "timed out" if error and "timed out" in error else "failed"
        figures["parts"][name] = {"status": status, "wall_s": round(time.perf_counter() - part_start, 1),
                                  "budget_s": round(limit), "ray_imports": len(result.get("ray_imports", []))}
        if result.get("ray_imports"):
            print(f"gpu_suite: {name}: Ray imports tried (blocked): {result['ray_imports']}", flush=True)
        ok = ok and passed
        write(figures, args.out)
    figures["wall_s"] = round(time.perf_counter() - started, 1)
    return finish(figures, args, ok)


def finish(figures: dict, args: argparse.Namespace, ok: bool) -> int:
    figures["status"] = "skipped" if "skipped" in figures else "passed" if ok else "failed"
    write(figures, args.out)
    if args.out:
        print(f"gpu_suite: figures written to {args.out}")
    if "parts" in figures:
        print("gpu_suite: " + ", ".join(f"{name} {part['status']}" for name, part in figures["parts"].items())
              + f"; {figures['status']} in {figures['wall_s']:.0f} s", flush=True)
    if args.json:
        print(json.dumps(figures, separators=(",", ":")), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
