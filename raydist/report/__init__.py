"""`raydist report RUN_DIR`: a run in pictures (report.png) and one self-contained page (report.html).

    from raydist.report import build_report
    paths = build_report("runs/my-run")            # -> {"png": ".../report/report.png", "html": ...}

Panels: loss and validation loss by step; tokens/s and MFU over time; peak memory per rank; the measured
pipeline timeline; world size with restarts, resizes and checkpoints on the time axis; the goodput
summary. Needs matplotlib (the `report` extra).
"""

from __future__ import annotations

import fsspec

from raydist.report.data import RunData, join, load_run
from raydist.store.atomic import write_bytes_atomic


def default_out_dir(run_dir: str) -> str:
    return join(run_dir, "report")


def build_report(run_dir: str, out_dir: str | None = None) -> dict[str, str]:
    """Write report.png and report.html for the run at `run_dir` (any fsspec URI) into `out_dir`
    (default RUN_DIR/report); returns their paths."""
    from raydist.report.html import render_html
    from raydist.report.plots import render_overview

    data = load_run(run_dir)
    out_dir = out_dir or default_out_dir(run_dir)
    fs, root = fsspec.core.url_to_fs(out_dir)
    fs.makedirs(root, exist_ok=True)
    png_path, html_path = join(out_dir, "report.png"), join(out_dir, "report.html")
    write_bytes_atomic(png_path, render_overview(data))
    write_bytes_atomic(html_path, render_html(data).encode("utf-8"))
    return {"png": png_path, "html": html_path}


__all__ = ["RunData", "build_report", "load_run"]
