"""Checkpoint tensors as raw bytes at disk speed, checksummed while they are written and while they are read.

DCP's default file format runs every tensor through `torch.save` (a zip archive per tensor, with a CRC
computed by the zip writer and a pickle) and reads them back with `torch.load`. For checkpoints raydist
writes each stored chunk's bytes as they are in memory, one file per writer thread per rank:

    __<rank>_<i>.raw   chunk bytes back to back; DCP's metadata records (file, offset, length) per chunk,
                       and the chunk's dtype and shape (TensorStorageMetadata) give its meaning back

`RawWriter` writes in blocks of `BLOCK` bytes, updating a CRC-32 of every chunk as it goes (no read-back;
the file's CRC-32 follows from its chunks' by `crc32_combine`, so each byte is checksummed once), fsyncs,
and keeps `files` ({name: {size, crc32}}) and `chunks` ({name: {offset: crc32}}) for the commit record.
`RawReader` verifies each chunk's CRC-32 as it reads it (the commit record is handed to it), so a checkpoint
whose bytes changed after the commit fails to load with the chunk named, without a separate pass over every
file. Files written by DCP's own format (checkpoints of earlier raydist versions)
are still read by DCP's code path, through `torch.load(weights_only=True)`.

CRC-32 (zlib) rather than a cryptographic hash: the record detects torn and corrupted writes; it cannot
prove authorship anyway (whoever can write the storage can rewrite the record), and SHA-256 at ~1 GB/s per
core would halve the save speed of a disk that writes ~1 GB/s.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch
from torch.futures import Future
from torch.distributed.checkpoint.filesystem import _split_by_size_and_type, _StorageInfo
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner,
                                                  TensorWriteData, WriteItem, WriteItemType)
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

RAW_SUFFIX = ".raw"


class ChecksumMismatch(OSError):
    """A chunk's bytes differ from the checksum its commit recorded."""

BLOCK = 8 << 20  # bytes per write: large enough for the disk, small enough to overlap CRC and I/O


# CRC-32 of a concatenation from the parts' CRCs, as zlib's crc32_combine (Mark Adler, zlib 1.2.12:
# crc(A + B) = crc(A) * x^(8 len(B)) mod P  xor  crc(B), arithmetic over GF(2) in the reflected bit order);
# Python's zlib does not expose it. ~30 carry-less products of 32-bit words per call, whatever the lengths.
_POLY = 0xEDB88320  # the CRC-32 polynomial P, reflected


def _multmodp(a: int, b: int) -> int:
    """a * b mod P (reflected: bit 31 is x^0)."""
    m, p = 1 << 31, 0
    while a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)  # x^(2^n) mod P
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from crc1 = crc32(A), crc2 = crc32(B) and len2 = len(B) bytes."""
    p, n, k = 1 << 31, len2, 3  # x^0; x^(8 len2) = product of x^(2^k) over the set bits of len2, shifted by 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


def _writeback_starter():
    """Linux's sync_file_range(fd, offset, n, SYNC_FILE_RANGE_WRITE): starts writing a range of dirty pages
    to the disk and returns at once (RocksDB's `bytes_per_sync` does the same). Each block written goes to
    the disk while the next is checksummed and copied, instead of all of them in the final fsync (which
    still makes them durable). None where the call does not exist."""
    try:
        import ctypes

        call = ctypes.CDLL(None, use_errno=True).sync_file_range  # ctypes releases the GIL during the call
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return lambda fd, offset, length: call(fd, offset, length, 2)  # 2: SYNC_FILE_RANGE_WRITE


_start_writeback = _writeback_starter()
EARLY_WRITEBACK = True  # off: the bytes reach the disk only in the final fsync


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (a host copy first for device tensors: staged chunk by chunk)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


class _Checked(NamedTuple):
    """A write result's storage data on its way to the coordinator: where the chunk is, and its CRC-32."""
    info: _StorageInfo
    crc32: int


class RawWriter(FsspecWriter):
    """DCP storage writer for raw chunk files (see the module doc); `thread_count` files are written in
    parallel. Each chunk's CRC-32 travels to the coordinator inside its write result (DCP gathers those to
    `finish` anyway), so after the save the coordinator's `files` and `chunks` cover every rank's files with
    no gather of our own (they stay empty on the other ranks)."""

    def __init__(self, path: str, thread_count: int = 2, **kwargs):
        super().__init__(path, sync_files=True, thread_count=thread_count, overwrite=True, **kwargs)
        self.files: dict[str, dict] = {}  # the coordinator's, after `finish`: {name: {size, crc32}}
        self.chunks: dict[str, dict[str, int]] = {}  # {name: {offset: crc32}}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix
        if any(item.type == WriteItemType.BYTE_IO for item in plan.items):
            raise ValueError("raydist checkpoints hold tensors only; a non-tensor value reached the writer")
        buckets = [b for b in _split_by_size_and_type(self.thread_count, plan.items) if b]
        names = [f"{prefix}{i}{RAW_SUFFIX}" for i in range(len(buckets))]
        with ThreadPoolExecutor(max_workers=max(1, len(buckets))) as pool:
            parts = list(pool.map(lambda nb: self._write_file(nb[0], nb[1], planner), zip(names, buckets)))
        future: Future = Future()
        future.set_result([result for part in parts for result in part])
        return future

    def _write_file(self, name: str, items, planner: SavePlanner) -> list[WriteResult]:
        path = self.fs.concat_path(self.path, name)
        results, offset = [], 0
        with self.fs.create_stream(path, "wb") as stream:
            fd = _local_fd(stream) if EARLY_WRITEBACK and _start_writeback is not None else None
            for item in items:
                data = _bytes_of(planner.resolve_data(item))
                chunk_crc = 0
                for start in range(0, len(data), BLOCK):
                    block = data[start:start + BLOCK]
                    chunk_crc = zlib.crc32(block, chunk_crc)
                    stream.write(block)
                    if fd is not None:
                        stream.flush()
                        _start_writeback(fd, offset + start, len(block))
                results.append(WriteResult(index=item.index, size_in_bytes=len(data),
                                           storage_data=_Checked(_StorageInfo(name, offset, len(data)), chunk_crc)))
                offset += len(data)
            stream.flush()
            try:
                os.fsync(stream.fileno())
            except (AttributeError, OSError, ValueError):  # object stores: the upload is the sync
                pass
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: every rank's results -> `files` and `chunks` of all of them, and `.metadata` holding
        plain `_StorageInfo`s (the only storage data its reader's allowlist resolves)."""
        files: dict[str, dict] = {}
        chunks: dict[str, dict[str, int]] = {}
        plain = []
        for part in results:
            for result in sorted(part, key=lambda r: (r.storage_data.info.offset, r.storage_data.info.length)
                                 if isinstance(r.storage_data, _Checked) else (0, 0)):
                data = result.storage_data
                if isinstance(data, _Checked):
                    info = data.info
                    record = files.setdefault(info.relative_path, {"size": 0, "crc32": 0})
                    if info.offset != record["size"]:
                        raise RuntimeError(f"{info.relative_path}: chunk at {info.offset} after {record['size']} bytes")
                    # each byte was checksummed once, per chunk; the file's CRC-32 follows from its chunks'
                    record["crc32"] = crc32_combine(record["crc32"], data.crc32, info.length)
                    record["size"] += info.length
                    file_chunks = chunks.setdefault(info.relative_path, {})
                    if info.length:  # an empty chunk shares its offset with the next one and needs no check
                        file_chunks[str(info.offset)] = data.crc32
                    result = WriteResult(index=result.index, size_in_bytes=result.size_in_bytes, storage_data=info)
                plain.append(result)
        super().finish(metadata, [plain])
        self.files, self.chunks = files, chunks


def _local_fd(stream) -> int | None:
    """The file descriptor of a local file's stream (None for object stores)."""
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError, NotImplementedError):
        return None


class RawReader(FsspecReader):
    """DCP storage reader for raw chunk files, checking each chunk against `chunks` ({file: {offset:
    crc32}}, from the commit record; None: no checks). Other files go through DCP's own reader."""

    def __init__(self, path: str, chunks: dict[str, dict[str, int]] | None = None, **kwargs):
        super().__init__(path, **kwargs)
        self.chunks = chunks

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._shapes = {(fqn, tuple(chunk.offsets)): (tuple(chunk.sizes), md.properties.dtype)
                        for fqn, md in metadata.state_dict_metadata.items() for chunk in md.chunks}

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        raw = [item for item in plan.items if self.storage_data[item.storage_index].relative_path.endswith(RAW_SUFFIX)]
        raw_ids = {id(item) for item in raw}
        other = [item for item in plan.items if id(item) not in raw_ids]
        if other:  # an earlier raydist's checkpoint: DCP's torch.save files
            super().read_data(LoadPlan(other, plan.storage_data, plan.planner_data), planner).result()
        per_file: dict[str, list] = {}
        for item in raw:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    self._read_item(stream, name, item, planner)
        future: Future = Future()
        future.set_result(None)
        return future

    def _read_item(self, stream, name: str, item, planner: LoadPlanner) -> None:
        if item.type == LoadItemType.BYTE_IO:
            raise ValueError(f"{name}: a non-tensor entry in a raydist checkpoint")
        info = self.storage_data[item.storage_index]
        stream.seek(info.offset)
        data = bytearray(info.length)
        view, got = memoryview(data), 0
        while got < info.length:
            n = stream.readinto(view[got:]) if hasattr(stream, "readinto") else None
            if n is None:
                chunk = stream.read(info.length - got)
                view[got:got + len(chunk)] = chunk
                n = len(chunk)
            if not n:
                raise OSError(f"{name}: chunk at offset {info.offset} is truncated ({got} of {info.length} bytes)")
            got += n
        if self.chunks is not None and info.length:
            want = self.chunks.get(name, {}).get(str(info.offset))
            if want is None or zlib.crc32(data) != want:
                raise ChecksumMismatch(f"{name}: the chunk of {item.storage_index.fqn} at offset {info.offset} does not match "
                              "its checksum in COMMIT.json (corrupted after the commit)")
        shape, dtype = self._shapes[(item.storage_index.fqn, tuple(item.storage_index.offset))]
        tensor = torch.frombuffer(data, dtype=dtype).reshape(shape) if info.length else torch.empty(shape, dtype=dtype)
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            tensor = tensor.narrow(dim, start, length)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise ValueError(f"shape mismatch for {item.storage_index.fqn}: the checkpoint has {tuple(tensor.size())}, "
                             f"the model {tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(item, target)


def shard_shape_and_offset(global_shape, mesh_shape, coordinate, placements) -> tuple[tuple, tuple] | None:
    """A DTensor shard's (local shape, global offset) for `Shard`/`Replicate` placements, from torch's own
    `Shard.local_shard_size_and_offset` (torch.chunk's split, nested over mesh dims); None for other
    placements or an empty shard (torch's general code decides those). torch 2.13's
    `compute_local_shape_and_global_offset`, which DCP's planner calls per tensor, builds
    `torch.arange` over the whole sharded dimension (~40 ms for 25M elements), half of a blocking save."""
    from torch.distributed.tensor import Replicate, Shard

    shape, offset = list(global_shape), [0] * len(global_shape)
    for mesh_dim, placement in enumerate(placements):
        if type(placement) is Shard:
            d = placement.dim
            size, start = Shard.local_shard_size_and_offset(shape[d], mesh_shape[mesh_dim], coordinate[mesh_dim])
            if size == 0:
                return None
            shape[d], offset[d] = size, offset[d] + start
        elif type(placement) is not Replicate:
            return None
    return tuple(shape), tuple(offset)


class RawSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with DTensor write items built by `shard_shape_and_offset` where it
    applies (the same items, without an index tensor per sharded dimension)."""

    def create_local_plan(self) -> SavePlan:
        requests = []
        for fqn, obj in self.state_dict.items():
            if isinstance(obj, DTensor):
                coordinate = obj.device_mesh.get_coordinate()
                if coordinate is None:
                    continue
                fast = shard_shape_and_offset(obj.shape, obj.device_mesh.shape, coordinate, obj.placements)
                if fast is not None and tuple(obj.to_local().shape) == fast[0]:
                    requests.append(_dtensor_write_item(fqn, obj, *fast))
                    continue
            requests += _create_write_items(fqn, obj)
        plan = SavePlan(requests)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan


def _dtensor_write_item(fqn: str, tensor: DTensor, sizes: tuple, offsets: tuple) -> WriteItem:
    """As torch's `_create_write_items_for_dtensor`, given the shard's shape and offset."""
    sizes, offsets = torch.Size(sizes), torch.Size(offsets)
    return WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                                 properties=TensorProperties.create_from_tensor(tensor.to_local()),
                                                 size=tensor.size()))
