"""Ray Train workers under the strict mode: each worker registers the strict backend before Ray Train
creates its process group with it.

`strict_torch_config(config)` returns a copy of a TorchConfig (Ray's, its torchft variant or raydist's
replica-group one) whose backend runs `install_in_worker` on every worker of the group it starts, then Ray
Train's own setup with `backend="raydist_strict"` (`init_process_group` finds the registered backend by name).
Ray is imported by the caller (raydist.driver.launcher), never here at import time.
"""

from __future__ import annotations

import copy
import os

from raydist import strict


def install_in_worker() -> None:
    os.environ[strict.ENV] = "1"  # the worker's group_backend and spawns see the mode even where no env reached
    strict.install()


def strict_torch_config(config):
    """`config` (a TorchConfig) with the strict backend; its backend class installs the mode on the workers."""
    base_backend = config.backend_cls

    class StrictBackend(base_backend):
        def on_start(self, worker_group, backend_config):
            worker_group.execute(install_in_worker)
            return super().on_start(worker_group, backend_config)

    strict_class = type(f"Strict{type(config).__name__}", (type(config),),
                        {"backend_cls": property(lambda self: StrictBackend)})
    out = copy.copy(config)
    out.__class__ = strict_class
    out.backend = strict.BACKEND
    return out
