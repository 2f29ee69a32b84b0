"""Streams the samples a data-parallel rank needs, reading parquet shards ahead of use.

The reader follows the shard walk of `SampleOrder` (position.py) from the rank's current position: shard
files are read in the order the walk visits them, a few ahead of the one being consumed, either by Ray
Data (`read_parquet` in a streaming execution that preserves order) or by pyarrow through fsspec in a
background thread. Both yield the same `Shard` objects, checked against the manifest as they arrive, so
bad data fails with the file and row named instead of as a shape error deep in the model.

Only one rank per data-parallel index reads (see `Trainer`): ranks that share it (tensor, context and
pipeline peers) receive its batch by broadcast.
"""

from __future__ import annotations

import collections
import queue
import threading
from dataclasses import dataclass
from typing import Iterator

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from raydist.data.position import SampleOrder
from raydist.data.prepare import DataError, read_manifest, shard_uri
from raydist.data.sft import attach_mask


@dataclass
class Shard:
    index: int  # position in the split's shard list
    sample_ids: np.ndarray  # (rows,) int64
    tokens: np.ndarray  # (rows, seq_len + 1) int64; prompt/response data: with sft.NOT_TARGET flags


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


def table_to_shard(uri: str, index: int, table: pa.Table, split: Split) -> Shard:
    _check_schema(uri, table.schema)
    expected = split.shards[index]["rows"]
    if table.num_rows != expected:
        raise DataError(f"{uri}: has {table.num_rows} rows but the manifest says {expected}")
    tokens = table.column("tokens").combine_chunks()
    lengths = pc.list_value_length(tokens).to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(lengths != split.window)
    if len(bad):
        raise DataError(f"{uri}: row {int(bad[0])} holds {int(lengths[bad[0]])} tokens, expected seq_len + 1 = "
                        f"{split.window}; prepare the data with this data.seq_len")
    flat = tokens.flatten().to_numpy(zero_copy_only=False)
    ids = table.column("sample_id").to_numpy().astype(np.int64)
    first = split.shards[index]["first_sample_id"]
    if len(ids) and (ids[0] != first or ids[-1] != first + expected - 1):
        raise DataError(f"{uri}: sample ids {ids[0]}..{ids[-1]} do not match the manifest's {first}.."
                        f"{first + expected - 1}")
    tokens = flat.astype(np.int64).reshape(-1, split.window)
    if split.vocab_size is not None:
        bad = np.argwhere((tokens < 0) | (tokens >= split.vocab_size))
        if len(bad):
            row, col = (int(x) for x in bad[0])
            raise DataError(f"{uri}: row {row} (sample id {int(ids[row])}) holds token id {int(tokens[row, col])} at "
                            f"position {col}, outside the tokenizer's vocabulary (0..{split.vocab_size - 1}) the "
                            "manifest records; the shard does not match its manifest, prepare the data again")
    if split.masked:
        if "loss_mask" not in table.column_names:
            raise DataError(f"{uri}: no column 'loss_mask' but the manifest records prompt/response data; "
                            "prepare the data again")
        mask = table.column("loss_mask").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        if mask.size != tokens.size:
            raise DataError(f"{uri}: column 'loss_mask' holds {mask.size} values for {tokens.size} tokens; "
                            "prepare the data again")
        tokens = attach_mask(tokens, mask.reshape(tokens.shape))
    return Shard(index, ids, tokens)


# ---- readers: iterate shards (by index) in a given order, reading ahead ------------------------------


class ArrowReader:
    """pyarrow + fsspec in a background thread, `prefetch` shards ahead."""

    def __init__(self, prefetch: int = 2):
        self.prefetch = max(1, prefetch)

    def stream(self, split: Split, indices: Iterator[int]) -> Iterator[Shard]:
        out: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def work():
            try:
                for index in indices:
                    if stop.is_set():
                        return
                    out.put(read_shard(split, index))
            except BaseException as exc:  # handed to the consumer, raised there
                out.put(exc)
            out.put(None)

        thread = threading.Thread(target=work, daemon=True, name="raydist-shard-reader")
        thread.start()
        try:
            while (item := out.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            while thread.is_alive():  # unblock a producer waiting on a full queue
                try:
                    out.get_nowait()
                except queue.Empty:
                    thread.join(timeout=0.05)


def read_shard(split: Split, index: int) -> Shard:
    uri = split.uri(index)
    try:
        with fsspec.open(uri, "rb") as f:
            table = pq.read_table(f, columns=split.columns)
    except FileNotFoundError:
        raise DataError(f"{uri}: shard listed in the manifest is missing; prepare the data again") from None
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{uri}: not a readable parquet file ({exc})") from None
    except KeyError as exc:
        raise DataError(f"{uri}: missing column {exc}") from None
    return table_to_shard(uri, index, table, split)


class RayDataReader:
    """Ray Data `read_parquet` over the shards in walk order, in batches of `chunk` shards, streamed with
    order preserved; rows are regrouped into shards by sample id."""

    def __init__(self, prefetch: int = 2, chunk: int = 4, cpus_per_read: float = 0.25, concurrency: int = 2):
        self.prefetch = max(1, prefetch)
        self.chunk = chunk
        self.cpus_per_read = cpus_per_read
        self.concurrency = concurrency

    def stream(self, split: Split, indices: Iterator[int]) -> Iterator[Shard]:
        import ray.data

        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        indices = iter(indices)
        filesystem, strip = _arrow_filesystem(split.path)
        while chunk := [i for _, i in zip(range(self.chunk), indices)]:
            uris = [split.uri(i) for i in chunk]
            for i, uri in zip(chunk, uris):
                _check_exists(uri)
            ds = ray.data.read_parquet([strip(u) for u in uris], filesystem=filesystem, columns=split.columns,
                                       shuffle=None, num_cpus=self.cpus_per_read, concurrency=self.concurrency,
                                       override_num_blocks=len(uris))
            pending: collections.deque = collections.deque(chunk)
            parts: list[pa.Table] = []
            rows = 0
            for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None,
                                         prefetch_batches=self.prefetch):
                parts.append(batch)
                rows += batch.num_rows
                while pending and rows >= split.shards[pending[0]]["rows"]:
                    index = pending.popleft()
                    need = split.shards[index]["rows"]
                    table = pa.concat_tables(parts)
                    yield table_to_shard(split.uri(index), index, table.slice(0, need), split)
                    rest = table.slice(need)
                    parts, rows = ([rest] if rest.num_rows else []), rest.num_rows
            if pending:
                raise DataError(f"{split.uri(pending[0])}: ended before the {split.shards[pending[0]]['rows']} rows "
                                "the manifest lists")


def _arrow_filesystem(path: str):
    """(pyarrow filesystem, uri -> path for it): fsspec's filesystem for remote URIs, so Ray Data reads
    any URI exactly as fsspec (and its configuration, e.g. an S3 endpoint) resolves it."""
    if "://" not in path or path.startswith("file://"):
        return None, lambda uri: uri.removeprefix("file://")
    import pyarrow.fs

    fs, _ = fsspec.core.url_to_fs(path)
    return pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs)), lambda uri: fsspec.core.url_to_fs(uri)[1]


def _check_exists(uri: str) -> None:
    fs, path = fsspec.core.url_to_fs(uri)
    if not fs.exists(path):
        raise DataError(f"{uri}: shard listed in the manifest is missing; prepare the data again")


def make_reader(kind: str, prefetch: int):
    if kind == "auto":
        kind = "ray" if _in_ray_worker() else "arrow"
    return RayDataReader(prefetch) if kind == "ray" else ArrowReader(prefetch)


def _in_ray_worker() -> bool:
    try:
        import ray

        return ray.is_initialized()
    except ImportError:  # pragma: no cover
        return False


# ---- the per-rank stream ---------------------------------------------------------------------------


class SampleStream:
    """Rows by global position, for positions taken in increasing order (gaps allowed).

    `take(start, stop)` returns (sample_ids (n,), tokens (n, seq_len + 1)). Shards are read in walk order
    starting at the first position asked for; those behind the current position are dropped.
    """

    def __init__(self, split: Split, order: SampleOrder, reader, start_position: int):
        self.split, self.order, self.reader = split, order, reader
        self.position = start_position
        self._walk = order.shards_from(start_position)
        self._keys: collections.deque = collections.deque()  # (epoch, shard) in walk order, to be read
        self._shards = reader.stream(split, self._indices())
        self._loaded: "collections.OrderedDict[tuple[int, int], Shard]" = collections.OrderedDict()

    def _indices(self) -> Iterator[int]:
        for epoch, shard in self._walk:
            self._keys.append((epoch, shard))
            yield shard

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
        ids, rows = [], []
        for p in range(start, stop):
            loc = self.order.locate(p)
            shard = self._get(loc.epoch, loc.shard)
            ids.append(shard.sample_ids[loc.row])
            rows.append(shard.tokens[loc.row])
        self.position = stop
        return np.asarray(ids, dtype=np.int64), np.stack(rows)

    def close(self) -> None:
        self._shards.close()
