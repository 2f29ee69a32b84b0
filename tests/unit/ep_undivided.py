"""Imported by a spawned rank (run_layout's `imports`): a planted expert-parallel bug. The experts' FSDP unit
keeps FSDP's own average over its mesh, so an expert's gradient, which sums the tokens of every ep rank,
comes out ep times too large (the factor raydist.parallel.fsdp.apply_expert_fsdp sets is dropped)."""

import raydist.parallel.fsdp as fsdp

_apply = fsdp.apply_expert_fsdp


def undivided(experts, mesh, mp, reshard_after_forward, dp_size):
    _apply(experts, mesh, mp, reshard_after_forward, mesh.size())


fsdp.apply_expert_fsdp = undivided
