import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raydist.config import ConfigError, DataConfig
from raydist.data.position import SampleOrder, rank_slice
from raydist.data.prepare import prepare, read_manifest
from raydist.data.readers import ArrowReader
from raydist.data.stream import SampleStream, Split
from raydist.errors import DataError


def test_prepare_writes_packed_shards_and_manifest(tiny_data):
    m = read_manifest(tiny_data)
    assert m["seq_len"] == 32 and m["window"] == 33 and m["tokenizer"]["vocab_size"] == 257
    train = m["splits"]["train"]
    assert len(train["shards"]) >= 3 and train["rows"] == sum(s["rows"] for s in train["shards"])
    assert m["splits"]["val"]["rows"] > 0
    table = pq.read_table(f"{tiny_data}/{train['shards'][0]['path']}")
    tokens = np.array(table.column("tokens").to_pylist())
    assert tokens.shape[1] == 33 and tokens.max() <= 256
    assert table.column("sample_id").to_pylist() == list(range(table.num_rows))
    # real text: the bytes decode to Python source
    text = bytes(int(t) for row in tokens[:20] for t in row if t < 256).decode("utf-8", errors="replace")
    assert "import" in text or "def " in text


def test_prepare_text_files_and_missing_corpus(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 400)
    (tmp_path / "b.txt").write_text("more text here " * 400)
    m = prepare(DataConfig(corpus=str(tmp_path / "*.txt"), seq_len=16, val_fraction=0.0), str(tmp_path / "out"),
                log=lambda *_: None)
    # whole windows of 17 tokens, then whole row groups of data.row_group_rows (8) rows
    assert m["splits"]["train"]["rows"] == (400 * 12 + 400 * 15 + 2) // 17 // 8 * 8
    assert m["row_group_rows"] == 8 and pq.ParquetFile(f"{tmp_path}/out/train-00000.parquet").metadata.row_group(0).num_rows == 8
    with pytest.raises(ConfigError, match="matches no files"):
        prepare(DataConfig(corpus=str(tmp_path / "nothing-*.txt")), str(tmp_path / "out2"), log=lambda *_: None)
    with pytest.raises(ConfigError, match="already holds a prepared dataset"):
        prepare(DataConfig(corpus=str(tmp_path / "*.txt"), seq_len=16), str(tmp_path / "out"), log=lambda *_: None)


def test_sample_order_is_a_permutation_per_epoch_and_depends_on_seed():
    order = SampleOrder([5, 7, 3], seed=1)
    n = order.num_samples
    epoch0 = order.sample_ids(0, n)
    epoch1 = order.sample_ids(n, n)
    assert sorted(epoch0) == list(range(n)) and sorted(epoch1) == list(range(n))
    assert epoch0.tolist() != epoch1.tolist()  # reshuffled each epoch
    assert SampleOrder([5, 7, 3], seed=1).sample_ids(0, n).tolist() == epoch0.tolist()
    assert SampleOrder([5, 7, 3], seed=2).sample_ids(0, n).tolist() != epoch0.tolist()


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_rank_slices_tile_the_global_batch(dp):
    g = 12
    slices = [rank_slice(24, g, r, dp) for r in range(dp)]
    assert slices[0][0] == 24 and slices[-1][1] == 36
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))


def test_stream_follows_the_order_across_epochs(tiny_data):
    split = Split.open(tiny_data, "train")
    order = SampleOrder(split.shard_rows, seed=0)
    n = order.num_samples
    stream = SampleStream(split, order, ArrowReader(prefetch=2), start_position=n - 5)
    ids, tokens = stream.take(n - 5, n + 5)  # crosses the epoch boundary
    stream.close()
    assert ids.tolist() == order.sample_ids(n - 5, 10).tolist()
    assert tokens.shape == (10, 33)


def _copy_dataset(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return str(dst)


def test_bad_data_names_the_file(tiny_data, tmp_path):
    path = _copy_dataset(tiny_data, tmp_path / "d1")
    m = read_manifest(path)
    first = f"{path}/{m['splits']['train']['shards'][0]['path']}"
    # corrupt parquet
    with open(first, "wb") as f:
        f.write(b"not parquet at all")
    with pytest.raises(DataError, match="train-00000.parquet: not a readable parquet file"):
        Split.open(path, "train").check_files()
    # missing shard
    path = _copy_dataset(tiny_data, tmp_path / "d2")
    (tmp_path / "d2" / "train-00001.parquet").unlink()
    with pytest.raises(DataError, match="train-00001.parquet: shard listed in the manifest is missing"):
        Split.open(path, "train").check_files()
    # manifest/shard mismatch
    path = _copy_dataset(tiny_data, tmp_path / "d3")
    mpath = tmp_path / "d3" / "manifest.json"
    mj = json.loads(mpath.read_text())
    mj["splits"]["train"]["shards"][0]["rows"] += 1
    mpath.write_text(json.dumps(mj))
    with pytest.raises(DataError, match="the manifest does not match its shards"):
        Split.open(path, "train").check_files()
    # no manifest
    with pytest.raises(DataError, match="no manifest.json"):
        read_manifest(str(tmp_path / "empty"))


def _rewrite_shard(path, table):
    pq.write_table(table, path)


def test_bad_columns_types_and_lengths(tiny_data, tmp_path):
    path = _copy_dataset(tiny_data, tmp_path / "d")
    shard = f"{path}/train-00000.parquet"
    table = pq.read_table(shard)
    split = Split.open(path, "train")
    _rewrite_shard(shard, table.drop_columns(["tokens"]))
    with pytest.raises(DataError, match="train-00000.parquet: no column 'tokens'"):
        split.check_files()
    floats = pa.array([[float(x) for x in row] for row in table.column("tokens").to_pylist()])
    _rewrite_shard(shard, table.set_column(1, "tokens", floats))
    with pytest.raises(DataError, match="column .tokens. has type list<.*double>, expected a list of integers"):
        split.check_files()
    rows = table.column("tokens").to_pylist()
    rows[7] = rows[7][:20]
    _rewrite_shard(shard, table.set_column(1, "tokens", pa.array(rows, pa.list_(pa.int32()))))
    from raydist.data.stream import read_shard

    with pytest.raises(DataError, match="train-00000.parquet: row 7 holds 20 tokens, expected seq_len \\+ 1 = 33"):
        read_shard(split, 0)


def test_empty_dataset(tmp_path):
    (tmp_path / "tiny.txt").write_text("too short")
    with pytest.raises(DataError, match="gave no training sequence"):
        prepare(DataConfig(corpus=str(tmp_path / "tiny.txt"), seq_len=64), str(tmp_path / "o"), log=lambda *_: None)


def test_prepare_parquet_with_a_text_column(tmp_path):
    docs = [f"document number {i}: " + "some words here. " * 30 for i in range(20)]
    pq.write_table(pa.table({"body": docs, "n": list(range(20))}), tmp_path / "docs.parquet")
    m = prepare(DataConfig(corpus=str(tmp_path / "docs.parquet"), text_column="body", seq_len=16, val_fraction=0.0),
                str(tmp_path / "out"), log=lambda *_: None)
    assert m["splits"]["train"]["documents"] == 20
    with pytest.raises(DataError, match="docs.parquet: no column 'text'"):
        prepare(DataConfig(corpus=str(tmp_path / "docs.parquet"), seq_len=16), str(tmp_path / "out2"),
                log=lambda *_: None)
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "ints.parquet")
    with pytest.raises(DataError, match="ints.parquet: row 0 of column 'text' is int, not text"):
        prepare(DataConfig(corpus=str(tmp_path / "ints.parquet"), seq_len=16), str(tmp_path / "out3"),
                log=lambda *_: None)


def test_prepare_with_a_tokenizers_json_file(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = ("the quick brown fox jumps over the lazy dog. " * 50 + "</s> ") * 4
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]", "</s>"]))
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "corpus.txt").write_text(text)
    m = prepare(DataConfig(corpus=str(tmp_path / "corpus.txt"), tokenizer=str(tmp_path / "tok.json"), seq_len=8,
                           val_fraction=0.0), str(tmp_path / "out"), log=lambda *_: None)
    assert m["tokenizer"]["vocab_size"] == tok.get_vocab_size() and m["tokenizer"]["eos_id"] == tok.token_to_id("</s>")
    first = pq.read_table(f"{tmp_path}/out/train-00000.parquet").column("tokens").to_pylist()[0]
    assert tok.decode(first).startswith("the quick brown fox")
    with pytest.raises(ConfigError, match="is not a tokenizers JSON file"):
        (tmp_path / "bad.json").write_text("{}")
        prepare(DataConfig(corpus=str(tmp_path / "corpus.txt"), tokenizer=str(tmp_path / "bad.json")),
                str(tmp_path / "out2"), log=lambda *_: None)


def test_order_is_the_same_sequence_for_every_dp_size_across_epochs():
    order = SampleOrder([7, 5, 9], seed=4)
    g, steps = 6, 9  # 54 positions: more than two epochs of 21 samples
    expected = order.sample_ids(0, g * steps).tolist()
    for dp in (1, 2, 3, 6):
        seen = []
        for step in range(steps):
            for rank in range(dp):
                start, stop = rank_slice(step * g, g, rank, dp)
                seen += order.sample_ids(start, stop - start).tolist()
        assert seen == expected


# ---- row groups: the block order, and each dp rank reading only its rows -----------------------------


def _old_row_order(seed, epoch, shard, n):
    """The in-shard order before row groups existed (a copy of the old formula)."""
    keys = [int(k) & 0xFFFFFFFF for k in (seed, epoch, 2, shard)]
    return np.random.default_rng(np.random.SeedSequence(keys)).permutation(n)


def _old_shard_order(seed, epoch, num_shards):
    keys = [int(k) & 0xFFFFFFFF for k in (seed, epoch, 1)]
    return np.random.default_rng(np.random.SeedSequence(keys)).permutation(num_shards)


def test_block_1_is_the_order_before_row_groups():
    rows = [7, 5, 9, 1]
    order = SampleOrder(rows, seed=11, block=1)
    n = sum(rows)
    first = np.concatenate([[0], np.cumsum(rows)[:-1]])
    expected = []
    for epoch in range(3):
        for shard in _old_shard_order(11, epoch, len(rows)):
            expected += (first[shard] + _old_row_order(11, epoch, shard, rows[shard])).tolist()
    assert order.sample_ids(0, 3 * n).tolist() == expected
    assert SampleOrder(rows, seed=11).sample_ids(0, 3 * n).tolist() == expected  # block=1 is the default


@pytest.mark.parametrize("block", [2, 3, 8])
def test_block_order_visits_whole_blocks_and_is_a_permutation(block):
    rows = [16, 9, 24]
    order = SampleOrder(rows, seed=5, block=block)
    for epoch in range(2):
        for shard, n in enumerate(rows):
            walk = order.row_order(epoch, shard)
            assert sorted(walk.tolist()) == list(range(n))
            full = n // block * block
            blocks = walk[:full].reshape(-1, block) // block  # every block of the walk is one row group
            assert (blocks == blocks[:, :1]).all()
            assert sorted(walk[full:].tolist()) == list(range(full, n))  # the short block last
    assert order.row_order(0, 2).tolist() != order.row_order(1, 2).tolist()  # reshuffled each epoch
    assert order.row_order(0, 2).tolist() != list(range(24))
    # rows inside blocks are shuffled too, not only the blocks
    assert any((order.row_order(0, 2)[:block * 3] % block != np.tile(np.arange(block), 3)).tolist())


@pytest.fixture(scope="module")
def grouped_data(tmp_path_factory):
    """Small datasets (seq_len 16, 64-row shards, several epochs' worth of steps cheap) with row groups of
    1, 2, 4 and 8 rows, and one whose manifest predates row groups (order by row, read by row group)."""
    out = {}
    root = tmp_path_factory.mktemp("grouped")
    for b in (1, 2, 4, 8):
        out[b] = str(root / f"b{b}")
        prepare(DataConfig(corpus="stdlib", seq_len=16, max_corpus_mb=0.03, shard_rows=64, row_group_rows=b,
                           val_fraction=0.0), out[b], log=lambda *_: None)
    import shutil

    shutil.copytree(out[4], root / "legacy")
    manifest = json.loads((root / "legacy" / "manifest.json").read_text())
    del manifest["row_group_rows"]
    (root / "legacy" / "manifest.json").write_text(json.dumps(manifest))
    out["legacy"] = str(root / "legacy")
    return out


def _stream(path, start, plan=None, prefetch=2):
    from raydist.data.position import RankPlan  # noqa: F401

    split = Split.open(path, "train")
    order = SampleOrder(split.shard_rows, seed=3, block=read_manifest(path).get("row_group_rows", 1))
    return SampleStream(split, order, ArrowReader(prefetch=prefetch), start, plan), order


@pytest.mark.parametrize("block", [1, 2, 4, 8, "legacy"])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_each_rank_gets_what_a_whole_shard_read_gives(grouped_data, block, dp):
    """Every rank's rows, read through its plan, equal those of the whole-shard read for the same positions:
    from the start, and resumed at an arbitrary step boundary, over an epoch boundary."""
    from raydist.data.position import RankPlan

    g = 8
    path = grouped_data[block]
    n = read_manifest(path)["splits"]["train"]["rows"]
    for first_step in (0, n // g - 3):  # the second run resumes 3 steps before the epoch's end
        for rank in range(dp):
            whole, order = _stream(path, rank_slice(first_step * g, g, rank, dp)[0])
            mine, _ = _stream(path, rank_slice(first_step * g, g, rank, dp)[0],
                              RankPlan.at(first_step * g, g, rank, dp))
            try:
                for step in range(first_step, first_step + 12):
                    start, stop = rank_slice(step * g, g, rank, dp)
                    ids, rows = mine.take(start, stop)
                    ids_whole, rows_whole = whole.take(start, stop)
                    assert ids.tolist() == ids_whole.tolist() == order.sample_ids(start, stop - start).tolist()
                    assert np.array_equal(rows, rows_whole)
                assert first_step == 0 or (step + 1) * g > n  # the resumed run crossed into the next epoch
            finally:
                mine.close()
                whole.close()


def test_a_planned_stream_refuses_positions_outside_its_plan(grouped_data):
    from raydist.data.position import RankPlan

    stream, _ = _stream(grouped_data[2], 4, RankPlan.at(0, 8, 1, 2))
    try:
        stream.take(4, 8)
        with pytest.raises(ValueError, match="not all in this stream's plan"):
            stream.take(8, 12)  # rank 0's slice of the next step
    finally:
        stream.close()


def _dataset_bytes(path):
    import os

    m = read_manifest(path)
    return [os.path.getsize(f"{path}/{s['path']}") for s in m["splits"]["train"]["shards"]]


@pytest.fixture(scope="module")
def long_rows(tmp_path_factory):
    """Rows of 2049 tokens (4 KiB) in row groups of 2 rows, 16-row shards: row groups large against their
    footer entries, as with a real workload's long sequences."""
    out = str(tmp_path_factory.mktemp("long") / "s2048")
    prepare(DataConfig(corpus="stdlib", seq_len=2048, max_corpus_mb=0.4, shard_rows=16, row_group_rows=2,
                       val_fraction=0.0), out, log=lambda *_: None)
    return out


def _footer_bytes(path):
    """Bytes of each train shard's footer (metadata, its length and the magic): every rank reads them all."""
    m = read_manifest(path)
    out = []
    for s in m["splits"]["train"]["shards"]:
        with open(f"{path}/{s['path']}", "rb") as f:
            f.seek(-8, 2)
            out.append(int.from_bytes(f.read(4), "little") + 8)
    return out


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_bytes_read_per_rank_per_epoch(long_rows, dp):
    """Counted by the reader (what the file objects returned), when the row group (2 rows) divides the
    rank's slice (8 / dp): over the first epoch each rank reads at most 1/dp of the row groups' bytes, every
    footer and two shards (the reader is ahead of the last position taken by one queued shard and one read
    that waits to be queued, as far as the background thread got); over the second (footers kept) at most
    1/dp of the dataset and two shards. The whole-shard read of the same positions reads it all."""
    from raydist.data.position import RankPlan
    from raydist.data.row_groups import FOOTERS

    g, path = 8, long_rows
    shards, footers = _dataset_bytes(path), sum(_footer_bytes(path))
    assert len(shards) >= 8 and footers < 0.2 * sum(shards)
    n = read_manifest(path)["splits"]["train"]["rows"]
    steps = n // g
    for rank in range(dp):
        FOOTERS.__init__()  # as a fresh process
        mine, _ = _stream(path, rank_slice(0, g, rank, dp)[0], RankPlan.at(0, g, rank, dp), prefetch=1)
        whole, _ = _stream(path, rank_slice(0, g, rank, dp)[0], prefetch=1)
        try:
            for step in range(steps):
                mine.take(*rank_slice(step * g, g, rank, dp))
                whole.take(*rank_slice(step * g, g, rank, dp))
            first, read_whole = mine.bytes_read, whole.bytes_read
            for step in range(steps, 2 * steps):
                mine.take(*rank_slice(step * g, g, rank, dp))
            second = mine.bytes_read - first
        finally:
            mine.close()
            whole.close()
        ahead = 2 * max(shards)  # prefetch 1: one shard queued and one read, waiting to queue (readers.py)
        assert first <= (sum(shards) - footers) / dp + footers + ahead, (rank, first, sum(shards), footers)
        assert second <= sum(shards) / dp + ahead, (rank, second, sum(shards))
        assert read_whole >= sum(shards)  # the count is real: whole shards read are the files' sizes (and more:
        # the reader is ahead of the last position taken)


def test_shard_rows_must_be_whole_row_groups(tmp_path):
    from raydist.config import Config

    with pytest.raises(ConfigError, match="data.shard_rows=100 is not a multiple of data.row_group_rows=8; set "
                                          "data.shard_rows=96"):
        Config.from_dict({"data": {"shard_rows": 100, "row_group_rows": 8}})
    with pytest.raises(ConfigError, match="data.row_group_rows=0"):
        Config.from_dict({"data": {"row_group_rows": 0}})
    with pytest.raises(ConfigError, match="not a multiple of data.row_group_rows=8"):
        prepare(DataConfig(corpus="stdlib", shard_rows=100), str(tmp_path / "o"), log=lambda *_: None)


def test_locate_range_is_locate_for_every_position():
    order = SampleOrder([7, 5, 9, 0, 4], seed=2, block=2)
    n = order.num_samples
    for start, stop in ((0, n), (3, 2 * n + 5), (n - 1, n + 1), (6, 6)):
        runs = order.locate_range(start, stop)
        flat = [(e, s, int(r)) for e, s, rows in runs for r in rows]
        assert flat == [(loc.epoch, loc.shard, loc.row) for loc in map(order.locate, range(start, stop))]


def test_the_data_fingerprint_names_the_row_group_size(tiny_data):
    """The order depends on row_group_rows, so a checkpoint's data fingerprint does too (a dataset prepared
    before row groups, without the field, keeps its old fingerprint: its order is unchanged)."""
    from raydist.checkpoint.compat import data_fingerprint

    m = read_manifest(tiny_data)
    assert m["row_group_rows"] == 8
    other = dict(m, row_group_rows=4)
    legacy = {k: v for k, v in m.items() if k != "row_group_rows"}
    assert data_fingerprint(m) != data_fingerprint(other)
    assert data_fingerprint(legacy) == data_fingerprint(dict(legacy, row_group_rows=1)) != data_fingerprint(m)


def test_remote_storage_reads_the_same_rows(grouped_data):
    """Through a non-local fsspec filesystem (memory://: the concurrent range requests of remote storage)
    a rank's planned stream gives the rows the local one gives, and counts what it read."""
    import fsspec

    from raydist.data.position import RankPlan

    local = grouped_data[4]
    fs = fsspec.filesystem("memory")
    fs.put(local + "/", "/grouped-b4/", recursive=True)
    remote = "memory://grouped-b4"
    try:
        g, dp, rank = 8, 2, 1
        plan = RankPlan.at(0, g, rank, dp)
        a, _ = _stream(local, rank_slice(0, g, rank, dp)[0], plan)
        b, _ = _stream(remote, rank_slice(0, g, rank, dp)[0], plan)
        try:
            for step in range(20):
                span = rank_slice(step * g, g, rank, dp)
                ids_a, rows_a = a.take(*span)
                ids_b, rows_b = b.take(*span)
                assert ids_a.tolist() == ids_b.tolist() and np.array_equal(rows_a, rows_b)
            assert b.bytes_read > 0
        finally:
            a.close()
            b.close()
    finally:
        fs.rm("/grouped-b4", recursive=True)
