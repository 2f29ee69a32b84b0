"""Process groups fit a CUDA run without a GPU: every collective `fit` issues pairs its tensors with a
backend that accepts them (the bug this catches: a CPU int64 tensor all-reduced on the NCCL group at the
first logged step), and every group the Trainer and its mesh create times out after
elastic.collective_timeout_s (torch's default is 30 minutes for gloo, 10 for NCCL)."""

import pytest
import torch
import torch.distributed as dist

from raydist.parallel.runtime import spawn
from raydist.strict.audit import CollectiveAudit
from raydist.strict.purposes import HOST, new_group
from raydist.testing import tiny_config


def _fit_audited(raw: dict, run_dir: str) -> tuple[list[str], int]:
    from raydist.config import Config
    from raydist.training.loop import fit
    from raydist.training.trainer import Trainer

    with CollectiveAudit() as audit:
        trainer = Trainer(Config.from_dict(raw), torch.device("cpu"))
        fit(trainer, run_dir, log=lambda *_: None)
    return audit.violations, audit.checked


@pytest.mark.parametrize("parallel, world", [({"dp_replicate": 2}, 2), ({"pp": 2, "dp_replicate": 1}, 2),
                                             ({"dp_shard": 2, "tp": 2, "dp_replicate": 1}, 4)],
                         ids=["ddp2", "pp2", "fsdp2xtp2"])
def test_fit_pairs_every_collective_with_its_backend(tiny_data, tmp_path, parallel, world):
    raw = tiny_config(tiny_data, model={"num_layers": 2}, parallel=parallel,
                      train={"steps": 4, "log_every": 2, "eval_every": 2, "eval_batches": 1},
                      checkpoint={"every_steps": 2, "async_save": True})
    for violations, checked in spawn(_fit_audited, world, raw, str(tmp_path / "run")):
        assert checked > 0
        assert violations == []


def _host_tensor_on_device_group() -> list[str]:
    host = new_group([0, 1], HOST, "cpu", 30)
    with CollectiveAudit() as audit:
        committed = torch.tensor([3], dtype=torch.int64)  # what the first logged step did on the NCCL group
        dist.all_reduce(committed, op=dist.ReduceOp.MIN)
        dist.all_reduce(torch.tensor([3], dtype=torch.int64), group=host)  # the fix: a host (gloo) group
    return audit.violations


def test_the_audit_catches_a_host_tensor_on_a_device_group(plain_gloo):
    # (the audit records on gloo; under the strict mode the same tensor fails the collective:
    # tests/unit/test_strict_collectives.py)
    for violations in spawn(_host_tensor_on_device_group, 2):
        assert len(violations) == 1 and "host tensor (1,) torch.int64 on a device group" in violations[0]


def _derived_and_point_to_point() -> list[str]:
    import numpy as np

    host = new_group([0, 1], HOST, "cpu", 30)
    peer = 1 - dist.get_rank()
    training = torch.ones(2, device="cpu")  # made before the audit, like the model's tensors
    with CollectiveAudit() as audit:
        dist.all_reduce(torch.tensor([3]).long() + 1)  # computed from a host tensor only: still a host tensor
        dist.all_reduce(torch.from_numpy(np.array([1.0])))  # numpy's memory is host memory
        dist.all_reduce(torch.from_numpy(np.array([1.0])).to(torch.device("cpu")))  # moved to the device: fine
        dist.all_reduce(torch.tensor([2.0]) * training[:1])  # with a training tensor: lands on its device
        if dist.get_rank() == 0:
            dist.send(torch.zeros(1), dst=1)
        else:
            dist.recv(torch.zeros(1), src=0)
        ops = [dist.P2POp(dist.isend, training, peer), dist.P2POp(dist.irecv, torch.empty(2, device="cpu"), peer)]
        for work in dist.batch_isend_irecv(ops):  # `dist.isend` (wrapped while auditing) is accepted by P2POp
            work.wait()
        dist.all_reduce(training.clone(), group=host)  # a training tensor on gloo: not on a CUDA run
    return audit.violations


def test_the_audit_follows_host_tensors_and_checks_point_to_point(plain_gloo):
    for rank, violations in enumerate(spawn(_derived_and_point_to_point, 2)):
        p2p = "send" if rank == 0 else "recv"
        assert [v.split(" (")[0] for v in violations] == [
            "all_reduce of a host tensor", "all_reduce of a host tensor", f"{p2p} of a host tensor",
            "all_reduce of a training-device tensor"], violations
        assert "(1,) torch.int64 on a device group" in violations[0]
        assert "(1,) torch.float64 on a device group" in violations[1]


def _timeouts(raw: dict) -> list[tuple[str, float]]:
    from torch.distributed import distributed_c10d

    from raydist.config import Config
    from raydist.training.trainer import Trainer

    Trainer(Config.from_dict(raw), torch.device("cpu")).close()
    out = []
    from raydist.strict.group import StrictProcessGroup

    for group in list(distributed_c10d._world.pg_map):  # every group this rank belongs to (private, test-only)
        if isinstance(group, StrictProcessGroup):  # the strict mode's device groups: their gloo inside
            out.append((group.group_name, group.inner.options._timeout.total_seconds()))
            continue
        backend = group._get_backend(torch.device("cpu"))
        out.append((group.group_name, backend.options._timeout.total_seconds()))
    return out


def test_every_group_times_out_after_the_configured_timeout(tiny_data):
    raw = tiny_config(tiny_data, model={"num_layers": 2}, parallel={"pp": 2, "dp_shard": 2, "dp_replicate": 1},
                      elastic={"collective_timeout_s": 37.0})
    for groups in spawn(_timeouts, 4, raw, timeout_s=37.0):
        assert len(groups) > 5  # world, two host groups, the mesh's dimensions and flattened views
        wrong = [(name, t) for name, t in groups if t != 37.0]
        assert not wrong, wrong
