"""Bad input ends in one `error:` line and exit 2 before any worker starts: config values, a manifest or
shards that do not fit the model, storage that cannot be written."""

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import faults_fs  # noqa: F401  (registers rofile://)
from raydist.cli import main
from raydist.data.stream import Split, read_shard
from raydist.errors import DataError


def train(tmp_path, *overrides: str) -> int:
    args = ["train"]
    for item in (f"checkpoint.storage={tmp_path}/runs", *overrides):
        args += ["--set", item]
    return main(args)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error:")]
    assert len(errors) == 1 and err[-1] == errors[0], err
    return errors[0]


@pytest.mark.parametrize("overrides, message", [
    (["train.eval_batches=0"], "error: train.eval_batches=0 must be >= 1 when train.eval_every > 0; set "
                               "train.eval_batches >= 1, or train.eval_every=0 to skip validation (it is 50)"),
    (["train.beta1=1.0"], "error: train.beta1=1.0 must be in [0, 1) (AdamW's moment decay; the default is 0.9)"),
    (["train.beta2=-0.5"], "error: train.beta2=-0.5 must be in [0, 1) (AdamW's moment decay; the default is 0.95)"),
    (["train.weight_decay=-0.01"], "error: train.weight_decay=-0.01 must be >= 0 (0: no decay; the default is 0.1)"),
])
def test_bad_optimizer_and_eval_values(tmp_path, capsys, monkeypatch, no_ray, overrides, message):
    monkeypatch.setenv("RAYDIST_CACHE", str(tmp_path / "cache"))
    assert train(tmp_path, *overrides) == 2
    assert one_error_line(capsys) == message
    assert not (tmp_path / "runs").exists()


def test_eval_batches_zero_is_fine_without_evaluation():
    from raydist.config import Config

    assert Config.load(None, ["train.eval_batches=0", "train.eval_every=0"]).train.eval_batches == 0


def copy_data(tiny_data, dst) -> str:
    shutil.copytree(tiny_data, dst)
    return str(dst)


def test_manifest_window_must_be_seq_len_plus_one(tiny_data, tmp_path, capsys, no_ray):
    data = copy_data(tiny_data, tmp_path / "data")
    manifest = json.load(open(f"{data}/manifest.json"))
    manifest["window"] = 40
    json.dump(manifest, open(f"{data}/manifest.json", "w"))
    assert train(tmp_path, f"data.path={data}", "data.seq_len=32") == 2
    assert one_error_line(capsys) == (f"error: {data}/manifest.json: window=40 but seq_len=32; each row must hold "
                                      "seq_len + 1 = 33 tokens (inputs and shifted targets); prepare the data again")
    assert not (tmp_path / "runs").exists()


def test_token_ids_beyond_the_vocabulary(tiny_data, tmp_path, capsys, no_ray):
    data = copy_data(tiny_data, tmp_path / "data")
    shard = f"{data}/train-00001.parquet"
    table = pq.read_table(shard)
    rows = table.column("tokens").to_pylist()
    rows[3][5] = 400  # model.vocab_size is 320, the byte tokenizer's 257
    pq.write_table(table.set_column(1, "tokens", pa.array(rows, table.schema.field("tokens").type)), shard)
    # the driver: the shard footers' statistics, before any worker starts
    assert train(tmp_path, f"data.path={data}", "data.seq_len=32") == 2
    assert one_error_line(capsys) == (
        f"error: {shard}: row group 0 holds token id 400, outside model.vocab_size=320 (ids 0..319); set "
        "model.vocab_size > 400 if the data is right, or prepare the data again with the tokenizer the model is "
        "meant for")
    assert not (tmp_path / "runs").exists()
    # a worker reading the shard: the row and the id, against the tokenizer's vocabulary in the manifest
    with pytest.raises(DataError, match=r"train-00001.parquet: row 3 \(sample id 1027\) holds token id 400 at "
                                        r"position 5, outside the tokenizer's vocabulary \(0..256\)"):
        read_shard(Split.open(data, "train"), 1)


@pytest.mark.parametrize("kind", ["read-only", "unreachable"])
def test_storage_that_cannot_be_written(tiny_data, tmp_path, capsys, no_ray, kind):
    # read-only: tests run as root, whom chmod 0o555 does not stop, so the storage is a file system that
    # refuses writes with EROFS (what a read-only mount returns); unreachable: nothing listens on port 1.
    storage_uri = f"rofile://host{tmp_path}/runs" if kind == "read-only" else "ftp://user:pw@127.0.0.1:1/runs"
    assert main(["train", "--set", f"data.path={tiny_data}", "--set", "data.seq_len=32",
                 "--set", f"checkpoint.storage={storage_uri}"]) == 2
    line = one_error_line(capsys)
    if kind == "read-only":
        assert line == (f"error: checkpoint.storage=rofile://host{tmp_path}/runs cannot be written (PermissionError: "
                        "[Errno 30] Read-only file system); point it at a writable directory or bucket, or fix its "
                        "permissions or credentials")
    else:
        assert line.startswith("error: checkpoint.storage=ftp://***@127.0.0.1:1/runs cannot be written "
                               "(ConnectionRefusedError: ")
    assert not (tmp_path / "runs").exists()
