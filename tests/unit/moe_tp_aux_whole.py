"""Imported by a spawned rank (run_layout's `imports`): a planted tensor-parallel bug. Every tp rank gives the
balance loss its whole gradient (aux_share left at 1, not 1 / tp), so the reduction of the router's and the
input's partial gradients over tp counts it tp times."""

from raydist.models.moe import MoEFeedForward

_shard = MoEFeedForward.shard_tensor_parallel


def whole_share(self, tp_mesh, layout):
    _shard(self, tp_mesh, layout)
    self.aux_share = 1.0


MoEFeedForward.shard_tensor_parallel = whole_share
