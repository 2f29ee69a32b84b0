"""Parallelisms composed on one N-D device mesh: data (DDP, FSDP2/HSDP), tensor and sequence, context (ring,
Ulysses) and pipeline (`parallelize.py` applies them to a model); the mesh itself (`mesh.py`), the run's resolved
layout (`layout.py`) and the process-group runtime (`runtime.py`)."""
