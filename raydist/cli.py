"""`raydist` command line: train, status, data prepare, schedule, plan, report, verify, eval, export, generate.

Bad input exits with status 2 and one line `error: ...` on stderr; a failed run exits 1. Error lines are
redacted (no credentials of a storage URI are printed).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from raydist.config import DEFAULT_WORKLOAD, Config, ConfigError
from raydist.errors import DataError
from raydist.store.redact import redact


def _default_config_path() -> str | None:
    """workloads/gpt_tiny.toml from the working directory; None means the built-in defaults, which are
    the same workload (tests/unit/test_config.py keeps them equal)."""
    path = Path("workloads") / DEFAULT_WORKLOAD
    return str(path) if path.is_file() else None


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value (repeatable), e.g. --set train.steps=50")


def cmd_train(args) -> int:
    from raydist.driver.launcher import launch

    from raydist.driver.console import Console

    cfg = Config.load(args.config or _default_config_path(), args.overrides)
    launch(cfg, address=args.address, console=Console(verbose=args.verbose))
    return 0


def cmd_data_prepare(args) -> int:
    from raydist.data.prepare import default_data_path, prepare

    overrides = list(args.overrides)
    if args.corpus:
        overrides.append(f"data.corpus={args.corpus}")
    if args.seq_len:
        overrides.append(f"data.seq_len={args.seq_len}")
    if args.tokenizer:
        overrides.append(f"data.tokenizer={args.tokenizer}")
    cfg = Config.load(args.config, overrides)
    out = args.out or cfg.data.path or default_data_path(cfg.data)
    prepare(cfg.data, out, log=print)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raydist", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a workload on Ray (embedded local Ray unless an address is given)")
    train.add_argument("config", nargs="?", help=f"TOML config (default: workloads/{DEFAULT_WORKLOAD})")
    train.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else an embedded local Ray)")
    train.add_argument("--verbose", "-v", action="store_true",
                       help="show Ray's own driver and worker output on the console (default: RUN_DIR/logs/)")
    _add_set(train)
    train.set_defaults(func=cmd_train)

    data = sub.add_parser("data", help="dataset tools")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser("prepare", help="tokenize a corpus into packed parquet shards + manifest")
    prep.add_argument("--config", help="take [data] settings from this TOML")
    prep.add_argument("--corpus", help="'stdlib', a text file/dir/glob/URI, or parquet files with a text column")
    prep.add_argument("--out", help="output directory or fsspec URI (default: data.path or the cache)")
    prep.add_argument("--seq-len", type=int, help="tokens per sample")
    prep.add_argument("--tokenizer", help="'byte', a tokenizers JSON file, or hf:DIR (a model directory's tokenizer.json)")
    _add_set(prep)
    prep.set_defaults(func=cmd_data_prepare)

    for register in _optional_commands():
        register(sub)
    return parser


def _optional_commands():
    """Subcommands that live with their subsystem (each module has `register_cli(subparsers)`)."""
    import importlib

    for module in ("raydist.schedule.cli", "raydist.planner.cli", "raydist.report.cli", "raydist.checkpoint.verify",
                   "raydist.inference.evaluate", "raydist.inference.export", "raydist.inference.generate",
                   "raydist.driver.status"):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and module.startswith(exc.name):
                continue
            raise
        yield mod.register_cli


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, DataError) as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get("RAYDIST_TRACEBACK"):
            raise
        failure = _training_failure(exc)
        if failure is not None:
            print(f"error: {redact(str(failure))}", file=sys.stderr)
            return 2 if isinstance(failure, (ConfigError, DataError)) else 1
        raise


def _training_failure(exc: BaseException):
    from raydist.elastic.failures import training_failure

    return training_failure(exc)


if __name__ == "__main__":
    sys.exit(main())
