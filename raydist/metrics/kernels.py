"""Which kernels actually ran: call counts per path, and the per-module-type view metrics report.

Every place that picks a kernel at run time counts the path it took, `count_call("<module type>.<path>")`:

    attention.triton | attention.sdpa | attention.eager | attention.torch (context parallelism's blockwise
                                                                           torch formula)
    matmul.triton | matmul.torch | matmul.torch_fallback (a Triton linear given DTensors, e.g. under tensor
                                                          parallelism, runs F.linear)
    swiglu.triton | swiglu.torch_fallback (the fused MLP product, or its unfused torch form)

A count is one forward call of the module's kernel path (a recomputed forward under activation
checkpointing counts again; evaluation counts too). The selection in `[kernels]` says what was asked for;
these counts say what ran, which differs when a path falls back.

Where `kernels.* = auto` is decided by timing (CUDA: raydist.kernels.choice), each shape's decision is
recorded too, `record_choice({"kind", "shape", "kernel", "triton_ms", "torch_ms", "source"})`: what was
picked, the two times, and "measured" / "cache" / why it was not measured; `kernel_choices()` lists them
(a run's summary.json carries its Trainer's as `kernels_measured`). This module holds only the counters
and records (no torch, no config), so the model, the kernels and the metrics can all import it.
"""

from __future__ import annotations

_CALLS: dict[str, int] = {}
_CHOICES: dict[str, dict] = {}  # shape key -> the latest decision at that shape


def count_call(path: str) -> None:
    """Count one call of `path` (e.g. 'attention.triton', 'matmul.torch_fallback')."""
    _CALLS[path] = _CALLS.get(path, 0) + 1


def kernel_calls(reset: bool = False) -> dict[str, int]:
    """{path: calls} since the last reset (a copy)."""
    out = dict(_CALLS)
    if reset:
        _CALLS.clear()
    return out


def kernels_ran(since: dict[str, int] | None = None) -> dict[str, dict[str, int]]:
    """{module type: {path: calls}} of the calls made after the snapshot `since` (a `kernel_calls()` copy;
    None: all calls), e.g. {"attention": {"triton": 40}, "matmul": {"triton": 200, "torch_fallback": 8}}."""
    since = since or {}
    out: dict[str, dict[str, int]] = {}
    for path, calls in sorted(kernel_calls().items()):
        ran = calls - since.get(path, 0)
        if ran > 0:
            module, _, kernel = path.partition(".")
            out.setdefault(module, {})[kernel] = ran
    return out


def record_choice(record: dict) -> None:
    """Record `auto`'s decision at one shape (record["shape"]); a later decision at the shape replaces it."""
    _CHOICES[record["shape"]] = dict(record)


def kernel_choices(reset: bool = False) -> list[dict]:
    """The recorded decisions, in the order their shapes were first recorded (copies)."""
    out = [dict(r) for r in _CHOICES.values()]
    if reset:
        _CHOICES.clear()
    return out
