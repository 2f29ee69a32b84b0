"""A trained or pretrained model in one process: `raydist eval`, `raydist generate` and `raydist export`."""
