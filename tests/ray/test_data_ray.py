"""The Ray Data reader streams the same shards, in the same order, with the same checks as pyarrow."""

import pytest

from raydist.data.position import SampleOrder
from raydist.data.prepare import DataError
from raydist.data.stream import ArrowReader, RayDataReader, SampleStream, Split

pytestmark = pytest.mark.ray


def test_ray_data_stream_equals_arrow_stream(local_ray, tiny_data):
    split = Split.open(tiny_data, "train")
    order = SampleOrder(split.shard_rows, seed=3)
    n = order.num_samples
    out = []
    for reader in (ArrowReader(prefetch=2), RayDataReader(prefetch=2, chunk=2)):
        stream = SampleStream(split, order, reader, start_position=n - 40)
        ids_a, rows_a = stream.take(n - 40, n - 10)  # crosses shards and the epoch boundary
        ids_b, rows_b = stream.take(n - 5, n + 30)
        stream.close()
        out.append((ids_a.tolist() + ids_b.tolist(), rows_a.sum() + rows_b.sum()))
    assert out[0] == out[1]
    assert out[0][0] == order.sample_ids(n - 40, 30).tolist() + order.sample_ids(n - 5, 35).tolist()


def test_ray_data_reader_reports_bad_shards(local_ray, tiny_data, tmp_path):
    import shutil

    shutil.copytree(tiny_data, tmp_path / "d")
    (tmp_path / "d" / "train-00001.parquet").unlink()
    split = Split.open(str(tmp_path / "d"), "train")
    reader = RayDataReader(prefetch=1, chunk=2)
    with pytest.raises(DataError, match="train-00001.parquet: shard listed in the manifest is missing"):
        list(reader.stream(split, iter([0, 1])))
