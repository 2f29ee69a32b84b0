"""`raydist status RUN_DIR [--json]`: where a run stands, read from its run directory alone.

Nothing here talks to Ray or to the driver: the answer comes from the files the run writes (any fsspec
URI), so it works from any machine that can read the storage, while the run goes on or long after.

    state       running       a driver holds lease.json and heartbeats it (younger than the stale limit)
                completed     the last `end` event (or summary.json) says completed
                failed        the driver recorded a failure (`end` with status failed), or fatal.json
                interrupted   the driver was stopped (Ctrl-C: `end` with status interrupted), or it
                              vanished without cleaning up (a stale lease, or no end at all)
    step        the newest step reached (progress.json, else the last metrics record) of train.steps
    loss        the last logged training loss (and the last validation loss)
    tokens/s    the last logged throughput; ETA from the last logged step time (running runs only)
    restarts    restarts so far (progress.json)
    checkpoint  the newest committed checkpoint whose files all have their committed sizes
    last error  the newest worker error, hang or driver failure, with its time

A directory that holds none of a run's files is an error (one `error:` line, exit status 2).
"""

from __future__ import annotations

import json
import time
from typing import Any

from raydist.errors import ConfigError
from raydist.metrics.goodput import read_events
from raydist.store.redact import redact
from raydist.store.run_store import RunStore, join

RUN_FILES = ("config.toml", "metrics.jsonl", "events.jsonl", "lease.json", "progress.json", "summary.json")


def _read_config_steps(store: RunStore) -> int | None:
    try:
        text = store.read_text("config.toml")
    except (FileNotFoundError, IsADirectoryError):
        return None
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        return int(tomllib.loads(text).get("train", {}).get("steps"))
    except Exception:
        return None


def newest_checkpoint(run_dir: str) -> dict[str, Any] | None:
    """{step, path, time} of the newest committed checkpoint with every file at its size, or None."""
    from raydist.checkpoint import storage

    for step, uri in reversed(storage.list_step_dirs(join(run_dir, "checkpoints"))):
        commit = storage.read_commit(uri)
        if commit is None or storage.check_sizes(uri, commit) is not None:
            continue
        return {"step": step, "path": redact(uri), "time": commit.get("time")}
    return None


def _lease_state(store: RunStore, now: float) -> tuple[dict | None, bool]:
    from raydist.checkpoint.lease import INTERVAL_S, STALE_FACTOR

    lease = store.read_json("lease.json", "a torn lease counts as none")
    if not isinstance(lease, dict):
        return None, False
    beat = lease.get("heartbeat")
    live = isinstance(beat, (int, float)) and now - beat < STALE_FACTOR * INTERVAL_S
    return lease, live


def _last_error(events: list[dict], fatal: dict | None) -> dict[str, Any] | None:
    """The newest failure-like record: a worker error, a hang, a failed driver, or fatal.json."""
    found = None
    for e in events:
        if e.get("kind") == "worker_error":
            found = {"time": e.get("time"), "step": e.get("step"), "source": f"rank {e.get('rank')}",
                     "message": e.get("error", "")}
        elif e.get("kind") == "hang":
            culprits = ", ".join(f"rank {c.get('rank')} (pid {c.get('pid')} on {c.get('host')})"
                                 for c in e.get("culprits") or []) or "no rank named"
            found = {"time": e.get("time"), "step": e.get("step"), "source": "hang",
                     "message": f"{e.get('trigger', 'hang')}: {culprits}; stacks in {e.get('stacks')}"}
        elif e.get("kind") == "end" and e.get("status") in ("failed", "interrupted") and e.get("error"):
            found = {"time": e.get("time"), "step": e.get("step"), "source": "driver", "message": e["error"]}
    if isinstance(fatal, dict) and (found is None or (fatal.get("time") or 0) >= (found.get("time") or 0)):
        found = {"time": fatal.get("time"), "step": None, "source": f"rank {fatal.get('rank')}",
                 "message": fatal.get("error", "")}
    return found


def run_status(run_dir: str, now: float | None = None) -> dict[str, Any]:
    """What `raydist status` shows, as a dict (the --json output). ConfigError if `run_dir` is not a run."""
    now = time.time() if now is None else now
    run_dir = run_dir.rstrip("/")
    try:
        store = RunStore(run_dir)
        present = [name for name in RUN_FILES if store.exists(name)]
    except Exception as exc:
        raise ConfigError(f"{redact(run_dir)} cannot be read ({type(exc).__name__}: {exc})") from None
    if not present and not store.exists("metrics.jsonl.d") and not store.exists("events.jsonl.d"):
        raise ConfigError(f"{redact(run_dir)} is not a run directory (none of {', '.join(RUN_FILES)} is there); "
                          "pass <checkpoint.storage>/<train.run_name>")
    problems: list[str] = []
    metrics = store.read_records("metrics.jsonl", problems) or []
    events = read_events(run_dir, problems)
    progress = store.read_json("progress.json", "progress is read from metrics.jsonl")
    progress = progress if isinstance(progress, dict) else {}
    summary = store.read_json("summary.json")
    summary = summary if isinstance(summary, dict) else {}
    fatal = store.read_json("fatal.json")
    lease, live = _lease_state(store, now)

    ends = [e for e in events if e.get("kind") == "end"]
    begins = [e for e in events if e.get("kind") in ("launch", "start", "restart")]
    last_end = ends[-1] if ends else None
    ended = last_end is not None and not any((b.get("time") or 0) > (last_end.get("time") or 0) for b in begins)
    if live:
        state = "running"
        detail = f"driver pid {lease.get('pid')} on {lease.get('host')}, lease heartbeat {now - lease['heartbeat']:.0f}s ago"
    elif ended:
        state = last_end.get("status") or "completed"
        detail = {"completed": "the run reached its last step", "failed": "the driver recorded a failure",
                  "interrupted": "the driver was stopped"}.get(state, "")
    elif summary.get("status") == "completed" and not begins:
        state, detail = "completed", "summary.json says completed"
    elif isinstance(fatal, dict):
        state, detail = "failed", "a worker recorded a failure no restart fixes (fatal.json)"
    elif lease is not None:
        beat = lease.get("heartbeat")
        age = f"{now - beat:.0f}s ago" if isinstance(beat, (int, float)) else "never"
        state, detail = "interrupted", (f"the driver (pid {lease.get('pid')} on {lease.get('host')}) stopped "
                                        f"heartbeating its lease {age} without ending the run")
    else:
        state, detail = "interrupted", "no driver holds the run and it never recorded an end"

    trained = [m for m in metrics if m.get("step") is not None]
    last = trained[-1] if trained else {}
    step = max([progress.get("max_step") or 0, last.get("step") or 0, summary.get("steps") or 0])
    if state == "completed" and summary.get("steps"):
        step = summary["steps"]
    steps = _read_config_steps(store)
    with_loss = [m for m in trained if m.get("loss") is not None]
    with_val = [m for m in trained if m.get("val_loss") is not None]
    speed = [m for m in trained if m.get("tokens_per_s")]
    tokens_per_s = speed[-1]["tokens_per_s"] if speed else None
    eta_s = None
    if state == "running" and steps and speed and speed[-1].get("step_time_s"):
        eta_s = round(max(0, steps - step) * speed[-1]["step_time_s"], 3)
    restarts = progress.get("restarts")
    if restarts is None:
        restarts = sum(e.get("kind") == "restart" for e in events)
    out: dict[str, Any] = {
        "run_dir": redact(run_dir), "run_name": run_dir.rsplit("/", 1)[-1], "state": state, "detail": detail,
        "step": step, "steps": steps,
        "loss": with_loss[-1]["loss"] if with_loss else None,
        "val_loss": with_val[-1]["val_loss"] if with_val else None,
        "val_step": with_val[-1]["step"] if with_val else None,
        "tokens_per_s": tokens_per_s, "eta_s": eta_s, "restarts": restarts,
        "world_size": last.get("world_size"),
        "updated_s_ago": round(now - events[-1]["time"], 1) if events and events[-1].get("time") else None,
        "checkpoint": newest_checkpoint(run_dir),
        "last_error": _last_error(events, fatal if isinstance(fatal, dict) else None),
        "lease": {k: lease.get(k) for k in ("pid", "host", "since", "heartbeat")} if lease else None,
    }
    if state == "completed":
        out["final_val_loss"] = summary.get("final_val_loss")
    if problems:
        out["problems"] = problems
    return out


def _num(value: Any, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_status(s: dict[str, Any]) -> str:
    from raydist.driver.console import format_duration, format_rate

    lines = [f"run         {s['run_name']}  ({s['run_dir']})", f"state       {s['state']}  ({s['detail']})"]
    if s["steps"]:
        lines.append(f"step        {s['step']} of {s['steps']}  ({100 * s['step'] / s['steps']:.0f}%)")
    else:
        lines.append(f"step        {s['step']}")
    loss = f"loss        {_num(s['loss'])}"
    if s["val_loss"] is not None:
        loss += f"  (validation {_num(s['val_loss'])} at step {s['val_step']})"
    lines.append(loss)
    lines.append(f"tokens/s    {format_rate(s['tokens_per_s']) if s['tokens_per_s'] else '-'}"
                 + (f"  on {s['world_size']} worker(s)" if s.get("world_size") else ""))
    if s["state"] == "running":
        lines.append(f"ETA         {format_duration(s['eta_s']) if s['eta_s'] is not None else '-'}")
    lines.append(f"restarts    {s['restarts']}")
    ckpt = s["checkpoint"]
    lines.append(f"checkpoint  {'step ' + str(ckpt['step']) + '  (' + ckpt['path'] + ')' if ckpt else 'none committed'}")
    err = s["last_error"]
    if err:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(err["time"])) if err.get("time") else "?"
        lines.append(f"last error  {when} {err['source']}: {err['message']}")
    else:
        lines.append("last error  none")
    for problem in s.get("problems", []):
        lines.append(f"warning: {problem}")
    return "\n".join(lines)


def cmd_status(args) -> int:
    status = run_status(args.run_dir)
    print(json.dumps(status) if args.json else format_status(status))
    return 0


def register_cli(sub) -> None:
    p = sub.add_parser("status", help="where a run stands: state, step, loss, tokens/s, ETA, restarts, checkpoint, "
                                      "last error")
    p.add_argument("run_dir", help="the run directory (<checkpoint.storage>/<train.run_name>; any fsspec URI)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=cmd_status)
