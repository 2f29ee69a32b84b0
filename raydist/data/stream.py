"""Streams the samples a data-parallel rank needs, reading only the parquet row groups that hold them.

The reader follows the shard walk of `SampleOrder` (position.py) from the rank's current position. With a
`RankPlan` (the rank's slice of every global batch, known ahead), the stream works out, shard by shard,
which rows of the walk this rank will take and asks for those only: the reader reads the row groups
holding them (`ParquetFile.read_row_groups`), so with row groups no longer than the rank's slice a rank
reads 1/dp of the dataset per epoch instead of all of it. Without a plan (live recovery's uneven
spans, tools) whole shards are read.

Two readers yield the same `Shard` objects, checked against the manifest as they arrive, so bad data
fails with the file and row named instead of as a shape error deep in the model: pyarrow through fsspec
in a background thread (`ArrowReader`), and Ray Data (`RayDataReader`: one dataset per epoch of the walk,
read tasks mapped in order). Both read through row_groups.py and count the bytes they read from storage.

Only one rank per data-parallel index reads (see `Trainer`): ranks that share it (tensor, context and
pipeline peers) receive its batch by broadcast.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Iterator

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from raydist.data.position import RankPlan, SampleOrder
from raydist.data.prepare import read_manifest, shard_uri
from raydist.data.row_groups import ByteCounter, read_rows
from raydist.data.sft import attach_mask
from raydist.errors import DataError


@dataclass
class Shard:
    """The rows of one shard that were read: all of them, or those of some row groups."""

    index: int  # position in the split's shard list
    sample_ids: np.ndarray  # (n,) int64
    tokens: np.ndarray  # (n, seq_len + 1) int64; prompt/response data: with sft.NOT_TARGET flags
    rows: np.ndarray | None = None  # (n,) increasing: the shard rows held (None: every row, in order)

    def lookup(self, rows: np.ndarray) -> np.ndarray:
        """Indices into sample_ids / tokens of shard rows `rows`; a LookupError if one was not read."""
        rows = np.asarray(rows, dtype=np.int64)
        if self.rows is None:
            return rows
        at = np.minimum(np.searchsorted(self.rows, rows), len(self.rows) - 1)
        if len(rows) and (self.rows[at] != rows).any():
            missing = int(rows[self.rows[at] != rows][0])
            raise LookupError(f"row {missing} of shard {self.index} was not read (not in this rank's plan)")
        return at


@dataclass(frozen=True)
class ReadTask:
    """Read shard `index` (visited in `epoch` of the walk): the row groups holding `rows` (increasing), or
    the whole shard when `rows` is None."""

    epoch: int
    index: int
    rows: np.ndarray | None = None


@dataclass
class Split:
    """One split (train or val) of a prepared dataset, as the manifest describes it."""

    path: str
    name: str
    shards: list[dict]
    window: int
    vocab_size: int | None = None  # the tokenizer's, from the manifest: every token id is below it
    masked: bool = False  # shards hold a loss_mask column (prompt/response data, raydist.data.sft)

    @property
    def columns(self) -> list[str]:
        return ["sample_id", "tokens", "loss_mask"] if self.masked else ["sample_id", "tokens"]

    @classmethod
    def open(cls, path: str, name: str, manifest: dict | None = None) -> "Split":
        manifest = manifest or read_manifest(path)
        split = manifest["splits"].get(name)
        if split is None or not split["shards"]:
            raise DataError(f"{path}: the {name!r} split is empty; prepare more data or lower data.val_fraction")
        vocab = manifest.get("tokenizer", {}).get("vocab_size")
        return cls(path, name, split["shards"], manifest["window"], vocab if isinstance(vocab, int) else None,
                   bool(manifest.get("loss_mask")))

    @property
    def shard_rows(self) -> list[int]:
        return [s["rows"] for s in self.shards]

    def uri(self, index: int) -> str:
        return shard_uri(self.path, self.shards[index])

    def check_files(self, model_vocab_size: int | None = None) -> None:
        """Cheap whole-dataset check before training: every shard exists, has a readable footer, the
        expected columns and types, and the manifest's row count; with `model_vocab_size`, the footer's
        min/max statistics of the token column (written by `prepare`, covering every value) show no id
        outside [0, model_vocab_size)."""
        for i in range(len(self.shards)):
            uri = self.uri(i)
            try:
                with fsspec.open(uri, "rb") as f:
                    meta = pq.ParquetFile(f).metadata
                    schema = meta.schema.to_arrow_schema()
            except FileNotFoundError:
                raise DataError(f"{uri}: shard listed in the manifest is missing; prepare the data again") from None
            except Exception as exc:
                raise DataError(f"{uri}: not a readable parquet file ({exc}); prepare the data again") from None
            _check_schema(uri, schema)
            if meta.num_rows != self.shards[i]["rows"]:
                raise DataError(f"{uri}: has {meta.num_rows} rows but the manifest says {self.shards[i]['rows']}; "
                                "the manifest does not match its shards, prepare the data again")
            if model_vocab_size is not None:
                _check_token_range(uri, meta, model_vocab_size)


def _check_token_range(uri: str, meta, vocab_size: int) -> None:
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            column = group.column(c)
            stats = column.statistics
            if not column.path_in_schema.startswith("tokens.") or stats is None or not stats.has_min_max:
                continue  # no statistics: the per-row check when the shard is read still applies
            if stats.max >= vocab_size or stats.min < 0:
                bad = stats.max if stats.max >= vocab_size else stats.min
                raise DataError(f"{uri}: row group {g} holds token id {bad}, outside model.vocab_size={vocab_size} "
                                f"(ids 0..{vocab_size - 1}); set model.vocab_size > {stats.max} if the data is "
                                "right, or prepare the data again with the tokenizer the model is meant for")


def _check_schema(uri: str, schema: pa.Schema) -> None:
    for column in ("sample_id", "tokens"):
        if column not in schema.names:
            raise DataError(f"{uri}: no column {column!r} (columns: {', '.join(schema.names)})")
    tokens = schema.field("tokens").type
    if not (pa.types.is_list(tokens) or pa.types.is_large_list(tokens) or pa.types.is_fixed_size_list(tokens)) \
            or not pa.types.is_integer(tokens.value_type):
        raise DataError(f"{uri}: column 'tokens' has type {tokens}, expected a list of integers")
    if not pa.types.is_integer(schema.field("sample_id").type):
        raise DataError(f"{uri}: column 'sample_id' has type {schema.field('sample_id').type}, expected int64")


def table_to_shard(uri: str, index: int, table: pa.Table, split: Split, rows: np.ndarray | None = None) -> Shard:
    """Checks a table read from shard `index` against the manifest and turns it into a Shard. `rows`: the
    shard rows the table holds (increasing; None: all of them): its row count and sample ids must match."""
    _check_schema(uri, table.schema)
    expected = split.shards[index]["rows"] if rows is None else len(rows)
    if table.num_rows != expected:
        what = "the manifest says" if rows is None else "its row groups should hold"
        raise DataError(f"{uri}: has {table.num_rows} rows but {what} {expected}")
    held = np.arange(expected, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
    tokens = table.column("tokens").combine_chunks()
    lengths = pc.list_value_length(tokens).to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(lengths != split.window)
    if len(bad):
        raise DataError(f"{uri}: row {int(held[bad[0]])} holds {int(lengths[bad[0]])} tokens, expected seq_len + 1 = "
                        f"{split.window}; prepare the data with this data.seq_len")
    flat = tokens.flatten().to_numpy(zero_copy_only=False)
    ids = table.column("sample_id").to_numpy().astype(np.int64)
    first = split.shards[index]["first_sample_id"]
    if len(ids) and not np.array_equal(ids, first + held):
        wrong = int(np.flatnonzero(ids != first + held)[0])
        raise DataError(f"{uri}: sample ids {ids[0]}..{ids[-1]} do not match the manifest's {first}.."
                        f"{first + split.shards[index]['rows'] - 1} (row {int(held[wrong])} holds id {ids[wrong]}, "
                        f"expected {first + held[wrong]}); prepare the data again")
    tokens = flat.astype(np.int64).reshape(-1, split.window)
    if split.vocab_size is not None:
        bad = np.argwhere((tokens < 0) | (tokens >= split.vocab_size))
        if len(bad):
            row, col = (int(x) for x in bad[0])
            raise DataError(f"{uri}: row {int(held[row])} (sample id {int(ids[row])}) holds token id "
                            f"{int(tokens[row, col])} at position {col}, outside the tokenizer's vocabulary "
                            f"(0..{split.vocab_size - 1}) the manifest records; the shard does not match its "
                            "manifest, prepare the data again")
    if split.masked:
        if "loss_mask" not in table.column_names:
            raise DataError(f"{uri}: no column 'loss_mask' but the manifest records prompt/response data; "
                            "prepare the data again")
        mask = table.column("loss_mask").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        if mask.size != tokens.size:
            raise DataError(f"{uri}: column 'loss_mask' holds {mask.size} values for {tokens.size} tokens; "
                            "prepare the data again")
        tokens = attach_mask(tokens, mask.reshape(tokens.shape))
    return Shard(index, ids, tokens, None if rows is None else held)


def read_shard(split: Split, index: int, rows: np.ndarray | None = None, counter: ByteCounter | None = None) -> Shard:
    """Shard `index` (or the row groups of it holding `rows`), checked against the manifest."""
    table, held = read_rows(split.uri(index), split.columns, split.shards[index]["rows"], rows, counter)
    return table_to_shard(split.uri(index), index, table, split, held)


def as_task(task) -> ReadTask:
    return task if isinstance(task, ReadTask) else ReadTask(0, int(task))


# ---- the per-rank stream ---------------------------------------------------------------------------


class SampleStream:
    """Rows by global position, for positions taken in increasing order (gaps allowed).

    `take(start, stop)` returns (sample_ids (n,), tokens (n, seq_len + 1)). Shards are read in walk order
    starting at `start_position`; those behind the current position are dropped. With `plan`, only the
    row groups holding the positions the plan gives this rank from `start_position` on are read, and
    `take` refuses positions outside the plan (open a stream without one for those).
    """

    def __init__(self, split: Split, order: SampleOrder, reader, start_position: int, plan: RankPlan | None = None):
        self.split, self.order, self.reader, self.plan = split, order, reader, plan
        self.position = start_position
        self._keys: collections.deque = collections.deque()  # (epoch, shard) in walk order, to be read
        self._shards = reader.stream(split, self._tasks(start_position))
        self._loaded: "collections.OrderedDict[tuple[int, int], Shard]" = collections.OrderedDict()

    @property
    def bytes_read(self) -> int:
        """Bytes the reader has read from storage so far (read-ahead included)."""
        return self.reader.counter.bytes

    def _tasks(self, start: int) -> Iterator[ReadTask]:
        for epoch, shard, first in self.order.walk_from(start):
            rows = None
            if self.plan is not None:
                positions = np.arange(max(first, start), first + self.order.shard_rows[shard], dtype=np.int64)
                mine = positions[self.plan.taken(positions)]
                if not len(mine):
                    continue  # this rank takes nothing from this shard
                rows = np.unique(self.order.row_order(epoch, shard)[mine - first])
            self._keys.append((epoch, shard))
            yield ReadTask(epoch, shard, rows)

    def _get(self, epoch: int, shard: int) -> Shard:
        key = (epoch, shard)
        while key not in self._loaded:
            loaded = next(self._shards)
            loaded_key = self._keys.popleft()
            assert loaded_key[1] == loaded.index, "reader returned shards out of order"
            self._loaded[loaded_key] = loaded
        while next(iter(self._loaded)) != key:  # everything before `key` in the walk is done
            self._loaded.popitem(last=False)
        return self._loaded[key]

    def take(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        if start < self.position:
            raise ValueError(f"positions must increase: asked for {start} after {self.position}")
        if self.plan is not None and not self.plan.covers(start, stop):
            raise ValueError(f"positions [{start}, {stop}) are not all in this stream's plan {self.plan}")
        ids, rows = [], []
        for epoch, index, shard_rows in self.order.locate_range(start, stop):
            shard = self._get(epoch, index)
            at = shard.lookup(shard_rows)
            ids.append(shard.sample_ids[at])
            rows.append(shard.tokens[at])
        self.position = stop
        window = self.split.window
        return (np.concatenate(ids).astype(np.int64, copy=False) if ids else np.zeros(0, np.int64),
                np.concatenate(rows) if rows else np.zeros((0, window), np.int64))

    def close(self) -> None:
        self._shards.close()
