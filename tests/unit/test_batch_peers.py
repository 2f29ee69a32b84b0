"""Batch peers receive only what they use of their dp rank's rows (raydist.data.peers): a middle pipeline
stage nothing, the rank holding the first stage the inputs, the one holding the last the targets, a
context-parallel rank the columns of its own tokens (about 1/cp of the rows), tensor-parallel peers what
their tp = 0 peer gets. Bytes are counted at the receiving calls on every rank of a Trainer, and what
arrived is checked against the whole rows."""

import pytest
import torch
import torch.distributed as dist

from raydist.config import Config
from raydist.data import sft
from raydist.data.peers import LocalBatch, rank_needs
from raydist.parallel.context import POSITIONS
from raydist.parallel.layout import Layout
from raydist.parallel.runtime import spawn
from raydist.testing import tiny_config

T = 32  # tiny_config's seq_len


def _columns(positions: torch.Tensor, inputs: bool, targets: bool) -> int:
    """How many of the T + 1 row columns a rank with these token positions needs."""
    needed = (set(positions.tolist()) if inputs else set()) | (set((positions + 1).tolist()) if targets else set())
    return len(needed)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("impl", ["ring", "ulysses"])
def test_a_cp_rank_holds_its_tokens_and_their_targets(impl, cp):
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 300, (3, T + 1), generator=g)
    rows = rows | (torch.rand(3, T + 1, generator=g) < 0.3).long() * sft.NOT_TARGET  # masked targets
    inputs, targets = sft.split_rows(rows, masked=True)
    covered = []
    for r in range(cp):
        needs = rank_needs(Layout.of(cp=cp, cp_impl=impl), T, pp_rank=0, cp_rank=r)
        positions = POSITIONS[impl](T, cp, r)
        local = LocalBatch.of_rows(rows, needs)
        assert torch.equal(local.inputs(masked=True), inputs[:, positions])
        assert torch.equal(local.targets(masked=True), targets[:, positions])
        assert torch.equal(local.positions(torch.device("cpu")), positions)
        assert local.piece.shape == (3, _columns(positions, True, True))
        assert needs.width <= T // cp + 2  # T/cp tokens + one column per run (1 Ulysses, at most 2 ring)
        covered += positions.tolist()
    assert sorted(covered) == list(range(T))


@pytest.mark.parametrize("schedule, virtual, first, last", [("1f1b", 1, 0, 3), ("interleaved", 2, 0, 3),
                                                            ("zbv", 2, 0, 0)])
def test_pipeline_inputs_go_to_the_first_stage_and_targets_to_the_last(schedule, virtual, first, last):
    layout = Layout.of(pp=4, pp_schedule=schedule, virtual_stages=virtual)
    rows = torch.arange(2 * (T + 1)).view(2, T + 1)
    for pp_rank in range(4):
        needs = rank_needs(layout, T, pp_rank=pp_rank, cp_rank=0)
        assert (needs.inputs, needs.targets) == (pp_rank == first, pp_rank == last)
        local = LocalBatch.of_rows(rows, needs)
        if needs.inputs:
            assert torch.equal(local.inputs(masked=False), rows[:, :-1])
        if needs.targets:
            assert torch.equal(local.targets(masked=False), rows[:, 1:])
        assert needs.width == _columns(torch.arange(T), needs.inputs, needs.targets)
    assert [p.count for p in LocalBatch.of_rows(rows, rank_needs(layout, T, 1, 0)).chunk(2)] == [1, 1]


RECEIVING = ("broadcast", "recv", "irecv", "scatter", "batch_isend_irecv")


def _received_bytes(raw):
    """This rank's bytes received while the Trainer shares one batch, what it holds, and the whole rows."""
    from raydist.training.trainer import Trainer

    trainer = Trainer(Config.from_dict(raw), torch.device("cpu"))
    received = {"bytes": 0}
    originals = {name: getattr(dist, name) for name in RECEIVING}

    def counting(name):
        def call(*args, **kwargs):
            if name == "batch_isend_irecv":
                received["bytes"] += sum(op.tensor.nbytes for op in args[0] if op.op.__name__ == "irecv")
            elif name != "broadcast" or kwargs.get("src") != dist.get_rank():  # a broadcast's source receives none
                received["bytes"] += (args[0] if args else kwargs["tensor"]).nbytes
            return originals[name](*args, **kwargs)
        return call

    try:
        for name in RECEIVING:
            setattr(dist, name, counting(name))
        local, _ = trainer.next_batch(whole=False)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    whole, _ = trainer.next_batch()  # the same positions (a step has not been taken), the rows everywhere
    needs = trainer.batches.needs
    trainer.close()
    return {"coords": trainer.mesh.coords, "received": received["bytes"], "whole": whole,
            "inputs": local.inputs(masked=False), "targets": local.targets(masked=False),
            "is_leader": trainer.mesh.is_batch_leader, "needs": (needs.inputs, needs.targets)}


@pytest.mark.parametrize("parallel", [
    {"pp": 4, "pp_schedule": "1f1b"},
    {"cp": 2, "tp": 2, "cp_impl": "ring"},
    {"pp": 2, "cp": 2, "cp_impl": "ulysses"},
], ids=["pp4", "cp2xtp2-ring", "pp2xcp2-ulysses"])
def test_each_peer_receives_only_its_part(tiny_data, parallel):
    raw = tiny_config(tiny_data, model={"num_layers": 4}, parallel={"dp_replicate": 1, **parallel})
    results = spawn(_received_bytes, 4, raw)
    rows, pp, cp = results[0]["whole"].shape[0], parallel.get("pp", 1), parallel.get("cp", 1)
    whole_bytes = rows * (T + 1) * 8  # what every peer received before: the broadcast of the whole rows
    for got in results:
        c = got["coords"]
        positions = POSITIONS[parallel.get("cp_impl", "ring")](T, cp, c["cp"]) if cp > 1 else torch.arange(T)
        inputs, targets = c["pp"] == 0, c["pp"] == pp - 1
        assert got["needs"] == (inputs, targets)
        expected = 0 if got["is_leader"] else rows * _columns(positions, inputs, targets) * 8
        assert got["received"] == expected, (c, got["received"], expected)
        if inputs:
            assert torch.equal(got["inputs"], got["whole"][:, :-1][:, positions])
        if targets:
            assert torch.equal(got["targets"], got["whole"][:, 1:][:, positions])
        if not inputs and not targets:  # a middle pipeline stage
            assert got["received"] == 0 and got["inputs"] is None and got["targets"] is None
        if cp > 1 and not got["is_leader"]:  # a cp rank: its T/cp tokens and at most 2 columns more
            assert got["received"] <= whole_bytes * (T // cp + 2) / (T + 1)
    if pp == 4:
        assert [g["received"] for g in results] == [0, 0, 0, rows * T * 8]
