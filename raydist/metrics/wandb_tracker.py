"""Weights & Biases as a Tracker (`[tracking] wandb_project`; needs `pip install wandb`, imported only when
configured). Written from the driver like every tracker (raydist.metrics.tracking):

    start   a W&B run in `tracking.wandb_project` (and `wandb_entity`) named after train.run_name, or the
            one RUN_DIR/wandb.json names (a rerun of the same run name resumes it), with the resolved
            config flattened to `section.key` (credentials masked). `wandb_mode = "offline"` writes the run
            under RUN_DIR/wandb/ (under WANDB_DIR when that is set, or on an object-store run directory)
            for a later `wandb sync`. A missing API key, an unreachable server or a bad project name is one
            `error:` line before any worker starts.
    follow  each metrics.jsonl record's numbers (the same keys as MLflow's) and each event as `event.<kind>`
            (how many so far), logged with the training step as the metric `step`: W&B's own step must
            only grow, and a restart logs steps again from its checkpoint;
    end     summary.json's numbers as `summary.<key>` (FINISHED only), `raydist.status` in the summary,
            the events as the run file `events.jsonl`, and the run finished with exit code 0 (FINISHED),
            1 (FAILED) or 130 (KILLED: interrupted).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from raydist.config import Config
from raydist.errors import ConfigError
from raydist.metrics.tracking import Guard, flatten_config, numeric_metrics, summary_numbers
from raydist.store.run_store import RunStore

RECORD = "wandb.json"
EXIT_CODES = {"FINISHED": 0, "FAILED": 1, "KILLED": 130}
STEP = "step"  # the x axis of every raydist metric in W&B


class WandbTracker:
    """The driver's W&B run for one raydist run (see the module doc); a Tracker."""

    def __init__(self, cfg: Config, run_dir: str, run_name: str, log: Callable[[str], None] = print):
        self.cfg, self.run_dir, self.run_name, self.log = cfg, run_dir, run_name, log
        self.project, self.entity, self.mode = (cfg.tracking.wandb_project, cfg.tracking.wandb_entity,
                                                cfg.tracking.wandb_mode)
        self.run = None
        self.event_counts: dict[str, int] = {}
        self.events: list[dict] = []
        self.guard = Guard("W&B", log)

    # ---- start --------------------------------------------------------------------------------
    def start(self) -> None:
        setting = f"tracking.wandb_project={self.project}"
        try:
            import wandb
        except ImportError:
            raise ConfigError(f"{setting} needs wandb: pip install wandb "
                              "(or set tracking.wandb_project=\"\" to turn W&B off)") from None
        store = RunStore(self.run_dir)
        record = store.read_json(RECORD)
        resume = (record["run_id"] if isinstance(record, dict) and record.get("project") == self.project
                  and record.get("entity") == self.entity else None)
        # W&B's files go beside the run's own unless WANDB_DIR says where (W&B needs a local directory)
        directory = store.local_path() if not os.environ.get("WANDB_DIR") else None
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, init_timeout=60)
        try:
            self.run = wandb.init(project=self.project, entity=self.entity or None, name=self.run_name,
                                  id=resume, resume="allow" if resume else None, mode=self.mode, dir=directory,
                                  config=flatten_config(self.cfg), settings=settings, reinit="create_new")
            self.run.define_metric(STEP)
            self.run.define_metric("*", step_metric=STEP)
        except Exception as exc:
            detail = (str(exc).strip().splitlines() or [""])[0][:300]
            raise ConfigError(f"{setting} cannot be used ({type(exc).__name__}: {detail}); run `wandb login` or "
                              "set WANDB_API_KEY on the driver, fix the project or entity, set "
                              "tracking.wandb_mode=\"offline\", or set tracking.wandb_project=\"\"") from None
        store.write_json(RECORD, {"project": self.project, "entity": self.entity, "run_id": self.run.id})
        where = f"offline in {os.path.dirname(self.run.dir)} (upload: wandb sync)" if self.mode == "offline" \
            else self.run.url
        self.log(f"tracking: W&B run {self.run.id} in project {self.project!r}, {where}")

    # ---- follow -------------------------------------------------------------------------------
    def metric(self, record: dict[str, Any]) -> None:
        values = numeric_metrics(record)
        step = int(record.get("step") or 0)
        if values and self.run is not None:
            self.guard(f"step {step}'s metrics", lambda: self.run.log({STEP: step, **values}))

    def event(self, event: dict[str, Any]) -> None:
        kind = str(event.get("kind"))
        self.events.append(event)
        self.event_counts[kind] = self.event_counts.get(kind, 0) + 1
        step = int(event.get("step") or 0)
        count = self.event_counts[kind]
        if self.run is not None:
            self.guard(f"the {kind} event", lambda: self.run.log({STEP: step, f"event.{kind}": count}))

    # ---- end ----------------------------------------------------------------------------------
    def end(self, status: str, summary: dict[str, Any]) -> None:
        if self.run is None:
            return
        numbers = summary_numbers(summary) if status == "FINISHED" else {}
        self.guard("the summary", lambda: self.run.summary.update({**numbers, "raydist.status": status}))
        if self.events:
            text = "".join(json.dumps(e, default=str) + "\n" for e in self.events)
            self.guard("events.jsonl", lambda: _write(os.path.join(self.run.dir, "events.jsonl"), text))
        self.guard("the run's end", lambda: self.run.finish(exit_code=EXIT_CODES[status]))
        self.run = None


def _write(path: str, text: str) -> None:
    """A file in the W&B run's directory: uploaded with the run (by `wandb sync` when offline)."""
    with open(path, "w") as f:
        f.write(text)
