"""Python stacks of live processes for hang diagnosis (raydist.elastic.hang): py-spy where it can attach, else
the process's own `sys._current_frames`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import traceback

PY_SPY_TIMEOUT_S = 20.0



def py_spy() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.path.exists(here) else shutil.which("py-spy")


def py_spy_dump(pid: int, nonblocking: bool = False, timeout_s: float = PY_SPY_TIMEOUT_S) -> tuple[bool, str]:
    """(ok, text): `py-spy dump --pid PID` (with --nonblocking, the process is read without pausing it)."""
    exe = py_spy()
    if exe is None:
        return False, "py-spy is not installed (pip install py-spy)"
    cmd = [exe, "dump", "--pid", str(pid)] + (["--nonblocking"] if nonblocking else [])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"py-spy dump --pid {pid} did not finish within {timeout_s:.0f}s"
    except OSError as exc:
        return False, f"py-spy could not run: {exc}"
    if proc.returncode != 0:
        return False, (proc.stderr or proc.stdout).strip()[-2000:]
    return True, proc.stdout


def python_stacks() -> str:
    """Every thread's Python stack of this process (no py-spy, no ptrace)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f'Thread {ident} "{names.get(ident, "?")}"\n' + "".join(traceback.format_stack(frame)))
    return "\n".join(out)


def own_stack() -> str:
    ok, text = py_spy_dump(os.getpid())
    if ok:
        return "# py-spy dump\n" + text
    return f"# py-spy could not attach ({text.splitlines()[-1] if text else '?'}); Python's own frames\n" + python_stacks()
