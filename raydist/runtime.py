"""Process-group plumbing shared by Ray workers, tests and benchmarks.

Under Ray Train the process group already exists when the worker function starts. Everywhere else
(`torch.multiprocessing` tests and benchmarks) `spawn()` starts `world_size` processes on this machine,
initialises gloo (or NCCL with one GPU per process) and returns each rank's result.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import time
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(local_rank: int = 0, use_gpu: bool | None = None) -> torch.device:
    if use_gpu is None:
        use_gpu = torch.cuda.is_available()
    if use_gpu:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _child(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results, timeout_s: float,
           threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        # Plain pickle, not the queue's tensor-sharing pickler: shared-memory handles would die with
        # this process before the parent reads them.
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args: Any, timeout_s: float = 300.0, threads: int = 1) -> list[Any]:
    """Run `fn(*args)` on `world_size` fresh processes with a process group; return results by rank.

    `fn` must be importable (a module-level function). A failure on any rank raises with its traceback.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, results, timeout_s, threads),
                         daemon=False) for r in range(world_size)]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    errors = []
    deadline = time.monotonic() + timeout_s + 30
    while len(outputs) < world_size and not errors:
        try:
            rank, ok, value = results.get(timeout=0.5)
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs]
            if dead:
                errors.append("; ".join(f"rank {r} exited with status {code} without a result" for r, code in dead))
            elif time.monotonic() > deadline:
                errors.append(f"no result from {world_size - len(outputs)} rank(s) within {timeout_s + 30:.0f}s (hang?)")
            continue
        if ok:
            outputs[rank] = pickle.loads(value)  # from our own child process
        else:
            errors.append(f"rank {rank} failed:\n{value}")
    if errors:
        for p in procs:
            if p.is_alive():
                p.kill()
    for p in procs:
        p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [outputs[r] for r in range(world_size)]
