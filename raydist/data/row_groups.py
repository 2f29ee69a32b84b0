"""Reading a parquet shard, or only some of its row groups, counting the bytes read from storage.

A data-parallel rank needs a few row groups of each shard (stream.py). pyarrow's own reads would cost
more than those: opening a file reads 64 KiB from its end for the footer (a whole small shard), and its
pre-buffering fills gaps of up to 8 KiB between the column chunks it reads (here, other ranks' row
groups). So the footer is read exactly (and kept: `FOOTERS`), the chosen row groups' column chunks are
fetched as byte ranges (adjacent ones merged, remote ones requested concurrently through fsspec's
`cat_ranges`), and pyarrow decodes them from memory. Files are opened without fsspec's read-ahead cache,
so the bytes counted (`ByteCounter`, summed over what the file objects returned) are the bytes read.
"""

from __future__ import annotations

import bisect
import collections
import threading

import fsspec
import fsspec.implementations.local
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raydist.errors import DataError


class ByteCounter:
    """Bytes read from storage (the sum of what the file objects returned), safe across threads."""

    def __init__(self):
        self.bytes = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.bytes += n


class _ReadOnlyFile:
    """The file-object protocol pyarrow asks of a read-only, seekable wrapper around `self._f`."""

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return self._f.closed


class _CountingFile(_ReadOnlyFile):
    """A read-only file object that counts the bytes its reads return (pyarrow reads through it)."""

    def __init__(self, f, counter: ByteCounter | None):
        self._f, self._counter = f, counter

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        if self._counter is not None:
            self._counter.add(len(data))
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_rows(uri: str, columns: list[str], expected_rows: int, rows: np.ndarray | None = None,
              counter: ByteCounter | None = None, fs=None) -> tuple[pa.Table, np.ndarray | None]:
    """(table, shard rows it holds or None for all): `columns` of the row groups of the parquet file at
    `uri` that hold `rows` (increasing), or of the whole file; it must hold `expected_rows` rows. Opened without fsspec's read-ahead cache, so what is read from
    storage is what is asked for: the whole file, or the footer (unless cached: `_FooterCache`) and the
    chosen row groups' column chunks, adjacent ones in one read; `counter` adds it up."""
    try:
        if fs is None:
            fs, path = fsspec.core.url_to_fs(uri)
        else:
            path = fsspec.core.url_to_fs(uri)[1]
        with _CountingFile(fs.open(path, "rb", cache_type="none"), counter) as f:
            if rows is None:  # the whole file in one read
                parquet = pq.ParquetFile(pa.BufferReader(f.read()))
            else:  # the footer, exactly (pyarrow's own open reads 64 KiB from the end, a whole small shard)
                meta = _read_footer(uri, f)
            meta = parquet.metadata if rows is None else meta
            if meta.num_rows != expected_rows:
                raise DataError(f"{uri}: has {meta.num_rows} rows but the manifest says {expected_rows}"
                                "; the manifest does not match its shards, prepare the data again")
            if rows is None:
                return parquet.read(columns=columns), None
            bounds = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
            groups = np.unique(np.searchsorted(bounds, np.asarray(rows), side="right") - 1).tolist()
            # the chosen row groups' column chunks, adjacent ones in one read (no hole filling: pyarrow's
            # pre_buffer would read the small gaps between them, here other ranks' row groups, too)
            ranges = _merge([_chunk_range(meta.row_group(g), c) for g in groups
                             for c in range(meta.num_columns) if _top_column(meta, c) in columns])
            if isinstance(fs, fsspec.implementations.local.LocalFileSystem):
                pieces = []
                for start, stop in ranges:
                    f.seek(start)
                    pieces.append(f.read(stop - start))
            else:  # remote: the requests at once (fsspec's async filesystems, s3fs/gcsfs, run them concurrently)
                pieces = fs.cat_ranges([path] * len(ranges), [a for a, _ in ranges], [b for _, b in ranges],
                                       on_error="raise")
                if counter is not None:
                    counter.add(sum(len(p) for p in pieces))
            parquet = pq.ParquetFile(_RangeFile(f, ranges, pieces), metadata=meta, pre_buffer=False)
            table = parquet.read_row_groups(groups, columns=columns)
            return table, np.concatenate([np.arange(bounds[g], bounds[g + 1]) for g in groups])
    except FileNotFoundError:
        raise DataError(f"{uri}: shard listed in the manifest is missing; prepare the data again") from None
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{uri}: not a readable parquet file ({exc})") from None
    except KeyError as exc:
        raise DataError(f"{uri}: missing column {exc}") from None


def _top_column(meta: pq.FileMetaData, column: int) -> str:
    return meta.schema.column(column).path.split(".")[0]


def _chunk_range(group, column: int) -> tuple[int, int]:
    """[start, stop) bytes of one column chunk: its dictionary page (if any) and data pages."""
    chunk = group.column(column)
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page and chunk.dictionary_page_offset else \
        chunk.data_page_offset
    return start, start + chunk.total_compressed_size


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for start, stop in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return [(a, b) for a, b in merged]


class _RangeFile(_ReadOnlyFile):
    """A read-only file serving pyarrow's reads from byte ranges read ahead (one request each); a read
    outside them goes to the file itself (and is counted there like any other)."""

    def __init__(self, f, ranges: list[tuple[int, int]], pieces: list[bytes]):
        self._f, self._pos = f, 0
        self._starts = [a for a, _ in ranges]
        self._data = pieces  # the bytes of each range
        self._size = f.seek(0, 2)

    def read(self, n: int = -1) -> bytes:
        n = self._size - self._pos if n is None or n < 0 else n
        k = bisect.bisect_right(self._starts, self._pos) - 1
        if k >= 0 and self._pos + n <= self._starts[k] + len(self._data[k]):
            offset = self._pos - self._starts[k]
            out = self._data[k][offset:offset + n]
        else:
            self._f.seek(self._pos)
            out = self._f.read(n)
        self._pos += len(out)
        return out

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = {0: 0, 1: self._pos, 2: self._size}[whence] + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        pass  # the underlying file is closed by its owner


class _FooterCache:
    """Shard footers already read, by (uri, file size), up to `capacity_bytes` (least recently used out).
    Every rank needs every shard's footer each epoch (about 180 bytes per row group: a quarter of a
    dataset of 8-row groups of 129 tokens); kept, the epochs after the first read 1/dp of the row groups
    and nothing else. Shards do not change once the manifest is written (prepare never overwrites one)."""

    def __init__(self, capacity_bytes: int = 64 << 20):
        self.capacity_bytes = capacity_bytes
        self._footers: "collections.OrderedDict[tuple[str, int], bytes]" = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int]) -> bytes | None:
        with self._lock:
            if key in self._footers:
                self._footers.move_to_end(key)
            return self._footers.get(key)

    def put(self, key: tuple[str, int], footer: bytes) -> None:
        with self._lock:
            if key in self._footers or len(footer) > self.capacity_bytes:
                return
            self._footers[key] = footer
            self._bytes += len(footer)
            while self._bytes > self.capacity_bytes:
                self._bytes -= len(self._footers.popitem(last=False)[1])


FOOTERS = _FooterCache()


def _read_footer(uri: str, f) -> pq.FileMetaData:
    """The parquet footer (file metadata) of `f`, reading only its bytes: the last 8 (footer length and
    magic), then the footer; none when `FOOTERS` holds it."""
    size = f.seek(0, 2)
    if size < 12:
        raise DataError(f"{uri}: not a readable parquet file ({size} bytes)")
    footer = FOOTERS.get((uri, size))
    if footer is None:
        f.seek(size - 8)
        tail = f.read(8)
        length = int.from_bytes(tail[:4], "little")
        if tail[4:] != b"PAR1" or length > size - 12:
            raise DataError(f"{uri}: not a readable parquet file (no parquet footer at its end)")
        f.seek(size - 8 - length)
        footer = b"PAR1" + f.read(length) + tail
        meta = pq.read_metadata(pa.BufferReader(footer))
        FOOTERS.put((uri, size), footer)  # once it parses
        return meta
    return pq.read_metadata(pa.BufferReader(footer))
