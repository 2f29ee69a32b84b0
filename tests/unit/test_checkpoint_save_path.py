"""The raw checkpoint writer checksums each byte once: a file's CRC-32 comes from its chunks' (crc32_combine),
every rank's checksums reach rank 0 through DCP's write results, and the commit record they make matches
the bytes on storage; a 2-rank save (with an empty shard) loads back bit for bit and a changed byte is found."""

import os
import random
import zlib
from pathlib import Path

import pytest
import torch

from raydist.checkpoint.rawio import crc32_combine
from raydist.parallel.runtime import spawn


@pytest.mark.parametrize("seed", range(4))
def test_crc32_combine_is_the_crc_of_the_concatenation(seed):
    rng = random.Random(seed)
    parts = [rng.randbytes(rng.choice([0, 1, 7, 4096, 100_003])) for _ in range(5)]
    crc = 0
    for part in parts:
        crc = crc32_combine(crc, zlib.crc32(part), len(part))
    assert crc == zlib.crc32(b"".join(parts))
    assert crc32_combine(crc, zlib.crc32(b"x"), 1) != crc32_combine(crc, zlib.crc32(b"y"), 1)


def state(rank: int, mesh, filled: bool):
    """Three sharded tensors (the last has 1 row: rank 1's shard is empty) and a replicated one."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(7)
    full = {"w": torch.randn(1000, 3, generator=gen), "m": torch.randn(513, generator=gen),
            "one": torch.randn(1, 4, generator=gen), "r": torch.randn(17, generator=gen)}
    out = {}
    for name, tensor in full.items():
        placement = Replicate() if name == "r" else Shard(0)
        out[name] = distribute_tensor(tensor if filled else torch.zeros_like(tensor), mesh, [placement])
    return out


def _save_load(run_dir: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from raydist.checkpoint import CheckpointManager, storage

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))

    class Part:
        def __init__(self, tensors):
            self.tensors = tensors

        def state_dict(self):
            return {"t": self.tensors, "note": "hello"}

        def load_state_dict(self, loaded):
            self.tensors = loaded["t"]

    saved = state(rank, mesh, filled=True)
    manager = CheckpointManager(run_dir, keep=2, log=lambda *_: None)
    manager.save(3, {"p": Part(saved)}, blocking=True)
    manager.wait()
    dist.barrier()
    found = manager.latest()
    commit = storage.read_commit(found.uri) if rank == 0 else None
    target = Part(state(rank, mesh, filled=False))
    manager.load(found, {"p": target})
    same = all(torch.equal(target.tensors[k].to_local(), saved[k].to_local()) for k in saved)
    return commit, same, found.uri


def test_two_rank_commit_matches_the_bytes_and_loads_back(tmp_path):
    from raydist.checkpoint import storage
    from raydist.checkpoint.verify import verify_run

    run_dir = str(tmp_path / "run")
    (commit, same0, uri), (_, same1, _) = spawn(_save_load, 2, run_dir)
    assert same0 and same1
    on_disk = sorted(os.listdir(uri))
    raws = [name for name in on_disk if name.endswith(".raw")]
    assert {name.split("_")[2] for name in raws} == {"0", "1"}  # both ranks wrote, rank 0 recorded both
    assert sorted(commit["files"]) == sorted(n for n in on_disk if n != storage.COMMIT)
    for name, record in commit["files"].items():
        data = Path(uri, name).read_bytes()
        assert record == {"size": len(data), "crc32": zlib.crc32(data)}, name
    for name in raws:
        data = Path(uri, name).read_bytes()
        offsets = sorted(int(o) for o in commit["chunks"][name])
        assert offsets[0] == 0
        for start, end in zip(offsets, offsets[1:] + [len(data)]):
            assert commit["chunks"][name][str(start)] == zlib.crc32(data[start:end])
    assert [r["status"] for r in verify_run(run_dir)] == ["ok"]

    shard = Path(uri, raws[-1])
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 1
    shard.write_bytes(bytes(data))
    [result] = verify_run(run_dir)
    assert result["status"] == "corrupt" and raws[-1] in result["problem"]


def _async_saves(run_dir: str):
    """Three async saves, the values changed between them: the staging buffers are reused (same objects)
    and each checkpoint holds its own step's values."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from raydist.checkpoint import CheckpointManager

    mesh = init_device_mesh("cpu", (2,))
    weights = {"w": distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)]), "b": torch.zeros(5)}

    class Part:
        def state_dict(self):
            return {"t": weights}

        def load_state_dict(self, loaded):
            self.loaded = loaded["t"]

    manager = CheckpointManager(run_dir, keep=3, log=lambda *_: None)
    buffers = []
    for step in (1, 2, 3):
        for tensor in (weights["w"].to_local(), weights["b"]):
            tensor.fill_(float(step))
        manager.save(step, {"p": Part()}, blocking=False)
        buffers.append({k: id(v) for k, v in manager._staging.items()})
        for tensor in (weights["w"].to_local(), weights["b"]):
            tensor.fill_(-1.0)  # training moves on while the save is written
        manager.wait()
    dist.barrier()
    loaded = {}
    for found in [manager.latest(before=s + 1) for s in (1, 2, 3)]:
        target = {"w": distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)]), "b": torch.zeros(5)}
        part = Part()
        part.state_dict = lambda target=target: {"t": target}
        manager.load(found, {"p": part})
        w, b = part.loaded["w"].to_local(), part.loaded["b"]
        loaded[found.step] = (float(w.min()), float(w.max()), float(b.min()), float(b.max()))
    return buffers, loaded


def test_async_saves_reuse_their_staging_buffers(tmp_path):
    for buffers, loaded in spawn(_async_saves, 2, str(tmp_path / "run")):
        assert len(buffers[0]) == 2 and buffers[0] == buffers[1] == buffers[2]
        assert loaded == {s: (float(s),) * 4 for s in (1, 2, 3)}


def test_shard_shapes_and_offsets_are_torchs():
    """The planner's DTensor shard (shape, offset) equals torch's general computation wherever it answers."""
    import itertools

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from raydist.checkpoint.rawio import shard_shape_and_offset

    answered = 0
    for shape, mesh in itertools.product([(10,), (7, 5), (1000, 3), (8, 8)], [(2,), (3,), (2, 2), (4,)]):
        last = len(shape) - 1
        for placements in ([Shard(0)] * len(mesh), [Replicate(), Shard(0)][:len(mesh)], [Shard(last), Shard(0)][:len(mesh)],
                           [Shard(0), Shard(last)][:len(mesh)]):
            for coordinate in itertools.product(*[range(n) for n in mesh]):
                got = shard_shape_and_offset(shape, mesh, list(coordinate), placements)
                if got is None:  # an empty shard: torch's code decides
                    continue
                want = _compute_local_shape_and_global_offset(shape, mesh, list(coordinate), placements)
                assert got == (tuple(want[0]), tuple(want[1])), (shape, mesh, placements, coordinate)
                answered += 1
    assert answered > 150
