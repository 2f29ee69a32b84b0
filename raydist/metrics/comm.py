"""Bytes a rank sends, counted at the collectives, with the ring algorithms' per-rank figures.

For a payload of n bytes in a group of p ranks, each rank sends (seed 003, ring algorithms):
    all-reduce        2 (p - 1) / p * n      (reduce-scatter then all-gather)
    all-gather        (p - 1) / p * n        (n = the gathered output)
    reduce-scatter    (p - 1) / p * n        (n = the full input)
    all-to-all        (p - 1) / p * n
    broadcast         (p - 1) / p * n        (pipelined ring; the root sends more in a naive tree)
    send              n

`CommCounter` wraps the `torch.distributed` functions that FSDP2, DTensor-free code and our own
collectives call through the module (`dist.all_reduce`, `dist.all_gather_single`, ...); DDP's reducer
calls the process group from C++, so DDP is counted by registering `ddp_hook()`, which all-reduces each
bucket through `dist.all_reduce`.
"""

from __future__ import annotations

import collections
import contextlib

import torch
import torch.distributed as dist

_FACTORS = {
    "all_reduce": lambda p: 2 * (p - 1) / p,
    "all_gather": lambda p: (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "all_to_all": lambda p: (p - 1) / p,
    "broadcast": lambda p: (p - 1) / p,
    "send": lambda p: 1.0,
}

# (function name in torch.distributed, kind, the parameter that holds the full payload)
_WRAPPED = [
    ("all_reduce", "all_reduce", "tensor"),
    ("all_gather_into_tensor", "all_gather", "output_tensor"),
    ("all_gather_single", "all_gather", "output_tensor"),
    ("reduce_scatter_tensor", "reduce_scatter", "input"),
    ("reduce_scatter_single", "reduce_scatter", "input"),
    ("all_to_all_single", "all_to_all", "input"),
    ("broadcast", "broadcast", "tensor"),
    ("send", "send", "tensor"),
    ("isend", "send", "tensor"),
]


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class CommCounter:
    def __init__(self):
        self.bytes: collections.Counter = collections.Counter()  # kind -> bytes sent by this rank
        self.calls: collections.Counter = collections.Counter()

    def record(self, kind: str, payload_bytes: int, group_size: int) -> None:
        if group_size <= 1:
            return
        self.bytes[kind] += _FACTORS[kind](group_size) * payload_bytes
        self.calls[kind] += 1

    @property
    def total(self) -> float:
        return float(sum(self.bytes.values()))

    @contextlib.contextmanager
    def patch(self):
        """Count every wrapped torch.distributed call made inside the block."""
        import inspect

        originals = {}
        for name, kind, arg in _WRAPPED:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            originals[name] = fn

            def wrapper(*args, __fn=fn, __kind=kind, __arg=arg, __sig=inspect.signature(fn), **kwargs):
                bound = __sig.bind(*args, **kwargs).arguments
                size = 2 if __kind == "send" else dist.get_world_size(bound.get("group"))
                self.record(__kind, _nbytes(bound[__arg]), size)
                return __fn(*args, **kwargs)

            setattr(dist, name, wrapper)
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)

    @staticmethod
    def ddp_hook():
        """A DDP comm hook that all-reduces each bucket through `dist.all_reduce` (so `patch` counts it);
        DDP's built-in path calls the process group from C++, out of sight."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook
