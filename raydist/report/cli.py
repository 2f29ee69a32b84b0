"""`raydist report RUN_DIR [--out DIR]`: report.png and a self-contained report.html for a run."""

from __future__ import annotations

from raydist.errors import ConfigError


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("report", help="plot a run: loss, tokens/s, MFU, memory, pipeline, restarts, goodput")
    p.add_argument("run_dir", help="run directory (local path or fsspec URI): <checkpoint.storage>/<run_name>")
    p.add_argument("--out", help="where report.png and report.html go (default: RUN_DIR/report)")
    p.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("raydist report needs matplotlib: pip install 'raydist[report]'") from None
    from raydist.report import build_report

    paths = build_report(args.run_dir, args.out)
    print(f"wrote {paths['png']}")
    print(f"wrote {paths['html']}")
    return 0
