"""Makes this interpreter, and every Python process it starts, behave as if Ray were not installed, as on
the GPU machines: `import ray` (or any `ray.*`) raises ModuleNotFoundError, and each attempt is appended to
the file named by $RAYDIST_RAY_IMPORT_LOG (one line: the module, the importing file:line, the pid), so that
a caller can tell "nothing tried" from "something tried and fell back".

Used by putting this folder first on PYTHONPATH (benchmarks/gpu_suite.py does for its pytest run; Python
imports `sitecustomize` at start-up). Another sitecustomize further down the path still runs after this one.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))


class _NoRay(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "ray" and not name.startswith("ray."):
            return None
        log = os.environ.get("RAYDIST_RAY_IMPORT_LOG")
        if log:
            frames = [f for f in traceback.extract_stack()[:-1]
                      if "importlib" not in f.filename and not f.filename.startswith("<frozen")]
            where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
            with open(log, "a") as f:
                f.write(f"{name} from {where} (pid {os.getpid()})\n")
        raise ModuleNotFoundError(f"No module named {name!r} (blocked: the GPU machines have no Ray)", name=name)


sys.meta_path.insert(0, _NoRay())


def _chain() -> None:
    """Run the sitecustomize this one shadows, if any."""
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_chain()
