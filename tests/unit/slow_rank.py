"""Imported by a spawned rank (run_fit's `imports`): rank 1's forwards take several times longer than they
did (a slower device, a noisy neighbour). The delay is a multiple of the rank's own forward time, not a fixed
sleep, so the ratio the detector sees holds on a loaded machine, where every rank's own work also slows
(a fixed 40 ms once gave 0.16 s against 0.11 s on CI's two busy cores): the median of its last forwards,
not the one just run, whose time includes any while the process waited for a core (a forward that lost the
CPU for half a second would sleep 3 s more, and a clean-clone CI run's rank 0 timed out at the derived 3.0 s
limit waiting for it). Importable by name from the test's directory."""

import time

import torch.distributed as dist

from raydist.training.runners import AccumulationRunner

_forward = AccumulationRunner.forward_loss

SLOWDOWN = 6.0  # the forward is a third of a step or more (backward is about twice it): rank 1's step is >= 3x
RECENT = 9  # forwards the typical time is the median of
_recent: list[float] = []


def slow_forward(self, micro):
    start = time.perf_counter()
    out = _forward(self, micro)
    if dist.get_rank() == 1:
        _recent.append(time.perf_counter() - start)
        del _recent[:-RECENT]
        typical = sorted(_recent)[len(_recent) // 2]
        time.sleep(max(0.04, SLOWDOWN * typical))
    return out


AccumulationRunner.forward_loss = slow_forward
