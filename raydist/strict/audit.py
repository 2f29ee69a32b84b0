"""A CPU-run check that every collective would be legal on a CUDA run with NCCL.

On CUDA, DEVICE groups (the default group, every DeviceMesh group) are NCCL, which rejects CPU tensors;
HOST groups are gloo (raydist.strict.purposes). On a CPU machine every group is gloo and every tensor is on the
CPU, so a CPU tensor sent through a DEVICE group goes unnoticed until the first GPU run (the first logged
step all-reduced a CPU int64 tensor on an NCCL group). `CollectiveAudit` makes that visible without a GPU:

- tensors created without a `device=` argument (`torch.tensor(...)`, `torch.zeros(...)`, ...,
  `torch.from_numpy`) are host tensors on any machine, whereas training tensors come from the model, the
  data moved `.to(device)`, or factories given the training device; the audit marks the former (a
  TorchFunctionMode), and what is computed from host tensors only (`torch.tensor([n]).long()`,
  `torch.stack` of host tensors, `.cpu()` of anything) is marked too; a move to an explicit device
  (`.to(device)`, `.cuda()`) makes a training tensor. (On the CPU `.to(device)` returns the tensor itself,
  so its mark goes; `.cpu()` of a training tensor is the tensor itself there and stays unmarked.)
- every tensor collective (all_reduce, broadcast, all_gather, reduce_scatter, all_to_all, send/recv,
  isend/irecv, and batch_isend_irecv through `P2POp`) is checked: a host tensor on a DEVICE group, or a
  training tensor on a HOST group, is a violation naming the collective and the group. Object collectives
  (`all_gather_object`, ...) choose their own device and are not checked; DTensor/FSDP collectives only
  ever see parameters and activations.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from raydist.strict.purposes import HOST, purpose_of

FACTORIES = {torch.tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.rand,
             torch.randn, torch.randint, torch.as_tensor, torch.scalar_tensor}
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "reduce_scatter", "all_to_all_single", "all_to_all", "reduce", "send", "recv", "isend", "irecv")
MOVES = {torch.Tensor.to, torch.Tensor.cuda}  # to an explicit device: a training tensor


def _is_host(tensor: torch.Tensor) -> bool:
    return getattr(tensor, "_raydist_host", False)


def _mark(value: Any, host: bool) -> None:
    for tensor in _tensors(value):
        tensor._raydist_host = host


def _names_device(func, args: tuple, kwargs: dict) -> bool:
    """`.cuda(...)`, or a `.to(...)` that names its target device (not only a dtype)."""
    if func is torch.Tensor.cuda or kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args[1:])


class _MarkHostTensors(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in FACTORIES:
            if kwargs.get("device") is None:
                _mark(out, True)
        elif func in MOVES and _names_device(func, args, kwargs):
            _mark(out, False)
        elif func is torch.Tensor.cpu:
            if out is not args[0]:  # on the CPU .cpu() is the tensor itself: a training tensor stays one
                _mark(out, True)
        else:
            inputs = list(_tensors(list(args) + list(kwargs.values())))
            if inputs and all(_is_host(t) for t in inputs):
                _mark(out, True)
        return out


def marking_host_tensors() -> TorchFunctionMode:
    """The marking alone, as a context manager: under the strict-collectives mode (raydist.strict) a marked
    tensor on a device group fails the collective, as NCCL would refuse it."""
    return _MarkHostTensors()


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


class CollectiveAudit:
    """Context manager: records violations in `self.violations` (strings) while active."""

    def __init__(self):
        self.violations: list[str] = []
        self.checked = 0
        self._saved: dict[str, Any] = {}
        self._mode = _MarkHostTensors()

    def _check(self, name: str, args: tuple, kwargs: dict) -> None:
        group = kwargs.get("group")
        if group is None:
            group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        host_group = purpose_of(group) == HOST
        for tensor in _tensors(list(args) + [v for k, v in kwargs.items() if k != "group"]):
            self.checked += 1
            host_tensor = _is_host(tensor)
            if host_tensor and not host_group:
                self.violations.append(f"{name} of a host tensor {tuple(tensor.shape)} {tensor.dtype} on a device "
                                       f"group ({_describe(group)}): NCCL on CUDA, which rejects CPU tensors")
            elif not host_tensor and host_group:
                self.violations.append(f"{name} of a training-device tensor {tuple(tensor.shape)} on a host "
                                       f"group ({_describe(group)}): gloo")

    def _wrap(self, name: str, original):
        @functools.wraps(original)
        def audited(*args, **kwargs):
            self._check(name, args, kwargs)
            return original(*args, **kwargs)

        return audited

    def __enter__(self) -> "CollectiveAudit":
        for name in COLLECTIVES:
            if hasattr(dist, name):
                self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self._saved[name]))
        self._saved["P2POp"] = dist.P2POp
        audit = self
        # P2POp accepts only torch's own isend/irecv: callers that pass `dist.isend` now hold the wrapper
        originals = {id(getattr(dist, name)): self._saved[name] for name in ("isend", "irecv") if name in self._saved}

        class AuditedP2POp(dist.P2POp):  # batch_isend_irecv takes its tensors through P2POp
            def __new__(cls, op, tensor, *args, **kwargs):
                op = originals.get(id(op), op)
                audit._check(f"batch_isend_irecv({getattr(op, '__name__', op)})", (tensor, *args), kwargs)
                return audit._saved["P2POp"].__new__(cls, op, tensor, *args, **kwargs)

            def __init__(self, op, tensor, *args, **kwargs):
                super().__init__(originals.get(id(op), op), tensor, *args, **kwargs)

        dist.P2POp = AuditedP2POp
        self._saved["from_numpy"] = torch.from_numpy  # invisible to torch function modes

        def from_numpy(array):
            out = audit._saved["from_numpy"](array)
            _mark(out, True)
            return out

        torch.from_numpy = from_numpy
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for name, original in self._saved.items():
            setattr(torch if name == "from_numpy" else dist, name, original)


def _describe(group) -> str:
    group = group if group is not None else dist.group.WORLD
    return f"{group.group_name}, {dist.get_world_size(group)} ranks"
