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
