import pytest

from raydist.config import Config, ConfigError
from raydist.parallel.mesh import MeshSpec
from raydist.planner.policy import resolve_layout


def test_fill_and_validate():
    assert MeshSpec(dp_shard=-1, tp=2).resolve(8) == MeshSpec(dp_shard=4, tp=2)
    assert MeshSpec(pp=2, dp_replicate=-1).resolve(4).dp_replicate == 2
    with pytest.raises(ConfigError, match="multiply to 6, not the world size 4"):
        MeshSpec(dp_shard=3, tp=2).resolve(4)
    with pytest.raises(ConfigError, match="world size 6 is not divisible by the fixed degrees"):
        MeshSpec(dp_shard=-1, tp=4).resolve(6)
    with pytest.raises(ConfigError, match="only one parallel degree may be -1"):
        MeshSpec(dp_shard=-1, tp=-1).resolve(4)


def test_tp_is_innermost_and_pp_outermost():
    spec = MeshSpec(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2)
    coords = [spec.coordinates(r) for r in range(8)]
    assert [c["tp"] for c in coords] == [0, 1] * 4  # tp peers are consecutive ranks (one node)
    assert [c["pp"] for c in coords] == [0] * 4 + [1] * 4
    assert [spec.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_too_many_fsdp_shards_is_rejected():
    cfg = Config.load(None, ["model.d_model=32", "model.num_heads=4", "model.num_kv_heads=1",
                             "train.global_batch=16", "train.micro_batch=1"])
    resolve_layout(cfg, MeshSpec(dp_shard=8))  # kv projection has 1 x 8 = 8 rows: one per shard
    with pytest.raises(ConfigError, match="parallel.dp_shard=16 x cp=1 = 16 FSDP shards exceeds the smallest"):
        resolve_layout(cfg, MeshSpec(dp_shard=16))


def _flattenings_of_meshes(specs):
    """For each spec built in turn: the flattened meshes (each a new process group) it made, and for each
    view the ranks of this rank's group."""
    from torch.distributed.device_mesh import DeviceMesh

    made = []
    flatten = DeviceMesh._flatten

    def counting(self, name, *args, **kwargs):
        made.append(name)
        return flatten(self, name, *args, **kwargs)

    DeviceMesh._flatten = counting
    out = []
    for spec in specs:
        made.clear()
        mesh = spec.build("cpu")
        views = {name: sorted(getattr(mesh, name).mesh.flatten().tolist())
                 for name in ("dp", "dp_shard_cp", "dp_cp", "batch_peers", "fsdp")}
        out.append((list(made), views))
    return out


def test_a_view_over_one_wide_dim_makes_no_process_group_of_its_own():
    # (on NCCL every process group is a communicator on every GPU of it: only what a layout needs; the
    # views used to be four flattenings whatever the degrees)
    from raydist.parallel.runtime import spawn

    specs = [MeshSpec(dp_shard=4), MeshSpec(dp_shard=2, cp=2), MeshSpec(dp_replicate=2, dp_shard=2)]
    rank0, *_ = spawn(_flattenings_of_meshes, 4, specs)
    (fsdp, fsdp_views), (cp, cp_views), (hsdp, hsdp_views) = rank0
    assert fsdp == []  # dp, dp_shard_cp, dp_cp are dp_shard's own mesh; batch_peers a size-1 dim's
    assert fsdp_views["dp"] == fsdp_views["dp_cp"] == fsdp_views["fsdp"] == [0, 1, 2, 3]
    assert fsdp_views["batch_peers"] == [0]
    assert cp == ["dp_shard_cp"]  # dp_shard and cp both wide: one flattening, which dp_cp is too
    assert cp_views["dp"] == [0, 2] and cp_views["dp_shard_cp"] == cp_views["dp_cp"] == [0, 1, 2, 3]
    assert cp_views["batch_peers"] == [0, 1]
    assert hsdp == ["dp"]  # over both data-parallel dims; dp_cp is dp
    assert hsdp_views["dp"] == hsdp_views["dp_cp"] == hsdp_views["fsdp"] == [0, 1, 2, 3]
