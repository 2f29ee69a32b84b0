"""Expert parallelism's dispatch on one rank of a real process group (gloo on the CPU, NCCL on a GPU): the
experts' output and every gradient equal the path without ep, the all-to-alls are timed (CUDA events on a
GPU), and the host waits for the device only to read the splits (and, in the loop over experts, their
counts; the grouped GEMMs need no read). Multi-rank ep runs equal the single process in tests/unit/
test_moe.py on gloo; one GPU cannot run a multi-rank NCCL group, so this is the GPU's share."""

from __future__ import annotations

import copy

import torch

from raydist.parallel.runtime import spawn


def _dispatch(device: str) -> dict:
    import torch.distributed as dist

    from raydist.models.moe import GroupedExperts
    from raydist.testing import HostSyncCounter

    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    plain = GroupedExperts(4, 32, 48).to(dev)
    split = copy.deepcopy(plain)
    split.ep_group = dist.group.WORLD  # one rank holds every expert: the exchanges move rows to itself
    x = torch.randn(24, 32, device=dev, requires_grad=True)
    experts = torch.stack([torch.randperm(4)[:2] for _ in range(24)]).to(dev)
    weights = torch.rand(24, 2, device=dev)
    counts = torch.bincount(experts.reshape(-1), minlength=4)
    out = {}
    for name, module in (("plain", plain), ("ep", split)):
        with HostSyncCounter() as counter:
            y = module(x, experts, weights, counts)
        (y * torch.arange(32, device=dev)).sum().backward()
        out[name] = (y.detach().cpu(), x.grad.cpu(), [w.weight.grad.cpu() for w in module.stacks()],
                     [what for what, _ in counter.calls])
        x.grad = None
    return {"out": out, "seconds": split.clock.take(), "again": split.clock.take()}


def test_the_dispatch_equals_the_plain_path_and_reads_only_the_splits(device):
    [r] = spawn(_dispatch, 1, device, device=device)
    (y0, gx0, gw0, syncs0), (y1, gx1, gw1, syncs1) = r["out"]["plain"], r["out"]["ep"]
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-6)
    for a, b in zip(gw1, gw0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the loop over experts (fp32: no grouped GEMM) reads its counts once either way; ep adds the splits
    assert syncs0 == ["tolist"] and syncs1 == ["tolist", "tolist"], (syncs0, syncs1)
    assert r["seconds"] > 0 and r["again"] == 0  # forward and backward exchanges timed, then taken
