"""Run-directory storage: `RunStore(uri)` for every file of a run directory (run_store.py), whole-file writes
that a crash cannot tear (atomic.py), and URIs without their credentials (redact.py)."""
