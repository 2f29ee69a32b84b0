"""The N-D device mesh: degrees (pp, dp_replicate, dp_shard, cp, tp), validated, built without globals.

Rank r sits at coordinates (pp, dp_replicate, dp_shard, cp, tp) of `arange(world).view(degrees)`: tp is
innermost, so tensor-parallel peers are consecutive ranks and share a node when workers are numbered node by
node (Ray Train does); pp is outermost, so pipeline stages cross nodes (Llama Team 2024, Figure 5, orders its
groups [TP, CP, PP, DP] from inside out, with FSDP outside pipeline; we keep pp outermost as TorchTitan does,
so that the dp groups of one stage are contiguous).

A resize builds a new `Mesh` from a new `MeshSpec`: nothing here is cached across worlds.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from raydist.errors import ConfigError

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class MeshSpec:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    """Expert parallelism: not a dim of its own but a split of dp_shard into (dp_shard / ep, ep), ep inner
    (`Mesh.ep`); outside the product `world_size` and `degrees()`."""

    @classmethod
    def from_config(cls, p) -> "MeshSpec":
        """From `[parallel]` (a ParallelConfig): the configured degrees, -1 still unresolved."""
        return cls(p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp, p.ep)

    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DIMS}

    def resolve(self, world_size: int) -> "MeshSpec":
        """Fill the one -1 degree from the world size and check the product equals it."""
        degrees = self.degrees()
        for name, value in degrees.items():
            if value == 0 or value < -1:
                raise ConfigError(f"parallel.{name}={value} must be a positive degree or -1")
        unknown = [name for name, value in degrees.items() if value == -1]
        if len(unknown) > 1:
            raise ConfigError(f"only one parallel degree may be -1, got {', '.join('parallel.' + n for n in unknown)}")
        known = math.prod(v for v in degrees.values() if v != -1)
        if unknown:
            if world_size % known:
                raise ConfigError(f"world size {world_size} is not divisible by the fixed degrees "
                                  f"{self._fixed_text()} (product {known}); change them or the worker count")
            degrees[unknown[0]] = world_size // known
        elif known != world_size:
            raise ConfigError(f"parallel degrees {self._fixed_text()} multiply to {known}, not the world size "
                              f"{world_size}; make their product {world_size} or set one of them to -1")
        if self.ep < 1 or degrees["dp_shard"] % self.ep:
            raise ConfigError(f"parallel.ep={self.ep} does not divide parallel.dp_shard={degrees['dp_shard']}: the "
                              "expert-parallel ranks are FSDP ranks; make dp_shard a multiple of ep")
        return MeshSpec(**degrees, ep=self.ep)

    def _fixed_text(self) -> str:
        return " x ".join(f"{k}={v}" for k, v in self.degrees().items() if v != -1)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel width: how many different batches are computed at once."""
        return self.dp_replicate * self.dp_shard

    def coordinates(self, rank: int) -> dict[str, int]:
        coords = {}
        for name in reversed(DIMS):
            rank, coords[name] = divmod(rank, getattr(self, name))
        return {name: coords[name] for name in DIMS}

    def dp_rank(self, rank: int) -> int:
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def build(self, device_type: str) -> "Mesh":
        return Mesh(self, device_type)

    def describe(self) -> str:
        text = " x ".join(f"{k}{v}" for k, v in self.degrees().items() if v > 1) or "single"
        return text + (f" (ep{self.ep})" if self.ep > 1 else "")


class Mesh:
    """A built mesh: the 5-D `DeviceMesh` plus the flattened views the parallel plans use.

    - `dp`: dp_replicate x dp_shard, the ranks that see different data (loss averaging, data slices);
    - `fsdp`: what FSDP shards over, dp_shard x cp (context-parallel ranks hold the same parameters,
      so they shard them too); for HSDP the 2-D (dp_replicate, dp_shard_cp) mesh;
    - `dp_cp`: dp x cp, the ranks whose gradients are averaged;
    - `batch_peers`: pp x cp x tp, the ranks that share one data-parallel index and so one batch;
    - with expert parallelism (spec.ep > 1), dp_shard unflattened into (dp_shard_mod_ep, ep), ep inner (the
      all-to-all stays among near ranks): `ep`, the ranks an MoE block's experts are split over, and
      `ep_tp`, (ep, tp) for expert stacks that tensor parallelism also splits (`ep` itself when tp = 1),
      `expert_fsdp`, what FSDP shards each expert over (dp_shard_mod_ep x cp; HSDP: with dp_replicate), as
      torchtitan's `dp_shard_mod_ep` does. All three come from one unflattened mesh, so FSDP can join them into
      the mesh of an expert parameter (its `_concatenate`). Without ep they are None.

    A view over dims of which at most one has more than one rank is that dim's own mesh (`_joined`): a
    flattened copy would be a new process group over the same ranks, on NCCL a communicator of its own
    (memory on every GPU and a connection at start-up) that no collective needs; and two views over the
    same wide dims share one flattening. With cp = 1, say, dp_shard_cp is dp_shard and dp_cp is dp.
    """

    def __init__(self, spec: MeshSpec, device_type: str):
        # The mesh covers ranks 0 .. spec.world_size - 1; an elastic run may leave the rest idle.
        if spec.world_size > dist.get_world_size():
            raise ConfigError(f"mesh {spec.describe()} needs {spec.world_size} ranks, the world has "
                              f"{dist.get_world_size()}")
        self.spec = spec
        self.device_type = device_type
        self.rank = dist.get_rank()
        if self.rank >= spec.world_size:
            raise ValueError(f"rank {self.rank} is idle in mesh {spec.describe()}; it builds no mesh")
        self.coords = spec.coordinates(self.rank)
        shape = tuple(spec.degrees().values())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            if spec.world_size == dist.get_world_size():
                self.device_mesh: DeviceMesh = init_device_mesh(device_type, shape, mesh_dim_names=DIMS)
            else:
                self.device_mesh = DeviceMesh(device_type, torch.arange(spec.world_size).view(shape),
                                              mesh_dim_names=DIMS)
            m = self.device_mesh
            flat: dict[tuple[str, ...], DeviceMesh] = {}
            self.dp: DeviceMesh = _joined(m, ("dp_replicate", "dp_shard"), "dp", flat)
            self.dp_shard_cp: DeviceMesh = _joined(m, ("dp_shard", "cp"), "dp_shard_cp", flat)
            self.dp_cp: DeviceMesh = _joined(m, ("dp_replicate", "dp_shard", "cp"), "dp_cp", flat)
            self.batch_peers: DeviceMesh = _joined(m, ("pp", "cp", "tp"), "batch_peers", flat)
            if spec.dp_replicate > 1:
                self.fsdp: DeviceMesh = DeviceMesh._concatenate([m["dp_replicate"], self.dp_shard_cp])
            else:
                self.fsdp = self.dp_shard_cp
            self.ep: DeviceMesh | None = None
            self.ep_tp: DeviceMesh | None = None
            self.expert_fsdp: DeviceMesh | None = None
            if spec.ep > 1:
                e = _expert_root(m, spec, device_type)
                self.ep = e["ep"]
                self.ep_tp = e["ep", "tp"] if spec.tp > 1 else self.ep  # (ep, tp) stacks
                outer = _joined(e, ("dp_shard_mod_ep", "cp"), "dp_shard_mod_ep_cp", {})
                self.expert_fsdp = (DeviceMesh._concatenate([e["dp_replicate"], outer]) if spec.dp_replicate > 1
                                    else outer)

    def __getitem__(self, name: str) -> DeviceMesh:
        return self.device_mesh[name]

    def size(self, name: str) -> int:
        return getattr(self.spec, name)

    def local_rank(self, name: str) -> int:
        return self.coords[name]

    @property
    def dp_rank(self) -> int:
        return self.spec.dp_rank(self.rank)

    @property
    def is_batch_leader(self) -> bool:
        """The rank that reads data for its batch peers."""
        return self.coords["pp"] == 0 and self.coords["cp"] == 0 and self.coords["tp"] == 0

    @property
    def batch_leader_rank(self) -> int:
        """Global rank of this rank's batch leader."""
        return int(self.batch_peers.mesh.flatten()[0])

    def describe(self) -> dict[str, int]:
        return self.spec.degrees()


def _expert_root(mesh: DeviceMesh, spec: MeshSpec, device_type: str) -> DeviceMesh:
    """The mesh the expert-parallel views come from: dp_shard split into (dp_shard_mod_ep, ep), ep inner, with
    every dim FSDP shards an expert over (dp_shard_mod_ep, cp) before ep. FSDP joins an expert's data-parallel
    mesh and its ep mesh into one (`DeviceMesh._concatenate`), which must name its root's dims in order.
    Without cp that is `mesh`'s own dp_shard unflattened (`_unflatten`: the other dims keep their groups);
    with cp it is a root of its own over the same ranks, cp moved before ep (its coordinates are the main
    mesh's: rank r's ep peers are the same ranks), whose dims get groups of their own."""
    mod = spec.dp_shard // spec.ep
    names = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")
    if spec.cp == 1:
        return mesh._unflatten("dp_shard", (mod, spec.ep), names[2:4])
    ranks = torch.arange(spec.world_size).view(spec.pp, spec.dp_replicate, mod, spec.ep, spec.cp, spec.tp)
    return DeviceMesh(device_type, ranks.permute(0, 1, 2, 4, 3, 5).contiguous(),
                      mesh_dim_names=("pp", "dp_replicate", "dp_shard_mod_ep", "cp", "ep", "tp"))


def _joined(mesh: DeviceMesh, dims: tuple[str, ...], name: str, flat: dict) -> DeviceMesh:
    """`dims` of `mesh` as one 1-D mesh: the dim itself when at most one of them has more than one rank (its
    process group exists already); else the flattening of those with more (a new group, named `name`), made
    once per such set of dims (`flat`: dp_cp is dp when cp = 1, dp_shard_cp when dp_replicate = 1)."""
    wide = tuple(d for d in dims if mesh[d].size() > 1)
    if len(wide) <= 1:
        return mesh[wide[0] if wide else dims[-1]]
    if wide not in flat:
        flat[wide] = mesh[wide]._flatten(name)
    return flat[wide]
