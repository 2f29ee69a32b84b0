"""Process-group plumbing shared by Ray workers, tests and benchmarks.

Under Ray Train the process group already exists when the worker function starts. Everywhere else
(`torch.multiprocessing` tests and benchmarks) `spawn()` starts `world_size` processes on this machine,
initialises a process group and returns each rank's result. Which devices, explicitly:

- `device="cpu"` (spawn's default): gloo, every rank on the CPU;
- `device="cuda"`: NCCL, rank r on cuda:r (one GPU per rank; fewer GPUs than ranks is an error);
- `device="auto"`: cuda when this machine has at least `world_size` GPUs, else cpu.

Never gloo with CUDA tensors, never several ranks on one GPU. `pick_device()` in a rank then answers from
the process group it runs under. The equivalence harness (raydist.testing) asks for `harness_device()`:
$RAYDIST_TEST_DEVICE (auto, cpu or cuda; default auto).

Groups have one of two purposes, and the backend follows from the purpose and the device:

    DEVICE  tensors on the training device: the default group and every DeviceMesh group (NCCL on CUDA,
            gloo on CPU). NCCL rejects CPU tensors, so nothing created on the host may go here.
    HOST    CPU bookkeeping (agreeing on a committed step, object collectives, the checkpoint writer's
            barriers): always gloo, whatever the device.

`raydist.strict.purposes.new_group(ranks, HOST | DEVICE, device_type)` is how raydist makes groups;
`purpose_of(group)` answers for any group (DeviceMesh's and the default group are DEVICE). Every group gets
the run's collective timeout: explicitly there, and for the groups DeviceMesh creates itself through
`set_default_timeout` here.
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

from raydist import strict

def set_default_timeout(timeout_s: float) -> None:
    """The timeout of groups created without one from now on in this process. DeviceMesh creates its
    per-dimension and flattened groups through `new_group` without a timeout, which torch then takes from
    these module defaults (30 min for gloo, 10 min for NCCL): a hung peer would block pipeline receives and
    FSDP collectives for that long instead of `elastic.collective_timeout_s`."""
    from torch.distributed import distributed_c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout


_ALLOCATOR_TUNED = False


def keep_large_host_allocations_unpooled(threshold: int = 4 << 20) -> bool:
    """Every host allocation of `threshold` bytes or more becomes a mapping of its own, returned to the OS
    when freed (glibc `mallopt(M_MMAP_THRESHOLD)`; a no-op elsewhere, or where $MALLOC_MMAP_THRESHOLD_ says).

    By default glibc raises its mmap threshold to the size of each mapping freed (up to 32 MiB), so the next
    allocations of that size come from the heap, whose memory stays resident while anything above it lives.
    FSDP's gathered parameters are exactly that pattern: freed after each block, their 4-32 MiB successors
    land on the heap, and a rank's resident set grew by the block's weights at every block of a forward
    (+64 MiB per 2048-wide block; benchmarks/build_memory.py). Returns whether the setting was applied."""
    global _ALLOCATOR_TUNED
    if _ALLOCATOR_TUNED or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return _ALLOCATOR_TUNED
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        _ALLOCATOR_TUNED = bool(libc.mallopt(-3, threshold))  # M_MMAP_THRESHOLD; fixing it ends the rising
    except (OSError, AttributeError):  # not glibc (macOS, musl): their allocators behave differently
        pass
    return _ALLOCATOR_TUNED


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DEVICES = ("cpu", "cuda", "auto")
HARNESS_DEVICE_ENV = "RAYDIST_TEST_DEVICE"


def harness_device(world_size: int, device: str | None = None) -> str:
    """'cuda' (NCCL, rank r on cuda:r) or 'cpu' (gloo) for `world_size` local ranks.

    device: 'cpu', 'cuda' or 'auto' (cuda when this machine has >= world_size GPUs, else cpu); None reads
    $RAYDIST_TEST_DEVICE (default auto). Asks torch how many GPUs there are; creates no CUDA context."""
    choice = (device or os.environ.get(HARNESS_DEVICE_ENV, "") or "auto").strip().lower()
    if choice not in DEVICES:
        raise ValueError(f"device {choice!r} (or ${HARNESS_DEVICE_ENV}) is not one of {', '.join(DEVICES)}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "cuda" and gpus < world_size:
        raise ValueError(f"device 'cuda' needs one GPU per rank: {world_size} ranks but {gpus} GPU(s) visible; "
                         "use device 'auto' or 'cpu' (gloo on CPU), or fewer ranks")
    if choice == "auto":
        return "cuda" if gpus >= world_size else "cpu"
    return choice


def pick_device(local_rank: int | None = None, use_gpu: bool | None = None) -> torch.device:
    """This rank's device: cuda:local_rank when the process group's backend is NCCL, else the CPU (gloo is
    never paired with CUDA tensors). `use_gpu` overrides; local_rank defaults to $LOCAL_RANK."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_gpu is None:
        use_gpu = dist.is_initialized() and "nccl" in str(dist.get_backend())
    if use_gpu:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def bind_device(device: torch.device) -> bool:
    """Eager NCCL initialisation for a default process group created without `device_id` (Ray Train's
    TorchConfig calls `init_process_group(backend, init_method, rank, world_size, timeout)`): what
    `init_process_group(device_id=device)` does after creating the group (torch/distributed/
    distributed_c10d.py, `_new_process_group_helper`): bind the group to this rank's GPU and connect its
    NCCL communicator now, collectively, instead of at the first collective. Later `new_group` calls
    (the mesh's dp/tp/pp/cp groups) then split that communicator (ncclCommSplit) instead of bootstrapping
    each one through the store. Every rank of the default group must call it, before any `new_group`.
    Returns whether it bound (not for a CPU device, no group, a group already bound, or a backend that
    cannot split, e.g. gloo). Under the strict-collectives mode a CPU device binds the strict world group
    (raydist.strict.bind), so CPU runs obey the rule that comes with binding."""
    if device.type == "cpu" and strict.enabled() and dist.is_initialized():
        return strict.bind()  # the strict mode's stand-in: from now on groups are splits (raydist.strict)
    if device.type != "cuda" or not dist.is_initialized():
        return False
    group = dist.distributed_c10d._get_default_group()
    if getattr(group, "bound_device_id", None) is not None:
        return False
    backend = group._get_backend(device)
    if not getattr(backend, "supports_splitting", False):
        return False
    group.bound_device_id = device
    backend.eager_connect_single_device(device)
    return True


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. To CUDA through pinned (page-locked) memory with a non-blocking copy, so
    the copy is a DMA that overlaps the host's work instead of a staged synchronous one (the caching host
    allocator keeps the pinned block until the copy has finished); elsewhere a plain `.to(device)`, which
    on the CPU returns the tensor itself."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


# Imported once by the fork server that starts spawn()'s ranks, not by every rank: a rank is a fork of a
# process that has imported these and run nothing (no process group, no torch thread pool, no
# CUDA), so each call still gets fresh processes, as a spawned interpreter would start, without paying
# for the interpreter and `import torch` (~3 s of CPU) per rank. torch._dynamo too: torch imports it the
# first time a rank initialises a parameter (`nn.init.normal_`), 0.65 s of CPU alone and 1.1 s of a
# 4-rank, 3-step layout's 6.2 s on 2 cores (measured side by side). It imports Triton, whose settings
# (triton.knobs) read the environment when used; raydist's kernels are not preloaded: `triton.jit` picks
# the interpreter when a kernel is defined, after the rank has taken the caller's TRITON_INTERPRET. pandas:
# pyarrow's `to_numpy` imports it the first time a rank reads a shard (raydist.data.stream), 0.27 s of CPU.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "pandas", "raydist.training.trainer", "raydist.testing")


def start_method_context():
    """The multiprocessing context `spawn` starts ranks with: a fork server preloading `PRELOAD`."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts (once per parent process)
    return ctx


class _CallerStdio:
    """The caller's stdout and stderr as they are when a rank starts (pytest may have redirected them since
    the fork server started): pickled as descriptors the fork server hands to the rank."""

    def __init__(self, out=None, err=None):
        self.out, self.err = out, err

    def __reduce__(self):
        from multiprocessing import reduction

        return _CallerStdio, (reduction.DupFd(1), reduction.DupFd(2))  # only while a Process starts

    def adopt(self) -> None:
        for fd, dup in ((1, self.out), (2, self.err)):
            got = dup.detach()
            os.dup2(got, fd)
            os.close(got)


def _reread_import_time_settings() -> None:
    """Settings a preloaded module read from the fork server's environment when it was imported, read again
    from the caller's: fsspec's FSSPEC_<PROTOCOL>_<KEY> defaults and config directory (e.g. an S3 endpoint a
    test sets just before it spawns)."""
    from fsspec import config

    config.conf.clear()
    config.conf_dir = os.environ.get("FSSPEC_CONFIG_DIR", os.path.join(os.path.expanduser("~"), ".config/fsspec"))
    config.set_conf_files(config.conf_dir, config.conf)
    config.set_conf_env(config.conf)


def _adopt_caller(env: dict[str, str], stdio: _CallerStdio) -> None:
    """In a fork of the fork server: the caller's environment and standard streams at the time of the call,
    as a spawned process would inherit them (the fork server's are those of its own start)."""
    stdio.adopt()
    os.environ.clear()
    os.environ.update(env)
    _reread_import_time_settings()
    torch.seed()  # a fresh interpreter's random default seed, not the fork server's (shared by every fork)


def caller_process(ctx, target: Callable, *args: Any):
    """A process of `ctx` (`start_method_context()`) that runs `target(*args)` as `spawn`'s ranks start: a
    fork of the fork server (torch and the Trainer imported once, not by each process) with the caller's
    environment and standard streams of now; without spawn's process group (for processes that build their
    own, as torchft's replicas do)."""
    return ctx.Process(target=_as_caller, args=(dict(os.environ), _CallerStdio(), target, *args))


def _as_caller(env: dict[str, str], stdio: _CallerStdio, target: Callable, *args: Any) -> None:
    _adopt_caller(env, stdio)
    target(*args)


def _child(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results, timeout_s: float,
           threads: int, device: str, env: dict[str, str], stdio: _CallerStdio, bound: bool) -> None:
    _adopt_caller(env, stdio)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        # Every rank is a client of the caller's store (see spawn), as MASTER_ADDR/MASTER_PORT name it.
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        if device == "cuda":  # NCCL, one GPU per rank, initialised eagerly on it
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size, timeout=timeout,
                                    device_id=torch.device("cuda", rank) if bound else None)
        else:  # gloo, or gloo under NCCL's rules (raydist.strict)
            backend = strict.install() if strict.enabled() else "gloo"
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
            if strict.enabled() and bound:
                strict.bind()  # as the cuda branch's device_id binds the NCCL world group
        # Plain pickle, not the queue's tensor-sharing pickler: shared-memory handles would die with
        # this process before the parent reads them.
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


FAILURE_GRACE_S = 5.0  # how long spawn waits for the other ranks' errors after the first
# What a rank raises when a peer it waits for fails or leaves first: listed after the error that caused it.
_CONSEQUENCES = ("left the world", "Connection closed by peer", "Connection reset by peer")


def _consequence(traceback_text: str) -> bool:
    return any(text in traceback_text for text in _CONSEQUENCES)


def spawn(fn: Callable, world_size: int, *args: Any, timeout_s: float = 300.0, threads: int = 1,
          device: str = "cpu", bound: bool = True) -> list[Any]:
    """Run `fn(*args)` on `world_size` fresh processes with a process group; return results by rank.
    The processes are forks of a fork server (`start_method_context`) and run with this process's
    environment.

    `fn` must be importable (a module-level function). A failure on any rank raises with its traceback.
    device: 'cpu' (gloo), 'cuda' (NCCL, rank r on cuda:r) or 'auto' (see `harness_device`).
    bound: the world group is bound to the rank's device from the start (cuda: `device_id`; the strict mode:
    `raydist.strict.bind`), so every later group is a split of it; False leaves it unbound, as Ray Train
    creates it (`bind_device` binds it later).
    """
    device = harness_device(world_size, device)
    ctx = start_method_context()
    results = ctx.Queue()
    # The group's TCP store is served from here, on a port the kernel picks and this process keeps: a port
    # found free and bound later by rank 0 can be taken in between (another test's store, a Ray worker's),
    # which failed a clean-clone CI run with EADDRINUSE.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    port = store.port
    env = dict(os.environ)
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, results, timeout_s, threads, device,
                                              env, _CallerStdio(), bound), daemon=False) for r in range(world_size)]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    failed: dict[int, str] = {}  # rank -> its traceback
    problems: list[str] = []  # a rank that exited without a result, or none came in time
    deadline, failed_at = time.monotonic() + timeout_s + 30, 0.0

    def take(rank: int, ok: bool, value) -> None:
        nonlocal failed_at
        if ok:
            outputs[rank] = pickle.loads(value)  # from our own child process
            return
        if not failed:
            failed_at = time.monotonic()
        failed[rank] = value

    while len(outputs) + len(failed) < world_size and not problems:
        try:
            take(*results.get(timeout=0.5))
            continue
        except queue.Empty:
            pass
        pending = [r for r in range(world_size) if r not in outputs and r not in failed]
        dead = [(r, procs[r].exitcode) for r in pending if procs[r].exitcode not in (None, 0)]
        if dead:
            problems.append("; ".join(f"rank {r} exited with status {code} without a result" for r, code in dead))
        elif time.monotonic() > deadline:
            problems.append(f"no result from {len(pending)} rank(s) within {timeout_s + 30:.0f}s (hang?)")
        elif failed and (time.monotonic() > failed_at + FAILURE_GRACE_S
                         or all(procs[r].exitcode is not None for r in pending)):
            break  # the other ranks' errors were waited for a while: the first to arrive is often a consequence
    while failed or problems:  # what arrived meanwhile
        try:
            take(*results.get_nowait())
        except queue.Empty:
            break
    causes = [r for r in sorted(failed) if not _consequence(failed[r])]
    errors = ([f"rank {r} failed:\n{failed[r]}" for r in causes] + problems
              + [f"rank {r} failed:\n{failed[r]}" for r in sorted(failed) if r not in causes])
    if errors:
        for p in procs:
            if p.is_alive():
                p.kill()
    for p in procs:
        p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [outputs[r] for r in range(world_size)]
