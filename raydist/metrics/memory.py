"""Bytes a rank actually holds: parameters, gradients and optimizer state, counted from local tensors.

Sharded parameters are DTensors; only their local shard lives on this rank (`to_local()`), so the counts below
are what FSDP/TP really save, to compare with the ZeRO paper's model (Rajbhandari et al. 2020; 16N bytes per
replica in fp32 with Adam: 4 weights + 4 gradients + 8 moments; 16N/p fully sharded over p ranks).
"""

from __future__ import annotations

from typing import Iterable

import torch


def local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """{'params', 'grads', 'optimizer', 'total'} in bytes on this rank (tied parameters counted once)."""
    params = list({id(p): p for p in model.parameters()}.values())
    out = {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params),
        "optimizer": 0,
    }
    if optimizer is not None:
        for state in optimizer.state.values():
            out["optimizer"] += sum(local_bytes(v) for v in state.values()
                                    if isinstance(v, torch.Tensor) and v.ndim > 0)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


class SavedActivations:
    """Counts the bytes autograd keeps for backward, through saved-tensor hooks.

    Every tensor saved for backward passes `pack`; its bytes count as live until autograd frees it
    (after its backward ran, or when the graph is dropped). `peak_bytes` is the largest live total:
    for a plain forward + backward that is the end of forward. Tensors are counted once per storage.

    Inside a checkpointed region (torch.utils.checkpoint, non-reentrant) the region's own hooks replace
    these, so only what the region keeps (its inputs) is seen here; selective checkpointing's cached
    matmul outputs are not saved tensors at all: `LiveActivations` counts those.
    """

    def __init__(self, exclude: "Iterable[torch.Tensor]" = ()):
        self.live = 0
        self.peak_bytes = 0
        self._storages: dict[int, tuple[int, int]] = {}  # storage -> (bytes, times saved)
        # parameters (saved by matmuls for their input gradients) are not activations
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live)

    def remove(self, nbytes: int) -> None:
        self.live -= nbytes

    def _pack(self, tensor: torch.Tensor):
        import weakref

        key = tensor.untyped_storage().data_ptr()
        holder = _Holder(tensor)
        if key in self._exclude:
            return holder
        nbytes, count = self._storages.get(key, (tensor.untyped_storage().nbytes(), 0))
        if count == 0:
            self.add(nbytes)
        self._storages[key] = (nbytes, count + 1)
        weakref.finalize(holder, self._release, key)
        return holder

    def _release(self, key: int) -> None:
        nbytes, count = self._storages[key]
        if count == 1:
            del self._storages[key]
            self.remove(nbytes)
        else:
            self._storages[key] = (nbytes, count - 1)

    @staticmethod
    def _unpack(holder: "_Holder") -> torch.Tensor:
        return holder.tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


class _Holder:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _plain_tensors(leaves):
    """The tensors that hold storage among `leaves`: a tensor subclass that wraps others (DTensor) stands for
    its inner tensors (`__tensor_flatten__`; the wrapper itself has no storage)."""
    for t in leaves:
        if not isinstance(t, torch.Tensor):
            continue
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            yield from _plain_tensors([getattr(t, name) for name in names])
        else:
            yield t


class LiveActivations(torch.utils._python_dispatch.TorchDispatchMode):
    """Tracks every tensor produced by an op inside the block; `live_bytes()` is the bytes of those still
    referenced (by autograd's saved tensors, checkpoint inputs, selective checkpointing's cache, or the
    caller). At the end of forward, minus the output, that is the activation memory held for backward,
    whatever mechanism holds it. Counted once per storage; a DTensor by its local tensor (what DTensor's op
    computes inside itself is not seen, only what it returns)."""

    def __init__(self, track_peak: bool = False):
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef

        self._storage_ref = StorageWeakRef  # tracks the storage itself: views keep it alive
        self._storages: dict[int, tuple] = {}
        # `track_peak`: `peak_bytes`, the most bytes live after any op (a scan per op: small tests only)
        self.track_peak, self.peak_bytes = track_peak, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _plain_tensors(torch.utils._pytree.tree_leaves(out)):
            if not t.is_sparse:
                storage = t.untyped_storage()
                key = storage.data_ptr()
                known = self._storages.get(key)
                if key and (known is None or known[0].expired()):  # new, or an address reused after a free
                    self._storages[key] = (self._storage_ref(storage), storage.nbytes())
        if self.track_peak:
            self.peak_bytes = max(self.peak_bytes, self.live_bytes())
        return out

    def live_bytes(self, exclude: tuple[torch.Tensor, ...] = ()) -> int:
        skip = {t.untyped_storage().data_ptr() for t in exclude}
        total = 0
        for key, (ref, nbytes) in list(self._storages.items()):
            if ref.expired():
                del self._storages[key]
            elif key not in skip:
                total += nbytes
        return total
