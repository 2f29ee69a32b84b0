"""The driver: it plans a run, starts Ray Train, and follows the run on the console and in `raydist status`."""
