"""metrics.jsonl and summary.json report the kernels that ran per module type, not the ones selected.

Under tensor parallelism the Triton linear gets DTensor weights and runs F.linear instead: the run selected
`matmul: triton` but ran `matmul: torch_fallback`, and the metrics must say so. The Triton kernels run on
CPU through Triton's interpreter (TRITON_INTERPRET=1, inherited by the spawned ranks).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from raydist.kernels import runtime
from raydist.metrics.kernels import count_call, kernel_calls, kernels_ran
from raydist.testing import run_fit, tiny_config

needs_triton = pytest.mark.skipif(runtime.triton_import_error() is not None,
                                  reason=f"triton not importable: {runtime.triton_import_error()}")
SHORT = {"steps": 2, "global_batch": 4, "micro_batch": 2, "log_every": 1, "eval_every": 0}


def records(run_dir: Path) -> tuple[list[dict], dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return lines, json.loads((run_dir / "summary.json").read_text())


def test_kernels_ran_groups_counts_by_module_type():
    before = kernel_calls()
    count_call("matmul.triton")
    count_call("matmul.torch_fallback")
    count_call("matmul.torch_fallback")
    count_call("attention.sdpa")
    assert kernels_ran(since=before) == {"attention": {"sdpa": 1}, "matmul": {"torch_fallback": 2, "triton": 1}}
    assert kernels_ran(since=kernel_calls()) == {}


def test_cpu_run_reports_the_torch_paths(tiny_data, tmp_path):
    raw = tiny_config(tiny_data, train=SHORT, checkpoint={"every_steps": 0})
    [result] = run_fit(raw, 1, str(tmp_path))
    lines, summary = records(tmp_path)
    assert summary["kernels_selected"] == {"attention": "sdpa", "matmul": "torch", "loss": "fused"}
    ran = summary["kernels"]
    assert set(ran) == {"attention", "matmul", "loss"} and set(ran["attention"]) == {"sdpa"}
    assert set(ran["matmul"]) == {"torch"}
    # one forward: 2 blocks of attention, and 2 x 7 linears (the projections of attention and the MLP) plus
    # the head, which computes the loss with its matmul (kernels.loss = auto: fused in this layout)
    forwards = ran["attention"]["sdpa"] / 2
    assert ran["matmul"]["torch"] == forwards * 15 and ran["loss"] == {"fused": forwards}
    assert forwards >= 2 * 2 + 1  # 2 steps x 2 micro-batches, and step 0's loss on the first batch
    assert lines[-1]["kernels"] == ran  # the last logged step is the last step: the same totals
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert lines[0]["kernels"]["attention"]["sdpa"] < lines[1]["kernels"]["attention"]["sdpa"]


@needs_triton
def test_tensor_parallel_run_reports_the_triton_linear_fallback(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    raw = tiny_config(tiny_data, train=SHORT, checkpoint={"every_steps": 0}, parallel={"tp": 2, "dp_replicate": 1},
                      kernels={"attention": "triton", "matmul": "triton"})
    run_fit(raw, 2, str(tmp_path))
    lines, summary = records(tmp_path)
    assert summary["kernels_selected"] == {"attention": "triton", "matmul": "triton", "loss": "fused"}
    ran = summary["kernels"]
    # every linear holds a DTensor weight under TP: all fall back to F.linear, none runs the Triton matmul
    assert ran["matmul"].get("torch_fallback", 0) > 0 and "triton" not in ran["matmul"], ran
    assert ran["swiglu"].get("torch_fallback", 0) > 0 and "triton" not in ran["swiglu"], ran
    # attention sees each rank's local heads as plain tensors: the Triton kernel does run
    assert ran["attention"].get("triton", 0) > 0 and set(ran["attention"]) == {"triton"}, ran
    # the head's loss: fused and vocabulary-parallel (its chunked matmuls are torch's)
    assert set(ran["loss"]) == {"fused"}, ran
    assert lines[-1]["kernels"] == ran


def test_a_cpu_run_reports_no_mfu_and_the_console_shows_none(tiny_data, tmp_path):
    # A matmul timed in the run understated the peak: MFU 153% on the default run's console (flops.py)
    from raydist.driver.console import Console, ProgressSink
    from raydist.metrics.flops import NO_CPU_PEAK

    raw = tiny_config(tiny_data, train=SHORT, checkpoint={"every_steps": 0})
    run_fit(raw, 1, str(tmp_path))
    lines, summary = records(tmp_path)
    logged = [r for r in lines if r.get("tokens_per_s")]
    assert logged and all(r["mfu"] is None and r["mfu_peak_source"] == NO_CPU_PEAK for r in logged)
    assert summary["mfu"] is None and summary["mfu_peak_source"] == NO_CPU_PEAK
    out = io.StringIO()
    ProgressSink(2, Console(out=out), stream=io.StringIO(), tty=False).metric(logged[-1])
    assert out.getvalue().startswith("step 2/2") and "MFU" not in out.getvalue()
