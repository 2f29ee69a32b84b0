"""Where the Triton kernels can run, decided lazily: nothing here imports Triton or touches a device at import.

Triton compiles for CUDA; on a CPU machine its interpreter (`TRITON_INTERPRET=1`) runs the same kernels
through numpy, slowly, which is how the CPU tests check them. Triton 3.x reads `TRITON_INTERPRET` when a
`@triton.jit` function is *created*, so the kernel modules (`triton_attention.py`, `triton_matmul.py`) are
loaded on first use, once per mode (`load_kernel_module`), never when `raydist.kernels` is imported: the
variable's value at the time of a kernel call decides, whenever `raydist` was imported.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

from raydist.errors import ConfigError
# which kernel ran: counts per path (raydist.metrics.kernels, importable by the model without this package)
from raydist.metrics.kernels import count_call, kernel_calls  # noqa: F401

_TRUE = ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=1)
def triton_import_error() -> str | None:
    """None when `import triton` works, else the reason (the platform has no wheel, or it is broken)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising something else
        return f"{type(exc).__name__}: {exc}"
    return None


def interpreter_requested() -> bool:
    """True when TRITON_INTERPRET asks for the CPU interpreter, read by Triton's own knob where Triton is
    installed (the knob re-reads the variable on every access)."""
    if triton_import_error() is None:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def triton_unusable_reason(device: torch.device | str) -> str | None:
    """None when Triton kernels can run on `device` now, else a one-line reason with the fix."""
    device = torch.device(device)
    reason = triton_import_error()
    if reason is not None:
        return f"triton is not importable ({reason}); install triton or pick the torch kernels"
    if device.type == "cuda":
        return None
    if interpreter_requested():
        return interpreter_error()
    return (f"Triton kernels need a CUDA device, got {device.type!r}; set TRITON_INTERPRET=1 to run them "
            "on CPU through Triton's (slow) interpreter, or pick the torch kernels")


@functools.lru_cache(maxsize=1)
def interpreter_error() -> str | None:
    """None when Triton's CPU interpreter runs raydist's kernels here, else why not, with the fix. Probed
    once per process with a tiny kernel (kernels/interpreter_probe.py); call it with TRITON_INTERPRET=1."""
    import numpy as np
    import triton

    probe = load_kernel_module("interpreter_probe")
    out = torch.zeros(1, dtype=torch.int32)
    try:
        probe.count_tiles[(1,)](out, 4, BLOCK=2)
        wrong = None if int(out) == 2 else f"a loop of 2 tiles counted {int(out)}"
    except Exception as exc:  # the interpreter's own failure, whatever its type
        wrong = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if wrong is None:
        return None
    return (f"Triton {triton.__version__}'s CPU interpreter cannot run the kernels with numpy {np.__version__} "
            f"({wrong}); Triton 3.9 runs them, and so does Triton 3.6 with numpy < 2.4. Upgrade triton (or "
            "pin numpy<2.4 for the interpreter), or pick the torch kernels")


def require_triton(device: torch.device | str, what: str) -> None:
    """ConfigError naming the setting `what` (e.g. 'kernels.attention=triton') when Triton cannot run."""
    reason = triton_unusable_reason(device)
    if reason is not None:
        raise ConfigError(f"{what}: {reason}")


_KERNEL_MODULES: dict[tuple[str, bool], ModuleType] = {}


def load_kernel_module(name: str) -> ModuleType:
    """raydist/kernels/<name>.py (which defines @triton.jit functions), built for the current mode.

    Triton fixes interpreted-or-compiled when a @triton.jit function is created, so the module's source is
    executed once per mode under its own name (`raydist.kernels._<name>_interpreted` / `_compiled`): the
    value of TRITON_INTERPRET at each call picks the build, and a process may use both (tests do: CUDA
    tests compiled, interpreter tests on CPU tensors).
    """
    interpret = interpreter_requested()
    module = _KERNEL_MODULES.get((name, interpret))
    if module is not None:
        return module
    path = Path(__file__).with_name(f"{name}.py")
    module_name = f"raydist.kernels._{name}_{'interpreted' if interpret else 'compiled'}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # Triton resolves a kernel's globals through its module
    spec.loader.exec_module(module)
    if module.INTERPRETED != interpret:  # the knob and our reading of the variable disagree
        raise RuntimeError(f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} read as {interpret} here "
                           f"but Triton built {name} with interpret={module.INTERPRETED}; use 0 or 1")
    _KERNEL_MODULES[(name, interpret)] = module
    return module


def check_tensor_device(tensor: torch.Tensor, name: str) -> None:
    """A kernel input must be on CUDA, or on CPU under the interpreter: otherwise a clear error."""
    if tensor.device.type == "cuda":
        return
    if tensor.device.type == "cpu" and interpreter_requested():
        return
    raise ValueError(f"{name} is on {tensor.device}, but the Triton kernels run on CUDA tensors (or on CPU "
                     "with TRITON_INTERPRET=1); move it to CUDA or use raydist.kernels.reference")


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype active for `device_type`, or None: custom kernels are not cast by autocast itself."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None

