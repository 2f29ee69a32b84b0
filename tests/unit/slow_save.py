"""Imported by a spawned rank (run_fit's `imports`): every checkpoint save stalls training SLOW_S seconds more,
as a slow store would, and says so in the stall it returns (raydist.checkpoint.manager.CheckpointManager.save).
Importable by name from the test's directory."""

import time

from raydist.checkpoint.manager import CheckpointManager

SLOW_S = 1.0
_save = CheckpointManager.save


def slow_save(self, *args, **kwargs) -> float:
    time.sleep(SLOW_S)
    return SLOW_S + _save(self, *args, **kwargs)


CheckpointManager.save = slow_save
