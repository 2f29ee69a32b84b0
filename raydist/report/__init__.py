"""`raydist report RUN_DIR`: a run in pictures (report.png) and one self-contained page (report.html).

    from raydist.report import build_report
    paths = build_report("runs/my-run")            # -> {"png": ".../report/report.png", "html": ...}

Panels: loss and validation loss by step; tokens/s and MFU over time; peak memory per rank; the measured
pipeline timeline; world size with restarts, resizes and checkpoints on the time axis; the goodput
summary. Needs matplotlib (the `report` extra).
"""

from __future__ import annotations

from raydist.report.data import RunData, load_run
from raydist.store.run_store import RunStore, join


def default_out_dir(run_dir: str) -> str:
    return join(run_dir, "report")


def build_report(run_dir: str, out_dir: str | None = None) -> dict[str, str]:
    """Write report.png and report.html for the run at `run_dir` (any fsspec URI) into `out_dir`
    (default RUN_DIR/report); returns their paths."""
    from raydist.report.html import render_html
    from raydist.report.plots import render_overview

    data = load_run(run_dir)
    out_dir = out_dir or default_out_dir(run_dir)
    out = RunStore(out_dir)
    out.makedirs()
    out.write_bytes("report.png", render_overview(data))
    out.write_bytes("report.html", render_html(data).encode("utf-8"))
    return {"png": out.join("report.png"), "html": out.join("report.html")}


__all__ = ["RunData", "build_report", "load_run"]
