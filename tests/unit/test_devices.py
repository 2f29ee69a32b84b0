"""Devices and host-to-device copies, checked on a CPU machine: the harness's explicit device choice
(NCCL with rank r on cuda:r only with one GPU per rank, else gloo on CPU), `pick_device` answering from
the process group, batches copied pinned and non-blocking to CUDA only, and checkpoint staging through
pinned memory only for async saves of CUDA tensors. The CUDA side runs in tests/gpu."""

from __future__ import annotations

import pytest
import torch

from raydist.checkpoint import staging
from raydist.parallel import runtime


def fake_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("gpus, world, want", [(0, 1, "cpu"), (1, 1, "cuda"), (1, 2, "cpu"), (8, 4, "cuda"),
                                               (4, 8, "cpu")])
def test_auto_uses_one_gpu_per_rank_or_the_cpu(monkeypatch, gpus, world, want):
    fake_gpus(monkeypatch, gpus)
    monkeypatch.delenv(runtime.HARNESS_DEVICE_ENV, raising=False)
    assert runtime.harness_device(world) == want
    assert runtime.harness_device(world, "auto") == want


def test_explicit_choices(monkeypatch):
    fake_gpus(monkeypatch, 8)
    assert runtime.harness_device(2, "cpu") == "cpu"  # gloo on CPU even with GPUs, when asked
    monkeypatch.setenv(runtime.HARNESS_DEVICE_ENV, "cpu")
    assert runtime.harness_device(2) == "cpu"
    fake_gpus(monkeypatch, 1)
    with pytest.raises(ValueError, match="2 ranks but 1 GPU"):
        runtime.harness_device(2, "cuda")
    with pytest.raises(ValueError, match="'tpu'"):
        runtime.harness_device(2, "tpu")


def _device_in_rank():
    import torch.distributed as dist

    torch.cuda.is_available = lambda: True  # even a machine with GPUs: a gloo group means CPU tensors
    return str(runtime.pick_device()), dist.get_backend()


def test_gloo_ranks_get_the_cpu(plain_gloo):
    assert runtime.spawn(_device_in_rank, 2) == [("cpu", "gloo")] * 2


def test_strict_ranks_get_the_cpu():  # the suite's default: gloo under NCCL's rules is still the CPU
    from raydist import strict

    assert runtime.spawn(_device_in_rank, 2) == [("cpu", strict.BACKEND)] * 2


def test_to_device_on_cpu_is_the_same_tensor():
    x = torch.arange(6).view(2, 3)
    y = runtime.to_device(x, torch.device("cpu"))
    assert y is x and not y.is_pinned()


class _Backend:
    def __init__(self, splits: bool):
        self.supports_splitting, self.connected = splits, []

    def eager_connect_single_device(self, device):
        self.connected.append(device)


class _DefaultGroup:
    """A default process group created without device_id (as Ray Train creates it)."""

    def __init__(self, splits: bool):
        self.bound_device_id, self.backend = None, _Backend(splits)

    def _get_backend(self, device):
        return self.backend


@pytest.fixture
def default_group(monkeypatch):
    def make(splits: bool = True) -> _DefaultGroup:
        group = _DefaultGroup(splits)
        monkeypatch.setattr(runtime.dist, "is_initialized", lambda: True)
        monkeypatch.setattr(runtime.dist.distributed_c10d, "_get_default_group", lambda: group)
        return group
    return make


def test_bind_device_connects_nccl_eagerly_once_as_device_id_would(default_group):
    group, gpu = default_group(), torch.device("cuda", 1)
    assert runtime.bind_device(gpu) is True
    assert group.bound_device_id == gpu and group.backend.connected == [gpu]
    assert runtime.bind_device(gpu) is False and group.backend.connected == [gpu]  # already bound


def test_bind_device_leaves_cpu_ranks_and_backends_that_cannot_split(default_group):
    group = default_group()
    assert runtime.bind_device(torch.device("cpu")) is False and group.bound_device_id is None
    gloo = default_group(splits=False)
    assert runtime.bind_device(torch.device("cuda", 0)) is False
    assert gloo.bound_device_id is None and gloo.backend.connected == []


def test_bind_device_without_a_process_group_does_nothing():
    assert runtime.bind_device(torch.device("cuda", 0)) is False


class _HostTensor:
    """Records what `to_device` does with a host tensor bound for CUDA."""

    device = torch.device("cpu")

    def __init__(self):
        self.calls = []

    def pin_memory(self):
        self.calls.append("pin_memory")
        return self

    def to(self, device, non_blocking=False):
        self.calls.append(("to", str(device), non_blocking))
        return self


def test_to_device_pins_and_copies_without_blocking_for_cuda():
    host = _HostTensor()
    runtime.to_device(host, torch.device("cuda", 3))
    assert host.calls == ["pin_memory", ("to", "cuda:3", True)]


def test_cpu_state_is_staged_as_before():
    tree = {"model": {"w": torch.ones(3)}, "step": torch.tensor(4), "note": "x"}
    assert staging.cuda_devices(tree) == set()  # so save() stages without pinning, async or not
    staged = staging.stage(tree, pinned=True)
    assert torch.equal(staged["model"]["w"], tree["model"]["w"]) and staged["note"] == "x"
    assert staged["model"]["w"].data_ptr() != tree["model"]["w"].data_ptr()  # a copy
    assert not staged["model"]["w"].is_pinned()
