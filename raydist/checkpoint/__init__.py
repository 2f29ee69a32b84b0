"""Sharded, resharding, atomically committed checkpoints on any fsspec storage (see manager.py)."""

from raydist.checkpoint.manager import CheckpointManager, Found

__all__ = ["CheckpointManager", "Found"]
