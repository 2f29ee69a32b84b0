"""Bytes a rank sends, counted at the collectives, with the ring algorithms' per-rank figures.

For a payload of n bytes in a group of p ranks, each rank sends (the bandwidth-optimal ring
algorithms: Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009 for all-reduce):
    all-reduce        2 (p - 1) / p * n      (reduce-scatter then all-gather)
    all-gather        (p - 1) / p * n        (n = the gathered output)
    reduce-scatter    (p - 1) / p * n        (n = the full input)
    all-to-all        (p - 1) / p * n
    broadcast         (p - 1) / p * n        (pipelined ring; the root sends more in a naive tree)
    send              n

`CommCounter` wraps the `torch.distributed` functions that FSDP2, DTensor-free code and our own
collectives call through the module (`dist.all_reduce`, `dist.all_gather_single`, ...); DDP's reducer
calls the process group from C++, so DDP is counted by registering `ddp_hook()`, which all-reduces each
bucket through `dist.all_reduce`. Point-to-point batches (`dist.batch_isend_irecv`, as ring attention
sends K/V) count each P2POp that sends, as a `send`.

Context parallelism per attention layer and rank (`ring_attention_bytes`, `ulysses_attention_bytes`) gives
the figures the counted bytes are compared with in benchmarks/comm_volume.py.

bucket through `dist.all_reduce`. DTensor (tensor parallelism) communicates through the functional
collectives (`torch.ops._c10d_functional.*`), which never pass through those Python functions; `patch()`
also counts them with a TorchDispatchMode (`FunctionalCollectives`) that sees each op and its payload.

`sizes` keeps a count per (kind, payload bytes), so a benchmark can tell the activation collectives of a
transformer block (payload B x T x D x dtype bytes) from small ones (norm gradients, loss statistics).
"""

from __future__ import annotations

import collections
import contextlib
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

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
        self.sizes: collections.Counter = collections.Counter()  # (kind, payload bytes) -> calls

    def record(self, kind: str, payload_bytes: int, group_size: int) -> None:
        if group_size <= 1:
            return
        self.bytes[kind] += _FACTORS[kind](group_size) * payload_bytes
        self.calls[kind] += 1
        self.sizes[(kind, payload_bytes)] += 1

    @property
    def total(self) -> float:
        return float(sum(self.bytes.values()))

    @contextlib.contextmanager
    def patch(self, functional: bool = True):
        """Count every wrapped torch.distributed call made inside the block, and (`functional`) every
        functional collective (DTensor's)."""
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
        originals["batch_isend_irecv"] = batch = dist.batch_isend_irecv

        def batch_wrapper(p2p_op_list, __fn=batch):
            self.record_p2p(p2p_op_list)
            return __fn(p2p_op_list)

        dist.batch_isend_irecv = batch_wrapper
        try:
            with FunctionalCollectives(self) if functional else contextlib.nullcontext():
                yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)

    def record_p2p(self, p2p_ops) -> None:
        """Count the sends of a `batch_isend_irecv` batch (P2POp.op is c10d's isend or irecv)."""
        for op in p2p_ops:
            if getattr(op.op, "__name__", "") == "isend":
                self.record("send", _nbytes(op.tensor), 2)

    @staticmethod
    def ddp_hook():
        """A DDP comm hook that all-reduces each bucket through `dist.all_reduce` (so `patch` counts it);
        DDP's built-in path calls the process group from C++, out of sight."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook


# ---- context parallelism: bytes one rank sends per attention layer (forward, backward) -----------------


def ring_attention_bytes(batch: int, kv_heads: int, local_tokens: int, head_dim: int, cp: int,
                         dtype_bytes: int, grad_bytes: int = 4) -> dict[str, float]:
    """Ring attention (parallel/ring_attention.py): the local K and V, kv = 2 B K (T/cp) E bytes, go to the
    next rank cp-1 times in forward; in backward K/V again cp-1 times and the dK/dV accumulator (in
    fp32: grad_bytes) cp times, its last hop returning it to its owner."""
    kv = 2 * batch * kv_heads * local_tokens * head_dim
    return {"forward": float((cp - 1) * kv * dtype_bytes),
            "backward": float((cp - 1) * kv * dtype_bytes + cp * kv * grad_bytes)}


def ulysses_attention_bytes(batch: int, heads: int, kv_heads: int, local_tokens: int, head_dim: int, cp: int,
                            dtype_bytes: int) -> dict[str, float]:
    """Ulysses (parallel/ulysses.py): all-to-all of q, k, v (kv heads repeated to lcm(K, cp) when cp does
    not divide K) and of the output, each sending (cp-1)/cp of the local tensor; the backward all-to-alls
    their gradients, the same bytes."""
    kv_heads = kv_heads if kv_heads % cp == 0 else math.lcm(kv_heads, cp)
    elements = batch * local_tokens * head_dim * (heads + 2 * kv_heads + heads)
    one_way = (cp - 1) / cp * elements * dtype_bytes
    return {"forward": one_way, "backward": one_way}


def count_attention_layer(attention_fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, float]:
    """Bytes this rank sends in one `attention_fn(q, k, v)` forward and in its backward (of sum(out)), as
    {"forward": ..., "backward": ...}: what the formulas above predict, measured."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    forward, backward = CommCounter(), CommCounter()
    with forward.patch():
        out = attention_fn(q, k, v)
    with backward.patch():
        out.float().sum().backward()
    return {"forward": forward.total, "backward": backward.total}

# ---- functional collectives (DTensor) ---------------------------------------------------------------

# op name in torch.ops._c10d_functional -> (kind, the argument that holds the group size or group name).
# all_gather's payload is the gathered output: the input times the group size. The autograd variants
# (`_c10d_functional_autograd`) call these ops inside, so only this namespace is counted.
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", 2), "all_reduce_": ("all_reduce", 2),
    "all_reduce_coalesced": ("all_reduce", 2), "all_reduce_coalesced_": ("all_reduce", 2),
    "all_gather_into_tensor": ("all_gather", 1), "all_gather_into_tensor_out": ("all_gather", 1),
    "all_gather_into_tensor_coalesced": ("all_gather", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 2), "reduce_scatter_tensor_out": ("reduce_scatter", 2),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 2),
    "all_to_all_single": ("all_to_all", 3),
    "broadcast": ("broadcast", 2), "broadcast_": ("broadcast", 2),
}


def _group_size(group) -> int:
    if isinstance(group, int):
        return group
    if isinstance(group, dist.ProcessGroup):
        return group.size()
    return dist.distributed_c10d._resolve_process_group(group).size()


class FunctionalCollectives(TorchDispatchMode):
    """Records each `_c10d_functional` collective into a CommCounter, with its payload and group size.

    Ops on DTensors are declined (NotImplemented) so DTensor runs first and lowers them to plain-tensor
    ops, collectives included, which come back through this mode (as torch's CommDebugMode does)."""

    def __init__(self, counter: CommCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        if getattr(func, "namespace", None) == "_c10d_functional":
            spec = _FUNCTIONAL.get(func._overloadpacket.__name__)
            if spec is not None:
                kind, group_arg = spec
                size = _group_size(args[group_arg])
                payload = _nbytes(args[0]) * (size if kind == "all_gather" else 1)
                self.counter.record(kind, payload, size)
        return func(*args, **kwargs)


# ---- tensor parallelism: Megatron's figure per transformer block ----------------------------------


def megatron_block_bytes(micro_batch: int, seq_len: int, d_model: int, tp: int, sequence_parallel: bool,
                         dtype_bytes: int = 4) -> dict[str, float]:
    """Bytes one rank sends for one transformer block's forward + backward of one micro-batch (Shoeybi et al.
    2019, Megatron-LM, for the "f"/"g" all-reduces; Korthikanti et al. 2022 for sequence parallelism), by
    collective kind. With n = B T D x dtype bytes:

    - TP: "g" all-reduces the (B, T, D) output of attention and of the MLP in forward, "f" the gradient of
      their input in backward: 4 all-reduces, 4 x 2 (p-1)/p x n;
    - TP + SP: each all-reduce becomes a reduce-scatter (to the sequence slices) and an all-gather (back
      to the whole sequence): 4 of each, the same 8 (p-1)/p x n in total.
    """
    n = micro_batch * seq_len * d_model * dtype_bytes
    if sequence_parallel:
        return {"all_gather": 4 * _FACTORS["all_gather"](tp) * n,
                "reduce_scatter": 4 * _FACTORS["reduce_scatter"](tp) * n}
    return {"all_reduce": 4 * _FACTORS["all_reduce"](tp) * n}


def sp_norm_gradient_bytes(d_model: int, tp: int, dtype_bytes: int = 4) -> float:
    """Under SP each rank's gradient of a block's two norm weights covers its tokens only: summing them
    is 2 all-reduces of D numbers per block (once per micro-batch without FSDP; FSDP2 does it per step)."""
    return 2 * _FACTORS["all_reduce"](tp) * d_model * dtype_bytes
