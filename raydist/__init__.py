"""raydist: train large PyTorch models on Ray with data, fully-sharded, tensor, context and pipeline
parallelism composed on one device mesh, elastic across worker loss and growth."""

__version__ = "0.1.0"
