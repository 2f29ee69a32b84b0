import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raydist.config import ConfigError, DataConfig
from raydist.data.position import SampleOrder, rank_slice
from raydist.data.prepare import DataError, prepare, read_manifest
from raydist.data.stream import ArrowReader, SampleStream, Split


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
