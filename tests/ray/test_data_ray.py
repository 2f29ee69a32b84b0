"""The Ray Data reader streams the same rows, in the same order, with the same checks as pyarrow: whole
shards, and each data-parallel rank's own row groups."""

import pytest

from raydist.data.position import RankPlan, SampleOrder, rank_slice
from raydist.data.prepare import read_manifest
from raydist.data.readers import ArrowReader, RayDataReader
from raydist.data.stream import SampleStream, Split
from raydist.errors import DataError
from ray_runs import ray_4cpu  # noqa: F401  (the Ray files' shared local cluster: a fixture)

pytestmark = pytest.mark.ray


def test_ray_data_stream_equals_arrow_stream(ray_4cpu, tiny_data):
    split = Split.open(tiny_data, "train")
    order = SampleOrder(split.shard_rows, seed=3, block=read_manifest(tiny_data)["row_group_rows"])
    n = order.num_samples
    out = []
    for reader in (ArrowReader(prefetch=2), RayDataReader(prefetch=2)):
        stream = SampleStream(split, order, reader, start_position=n - 40)
        ids_a, rows_a = stream.take(n - 40, n - 10)  # crosses shards and the epoch boundary (a second dataset)
        ids_b, rows_b = stream.take(n - 5, n + 30)
        stream.close()
        out.append((ids_a.tolist() + ids_b.tolist(), rows_a.sum() + rows_b.sum()))
    assert out[0] == out[1]
    assert out[0][0] == order.sample_ids(n - 40, 30).tolist() + order.sample_ids(n - 5, 35).tolist()


def test_ray_data_reads_each_ranks_row_groups(ray_4cpu, tiny_data):
    """dp 2, global batch 16 (row groups of 8 rows): through Ray Data each rank gets the rows of the order,
    resumed near the epoch's end, reading about half of what the whole-shard read reads."""
    split = Split.open(tiny_data, "train")
    order = SampleOrder(split.shard_rows, seed=3, block=read_manifest(tiny_data)["row_group_rows"])
    g, dp = 16, 2
    first = order.num_samples // g - 4
    for rank in range(dp):
        start = rank_slice(first * g, g, rank, dp)[0]
        mine = SampleStream(split, order, RayDataReader(prefetch=1), start, RankPlan.at(first * g, g, rank, dp))
        whole = SampleStream(split, order, ArrowReader(prefetch=1), start)
        try:
            for step in range(first, first + 8):
                span = rank_slice(step * g, g, rank, dp)
                ids, rows = mine.take(*span)
                ids_whole, rows_whole = whole.take(*span)
                assert ids.tolist() == ids_whole.tolist() == order.sample_ids(span[0], g // dp).tolist()
                assert (rows == rows_whole).all()
            assert 0 < mine.bytes_read < 0.75 * whole.bytes_read
        finally:
            mine.close()
            whole.close()


def test_ray_data_reader_reports_bad_shards(ray_4cpu, tiny_data, tmp_path):
    import shutil

    shutil.copytree(tiny_data, tmp_path / "d")
    (tmp_path / "d" / "train-00001.parquet").unlink()
    split = Split.open(str(tmp_path / "d"), "train")
    reader = RayDataReader(prefetch=1)
    with pytest.raises(DataError, match="train-00001.parquet: shard listed in the manifest is missing"):
        list(reader.stream(split, iter([0, 1])))
    with open(tmp_path / "d" / "train-00002.parquet", "wb") as f:
        f.write(b"not parquet at all")  # found, but unreadable: the read task's error, unwrapped
    with pytest.raises(DataError, match="train-00002.parquet: not a readable parquet file"):
        list(reader.stream(split, iter([0, 2])))
