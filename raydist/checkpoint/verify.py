"""`raydist verify RUN_DIR [--step N] [--json]`: a full check of a run's committed checkpoints.

Loading trusts the commit marker and the file sizes and checks each chunk's checksum as it reads it (only
what a rank reads); this reads every file of every committed checkpoint (or of step N) in full against
COMMIT.json's sizes and checksums. Exit status 0 when all are intact, 1 when one is not, 2 on bad input.
"""

from __future__ import annotations

import json

from raydist.checkpoint import storage
from raydist.checkpoint.storage import join
from raydist.errors import ConfigError
from raydist.store.redact import redact


def verify_run(run_dir: str, step: int | None = None) -> list[dict]:
    """[{step, path, status: ok | partial | corrupt, problem}] for every checkpoint directory (or `step`)."""
    dirs = storage.list_step_dirs(join(run_dir, "checkpoints"))
    if step is not None:
        dirs = [(s, u) for s, u in dirs if s == step]
        if not dirs:
            raise ConfigError(f"{redact(run_dir)} holds no checkpoint step {step}; pick one of "
                              f"{[s for s, _ in storage.list_step_dirs(join(run_dir, 'checkpoints'))]}")
    out = []
    for s, uri in dirs:
        commit = storage.read_commit(uri)
        if commit is None:
            out.append({"step": s, "path": redact(uri), "status": "partial", "problem": "no COMMIT.json"})
            continue
        problem = storage.check_sizes(uri, commit) or storage.check_hashes(uri, commit, sorted(commit["files"]))
        out.append({"step": s, "path": redact(uri), "status": "corrupt" if problem else "ok", "problem": problem})
    return out


def cmd_verify(args) -> int:
    if not storage.list_step_dirs(join(args.run_dir, "checkpoints")) and args.step is None:
        raise ConfigError(f"{redact(args.run_dir)} holds no checkpoints (is it a run directory: "
                          "<checkpoint.storage>/<train.run_name>?)")
    results = verify_run(args.run_dir, args.step)
    if args.json:
        print(json.dumps(results))
    else:
        for r in results:
            print(f"step {r['step']:>8}  {r['status']:<8} {r['path']}" + (f"  ({r['problem']})" if r["problem"] else ""))
    return 0 if all(r["status"] == "ok" for r in results if r["status"] != "partial") else 1


def register_cli(sub) -> None:
    p = sub.add_parser("verify", help="check every file of a run's checkpoints against COMMIT.json")
    p.add_argument("run_dir", help="the run directory (<checkpoint.storage>/<train.run_name>)")
    p.add_argument("--step", type=int, help="only this checkpoint")
    p.add_argument("--json", action="store_true", help="one JSON line")
    p.set_defaults(func=cmd_verify)
