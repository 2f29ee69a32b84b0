"""Imported by a spawned rank (run_fit's `imports`): rank 1's forwards take 40 ms longer (a slower device,
a noisy neighbour). Importable by name from the test's directory."""

import time

import torch.distributed as dist

from raydist.training.runners import AccumulationRunner

_forward = AccumulationRunner.forward_loss


def slow_forward(self, micro):
    if dist.get_rank() == 1:
        time.sleep(0.04)
    return _forward(self, micro)


AccumulationRunner.forward_loss = slow_forward
