"""The training step stack: the Trainer, its loop, the step runners and the optimizer."""
