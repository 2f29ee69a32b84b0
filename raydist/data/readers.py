"""Readers: iterate read tasks (a shard and the rows wanted from it) in the walk's order, reading ahead.

`ArrowReader` is pyarrow through fsspec in a background thread; `RayDataReader` is Ray Data, one dataset per
epoch of the walk, read tasks mapped in order. Both read through row_groups.py, count the bytes they read
from storage, and yield the `Shard` objects of stream.py, checked against the manifest as they arrive.
"""

from __future__ import annotations

import itertools
import queue
import threading
from typing import Iterable, Iterator

import fsspec
import numpy as np
import pyarrow as pa

from raydist.data.row_groups import ByteCounter, read_rows
from raydist.data.stream import ReadTask, Shard, Split, as_task, read_shard, table_to_shard
from raydist.errors import DataError, wrapped

class ArrowReader:
    """pyarrow + fsspec in a background thread, `prefetch` shards ahead."""

    def __init__(self, prefetch: int = 2):
        self.prefetch = max(1, prefetch)
        self.counter = ByteCounter()

    def stream(self, split: Split, tasks: Iterable[ReadTask | int]) -> Iterator[Shard]:
        out: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def work():
            try:
                for task in map(as_task, tasks):
                    if stop.is_set():
                        return
                    out.put(read_shard(split, task.index, task.rows, self.counter))
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


_META = ("_task", "_row", "_total", "_bytes")  # columns the Ray Data read tasks add to the rows


class _ReadTaskRows:
    """Ray Data map: one read task (a one-row batch: task number, shard, rows) -> the rows read, tagged
    with the task number, each row's shard row, the task's row count and the bytes it read."""

    def __init__(self, split: Split, fs):
        self.split, self.fs = split, fs

    def __call__(self, batch: pa.Table) -> pa.Table:
        task, index = batch.column("task")[0].as_py(), batch.column("index")[0].as_py()
        rows = None if batch.column("all")[0].as_py() else np.frombuffer(batch.column("rows")[0].as_py(), np.int64)
        counter = ByteCounter()
        split = self.split
        table, held = read_rows(split.uri(index), split.columns, split.shards[index]["rows"], rows, counter, self.fs)
        n = table.num_rows
        held = np.arange(n, dtype=np.int64) if held is None else held
        return (table.append_column("_task", pa.array(np.full(n, task, np.int64)))
                .append_column("_row", pa.array(held))
                .append_column("_total", pa.array(np.full(n, n, np.int64)))
                .append_column("_bytes", pa.array(np.full(n, counter.bytes, np.int64))))


class RayDataReader:
    """Ray Data: one dataset per epoch of the walk (from the stream's position to the epoch's end), whose
    rows are read tasks (shard, rows) mapped to the rows read, streamed with order preserved."""

    def __init__(self, prefetch: int = 2, cpus_per_read: float = 0.25, concurrency: int = 2):
        self.prefetch = max(1, prefetch)
        self.cpus_per_read = cpus_per_read
        self.concurrency = concurrency
        self.counter = ByteCounter()

    def stream(self, split: Split, tasks: Iterable[ReadTask | int]) -> Iterator[Shard]:
        import ray.data

        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        fs, _ = fsspec.core.url_to_fs(split.path)
        for _, group in itertools.groupby(map(as_task, tasks), key=lambda t: t.epoch):
            group = list(group)
            for task in group:
                _check_exists(split.uri(task.index))
            items = [{"task": k, "index": t.index, "all": t.rows is None,
                      "rows": b"" if t.rows is None else np.asarray(t.rows, np.int64).tobytes()}
                     for k, t in enumerate(group)]
            ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
                _ReadTaskRows(split, fs), batch_size=1, batch_format="pyarrow", num_cpus=self.cpus_per_read,
                compute=ray.data.TaskPoolStrategy(size=min(self.concurrency, len(items))))
            yield from self._shards(split, group, ds)

    def _shards(self, split: Split, group: list[ReadTask], ds) -> Iterator[Shard]:
        parts: list[pa.Table] = []
        rows = 0
        try:
            for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None, prefetch_batches=self.prefetch):
                while batch.num_rows:
                    task = batch.column("_task")[0].as_py()
                    total = batch.column("_total")[0].as_py()
                    take = min(total - rows, batch.num_rows)
                    parts.append(batch.slice(0, take))
                    batch, rows = batch.slice(take), rows + take
                    if rows == total:
                        table = pa.concat_tables(parts)
                        self.counter.add(table.column("_bytes")[0].as_py())
                        index = group[task].index
                        held = None if group[task].rows is None else table.column("_row").to_numpy()
                        yield table_to_shard(split.uri(index), index, table.drop_columns(list(_META)), split, held)
                        parts, rows = [], 0
        except DataError:
            raise
        except Exception as exc:  # a read task's DataError arrives wrapped by Ray: raise the DataError itself
            message = _data_error_in(exc)
            if message is None:
                raise
            raise DataError(message) from None


_DATA_ERROR_LINE = f"{DataError.__module__}.{DataError.__qualname__}: "


def _data_error_in(exc: BaseException) -> str | None:
    """The message of the DataError that `exc` wraps. Ray Data hands a task's exception back as a
    RayTaskError(UserCodeException) whose text holds the task's traceback (the DataError object itself is
    not in its cause chain), so the message is taken from that text."""
    for e in wrapped(exc):
        if isinstance(e, DataError):
            return str(e)
    for line in str(exc).splitlines():
        if _DATA_ERROR_LINE in line:
            return line.split(_DATA_ERROR_LINE, 1)[1].strip()
    return None


def _check_exists(uri: str) -> None:
    fs, path = fsspec.core.url_to_fs(uri)
    if not fs.exists(path):
        raise DataError(f"{uri}: shard listed in the manifest is missing; prepare the data again")


def make_reader(kind: str, prefetch: int):
    """`ray`: Ray Data; `arrow` and `auto`: pyarrow. Measured side by side (benchmarks/data_throughput.py,
    one dp rank of the default workload reading its own row groups, 2 CPUs): the first batch after 0.03 s
    (local files) and 0.7 s (S3 through a local moto server) with pyarrow against 7-8 s with Ray Data
    (its executor and read tasks start first), while both deliver tens of thousands of samples/s or more,
    hundreds of times what a training step consumes; so `auto` is pyarrow on either storage."""
    return RayDataReader(prefetch) if kind == "ray" else ArrowReader(prefetch)
