"""`raydist data prepare`: a text corpus -> token sequences packed to seq_len -> parquet shards + manifest.

Layout of a prepared dataset (any fsspec URI):

    <path>/train-00000.parquet ...   columns: sample_id int64, tokens list<uint16|int32> (seq_len + 1 each),
                                     and for prompt/response data loss_mask list<uint8> (raydist.data.sft)
    <path>/val-00000.parquet ...
    <path>/manifest.json             written last: its presence means the dataset is complete

Shards are written in row groups of data.row_group_rows rows (recorded as `row_group_rows` in the
manifest): the sample order shuffles whole row groups, then rows inside them (position.py), so a
data-parallel rank reads only the row groups holding its rows (stream.py).

Documents go to validation by a hash of their name, so the split does not depend on reading order.
Each split's documents are tokenized, joined with an end-of-document token and cut into
non-overlapping windows of seq_len + 1 tokens (inputs are the first seq_len, targets the last seq_len).
`sample_id` numbers a split's windows 0..N-1 in shard order; the training order is a permutation of
these ids (see position.py), so a sample id names one window forever.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import json
import os
import sysconfig
import time
from dataclasses import dataclass
from typing import Iterator

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raydist.config import ConfigError, DataConfig
from raydist.data import sft
from raydist.data.tokenizer import get_tokenizer
from raydist.errors import DataError
from raydist.store.atomic import write_json_atomic
from raydist.store.cache import cache_dir

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


@dataclass
class Document:
    name: str
    text: bytes


def default_data_path(cfg: DataConfig) -> str:
    """Where the corpus is prepared when data.path is empty: a cache entry named by every setting that
    changes the prepared data (so changing any of them prepares afresh instead of reusing stale shards)."""
    root = str(cache_dir())
    settings = repr((cfg.corpus, cfg.text_column, cfg.tokenizer, cfg.seq_len, cfg.val_fraction, cfg.shard_rows,
                     cfg.max_corpus_mb, cfg.row_group_rows))
    name = "stdlib" if cfg.corpus == "stdlib" else "corpus"
    return os.path.join(root, "data", f"{name}-s{cfg.seq_len}-{hashlib.sha1(settings.encode()).hexdigest()[:10]}")


def iter_documents(cfg: DataConfig) -> Iterator[Document]:
    """The corpus as (name, bytes), in a deterministic order, stopping after max_corpus_mb."""
    budget = int(cfg.max_corpus_mb * 1e6) if cfg.max_corpus_mb else None
    read = 0
    for doc in _documents(cfg):
        yield doc
        read += len(doc.text)
        if budget is not None and read >= budget:
            return


def _documents(cfg: DataConfig) -> Iterator[Document]:
    if cfg.corpus == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__", "dist-packages"))
            for name in sorted(filenames):
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    with open(path, "rb") as f:
                        yield Document(os.path.relpath(path, root), f.read())
        return
    files = _expand(cfg.corpus)
    for uri in files:
        if uri.endswith(".parquet"):
            yield from _parquet_documents(uri, cfg.text_column)
        else:
            with fsspec.open(uri, "rb") as f:
                yield Document(uri, f.read())


def _expand(pattern: str) -> list[str]:
    """A local path, directory or glob, or an fsspec URI/glob -> sorted file list (error if none)."""
    if "://" not in pattern:
        if os.path.isdir(pattern):
            pattern = os.path.join(pattern, "**", "*")
        files = sorted(p for p in globlib.glob(pattern, recursive=True) if os.path.isfile(p))
    else:
        fs, _, paths = fsspec.get_fs_token_paths(pattern)
        protocol = pattern.split("://", 1)[0]
        files = sorted(f"{protocol}://{p}" for p in paths if fs.isfile(p))
    if not files:
        raise ConfigError(f"data.corpus={pattern!r} matches no files; give a file, directory, glob or URI "
                          "that exists, or 'stdlib'")
    return files


def _parquet_documents(uri: str, column: str) -> Iterator[Document]:
    try:
        with fsspec.open(uri, "rb") as f:
            table = pq.read_table(f)
    except Exception as exc:
        raise DataError(f"{uri}: cannot read parquet: {exc}") from None
    if column not in table.column_names:
        raise DataError(f"{uri}: no column {column!r} (columns: {', '.join(table.column_names)}); "
                        "set data.text_column")
    for i, text in enumerate(table.column(column).to_pylist()):
        if text is None:
            continue
        if not isinstance(text, (str, bytes)):
            raise DataError(f"{uri}: row {i} of column {column!r} is {type(text).__name__}, not text")
        yield Document(f"{uri}#{i}", text.encode("utf-8") if isinstance(text, str) else text)


def is_validation(name: str, fraction: float) -> bool:
    digest = hashlib.sha1(name.encode("utf-8", errors="replace")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


class _ShardWriter:
    """Packs a token stream into rows of `window` tokens and writes shards of `rows_per_shard` rows in row
    groups of `row_group_rows` (the split's last rows short of a whole row group are dropped, so every
    shard is whole row groups and every block of the sample order is one row group: position.py)."""

    def __init__(self, fs, root: str, split: str, window: int, rows_per_shard: int, dtype, masked: bool = False,
                 row_group_rows: int = 1024):
        self.fs, self.root, self.split = fs, root, split
        self.window, self.rows_per_shard, self.dtype = window, rows_per_shard, dtype
        self.row_group_rows = row_group_rows
        self.masked = masked  # each token carries a loss-mask byte (column loss_mask)
        self.pending: list[np.ndarray] = []  # (n,) tokens, or (2, n) tokens and mask
        self.pending_tokens = 0
        self.rows: list[np.ndarray] = []
        self.shards: list[dict] = []
        self.next_id = 0

    def add(self, tokens: np.ndarray, mask: np.ndarray | None = None) -> None:
        self.pending.append(np.stack([tokens, mask.astype(tokens.dtype)]) if self.masked else tokens)
        self.pending_tokens += len(tokens)
        if self.pending_tokens >= self.window * 1024:
            self._cut()

    def _cut(self) -> None:
        empty = np.zeros((2, 0) if self.masked else 0, np.int32)
        stream = np.concatenate(self.pending, axis=-1) if self.pending else empty  # (n,) or (2, n)
        n = stream.shape[-1] // self.window
        if n:
            cut = stream[..., : n * self.window].reshape(*stream.shape[:-1], n, self.window)
            self.rows.extend(cut.swapaxes(0, 1) if self.masked else cut)  # rows of (window,) or (2, window)
        rest = stream[..., n * self.window:]
        self.pending, self.pending_tokens = [rest], rest.shape[-1]
        while len(self.rows) >= self.rows_per_shard:
            self._write(self.rows[: self.rows_per_shard])
            self.rows = self.rows[self.rows_per_shard:]

    def close(self) -> dict:
        self._cut()
        self.rows = self.rows[: len(self.rows) // self.row_group_rows * self.row_group_rows]
        if self.rows:
            self._write(self.rows)
            self.rows = []
        return {"shards": self.shards, "rows": sum(s["rows"] for s in self.shards),
                "tokens": sum(s["rows"] for s in self.shards) * self.window}

    def _write(self, rows: list[np.ndarray]) -> None:
        block = np.stack(rows)  # (rows, window) or (rows, 2, window)
        ids = np.arange(self.next_id, self.next_id + len(block), dtype=np.int64)
        columns = {"sample_id": ids}
        named = {"tokens": block[:, 0] if self.masked else block}
        if self.masked:
            named["loss_mask"] = block[:, 1].astype(np.uint8)
        for name, values in named.items():
            values = values.astype(self.dtype) if name == "tokens" else values
            array = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), self.window)
            columns[name] = array.cast(pa.list_(array.type.value_type))
        table = pa.table(columns)
        name = f"{self.split}-{len(self.shards):05d}.parquet"
        with self.fs.open(_join(self.root, name), "wb") as f:
            # Small row groups (a rank reads only its own) need an encoding that does not restart per row
            # group: a dictionary page per column chunk would, so tokens are byte-stream-split (their low and
            # high bytes apart) and zstd-compressed (half the size of dictionary + snappy on stdlib text, at
            # 8-row groups and at 1024). Statistics for the tokens only (min/max: Split.check_files's
            # vocabulary check): every row group adds its column chunks' metadata to the footer, which each
            # reading rank reads whole.
            pq.write_table(table, f, row_group_size=self.row_group_rows, write_statistics=["tokens.list.element"],
                           compression="zstd", use_dictionary=["loss_mask.list.element"],
                           column_encoding={"tokens.list.element": "BYTE_STREAM_SPLIT",
                                            "sample_id": "DELTA_BINARY_PACKED"})
        self.shards.append({"path": name, "rows": len(block), "first_sample_id": self.next_id})
        self.next_id += len(block)


def _join(root: str, name: str) -> str:
    return root.rstrip("/") + "/" + name


def prepare(cfg: DataConfig, out: str, *, log=print) -> dict:
    """Prepare `cfg.corpus` into shards at `out`; returns the manifest. Overwrites an incomplete
    dataset; refuses to overwrite a complete one with different settings."""
    tokenizer = get_tokenizer(cfg.tokenizer)
    if cfg.corpus != "stdlib":
        _expand(cfg.corpus)  # a missing corpus fails before anything is written
    fs, root = fsspec.core.url_to_fs(out)
    existing = read_manifest(out, missing_ok=True)
    if existing is not None:
        raise ConfigError(f"{out} already holds a prepared dataset (manifest.json); "
                          "choose another path or delete it first")
    fs.makedirs(root, exist_ok=True)
    start = time.time()
    window = cfg.seq_len + 1
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.int32
    masked = sft.is_jsonl(cfg.corpus)
    if cfg.shard_rows % cfg.row_group_rows:
        raise ConfigError(f"data.shard_rows={cfg.shard_rows} is not a multiple of data.row_group_rows="
                          f"{cfg.row_group_rows}; set data.shard_rows to a multiple of it")
    writers = {split: _ShardWriter(fs, root, split, window, cfg.shard_rows, dtype, masked, cfg.row_group_rows)
               for split in ("train", "val")}
    docs = {"train": 0, "val": 0}
    source_bytes = 0
    if masked:  # prompt/response examples: the loss mask counts the response only
        for uri in _expand(cfg.corpus):
            for name, prompt, response in sft.read_examples(uri):
                split = "val" if is_validation(name, cfg.val_fraction) else "train"
                writers[split].add(*sft.encode_example(tokenizer, prompt, response))
                docs[split] += 1
                source_bytes += len(prompt.encode()) + len(response.encode())
    for doc in ([] if masked else iter_documents(cfg)):
        split = "val" if is_validation(doc.name, cfg.val_fraction) else "train"
        tokens = tokenizer.encode(doc.text)
        writers[split].add(np.concatenate([tokens, np.array([tokenizer.eos_id], np.int32)]))
        docs[split] += 1
        source_bytes += len(doc.text)
    splits = {name: w.close() for name, w in writers.items()}
    for name, split in splits.items():
        split["documents"] = docs[name]
    if splits["train"]["rows"] == 0:
        raise DataError(f"data.corpus={cfg.corpus!r} gave no training sequence of {window} tokens "
                        f"({source_bytes} bytes read); use a larger corpus or a smaller data.seq_len")
    manifest = {
        "version": MANIFEST_VERSION,
        "corpus": cfg.corpus,
        "tokenizer": tokenizer.describe(),
        "seq_len": cfg.seq_len,
        "window": window,
        "loss_mask": masked,
        "row_group_rows": cfg.row_group_rows,  # the sample order's block (position.py)
        "source_bytes": source_bytes,
        "splits": splits,
        "created_unix": time.time(),
    }
    write_json_atomic(_join(out, MANIFEST), manifest)  # last, whole: its presence marks the dataset complete
    log(f"prepared {out}: {splits['train']['rows']} train / {splits['val']['rows']} val sequences of "
        f"{window} tokens from {docs['train'] + docs['val']} documents ({source_bytes / 1e6:.1f} MB) "
        f"in {time.time() - start:.1f}s")
    return manifest


def read_manifest(path: str, *, missing_ok: bool = False) -> dict | None:
    fs, root = fsspec.core.url_to_fs(path)
    name = _join(root, MANIFEST)
    if not fs.exists(name):
        if missing_ok:
            return None
        raise DataError(f"{path}: no {MANIFEST}; run `raydist data prepare --out {path}` or fix data.path")
    try:
        with fs.open(name, "r") as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{_join(path, MANIFEST)}: not valid JSON ({exc}); prepare the data again") from None
    for key in ("version", "seq_len", "window", "splits", "tokenizer"):
        if key not in manifest:
            raise DataError(f"{_join(path, MANIFEST)}: missing field {key!r}; prepare the data again")
    if manifest["window"] != manifest["seq_len"] + 1:
        raise DataError(f"{_join(path, MANIFEST)}: window={manifest['window']} but seq_len={manifest['seq_len']}; "
                        f"each row must hold seq_len + 1 = {manifest['seq_len'] + 1} tokens (inputs and shifted "
                        "targets); prepare the data again")
    return manifest


def shard_uri(path: str, shard: dict) -> str:
    return _join(path, shard["path"])
