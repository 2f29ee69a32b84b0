"""Experiment tracking: one `Tracker` protocol, written only from the driver.

The driver's Follower (raydist.driver.follow) tails RUN_DIR/metrics.jsonl and events.jsonl and hands each
record to every configured tracker; the launcher builds that list in one place (raydist.driver.launcher:
MLflow with `[tracking] mlflow_uri`, Weights & Biases with `wandb_project` (raydist.metrics.wandb_tracker),
TensorBoard always (raydist.metrics.tensorboard)). Workers need neither the trackers' packages nor a route
to their servers, and restarts, resizes and resumed runs need nothing special. A tracker

    start   before Ray starts: a backend that cannot be reached or is misconfigured raises ConfigError
            (one `error:` line, exit 2, before any worker starts);
    metric  each metrics.jsonl record, in the Follower's thread (never raises);
    event   each events.jsonl event, likewise;
    end     with the run's status (FINISHED, FAILED or KILLED: interrupted) and summary.json's content.

A backend that fails mid-run costs a warning on the console (once per tracker), never the training run.

MLflow (`MlflowTracker`, optional extra: `pip install 'raydist[tracking]'`):

    start   creates the MLflow run in `tracking.mlflow_experiment`, named after train.run_name, or resumes
            the one RUN_DIR/mlflow.json names (a rerun of the same run name), and logs the resolved config
            flattened to `section.key` params (credentials masked).
    follow  every metrics.jsonl record: its numeric fields at its step (loss, val_loss, lr, grad_norm,
            tokens_per_s, step_time_s, data_wait_s, mfu, mem_peak_mb, world_size, tokens, and the
            per-rank step-time percentiles' spread); every events.jsonl event: a metric `event.<kind>`
            (how many so far) at its step and a tag `raydist.last_event`;
    end     summary.json's numbers as `summary.<key>`, the events as an artifact `events.jsonl`, and the
            run's status: FINISHED, FAILED, or KILLED (interrupted).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Protocol

from raydist.config import Config
from raydist.errors import ConfigError
from raydist.store.redact import redact, redact_tree
from raydist.store.run_store import RunStore

METRICS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "data_wait_s", "mfu",
           "mem_peak_mb", "world_size", "tokens")
RECORD = "mlflow.json"


class Tracker(Protocol):
    """Where a run's metrics and events go besides the run directory (see the module doc)."""

    def start(self) -> None:
        """Before Ray starts: ConfigError when the backend cannot be reached or is misconfigured."""

    def metric(self, record: dict[str, Any]) -> None:
        """One metrics.jsonl record (the Follower's thread; never raises)."""

    def event(self, event: dict[str, Any]) -> None:
        """One events.jsonl event (the Follower's thread; never raises)."""

    def end(self, status: str, summary: dict[str, Any]) -> None:
        """The run is over: status FINISHED, FAILED or KILLED; summary is summary.json's content ({} when none)."""


class Guard:
    """Runs a tracker's logging call; the first failure is one warning line, later ones are silent."""

    def __init__(self, backend: str, log: Callable[[str], None]):
        self.backend, self.log = backend, log
        self.failed = False

    def __call__(self, what: str, call: Callable[[], Any]) -> None:
        try:
            call()
        except Exception as exc:
            if not self.failed:
                self.failed = True
                self.log(f"warning: tracking: could not log {what} to {self.backend} ({type(exc).__name__}: "
                         f"{(str(exc).splitlines() or [''])[0][:200]}); training goes on, retrying with later records")


def start_all(trackers: list[Tracker], log: Callable[[str], None]) -> list[Tracker]:
    """Starts each tracker in order; when one cannot start, the ones already started end FAILED and its
    ConfigError is raised."""
    for i, tracker in enumerate(trackers):
        try:
            tracker.start()
        except BaseException:
            end_all(trackers[:i], "FAILED", {}, log)
            raise
    return trackers


def end_all(trackers: list[Tracker], status: str, summary: dict[str, Any], log: Callable[[str], None]) -> None:
    """Ends every tracker; one that raises costs a warning line, never the others or the run's outcome."""
    for tracker in trackers:
        try:
            tracker.end(status, summary)
        except Exception as exc:
            log(f"warning: tracking: {type(tracker).__name__} could not end the run ({type(exc).__name__}: "
                f"{(str(exc).splitlines() or [''])[0][:200]})")


def numeric_metrics(record: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record's numbers the trackers log: METRICS and `ranks.busy_spread`."""
    out = {key: float(record[key]) for key in METRICS
           if isinstance(record.get(key), (int, float)) and not isinstance(record.get(key), bool)}
    spread = (record.get("ranks") or {}).get("busy_spread")
    if isinstance(spread, (int, float)) and not isinstance(spread, bool):
        out["ranks.busy_spread"] = float(spread)
    return out


def summary_numbers(summary: dict[str, Any]) -> dict[str, float]:
    """summary.json's numbers as `summary.<key>`."""
    return {f"summary.{k}": float(v) for k, v in summary.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def flatten_config(cfg: Config) -> dict[str, str]:
    """{"model.num_layers": "4", ...}: every key of the resolved config, credentials masked."""
    out = {}
    for section, values in redact_tree(cfg.to_dict()).items():
        for key, value in values.items():
            out[f"{section}.{key}"] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return out


class MlflowTracker:
    """The driver's MLflow run for one raydist run (see the module doc); a Tracker."""

    def __init__(self, cfg: Config, run_dir: str, run_name: str, log: Callable[[str], None] = print):
        self.cfg, self.run_dir, self.run_name, self.log = cfg, run_dir, run_name, log
        self.uri = cfg.tracking.mlflow_uri
        self.run_id: str | None = None
        self.client = None
        self.event_counts: dict[str, int] = {}
        self.events: list[dict] = []
        self.guard = Guard("MLflow", log)

    # ---- start --------------------------------------------------------------------------------
    def start(self) -> None:
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ConfigError(f"tracking.mlflow_uri={redact(self.uri)} needs mlflow: pip install 'raydist[tracking]' "
                              "(or set tracking.mlflow_uri=\"\" to turn tracking off)") from None
        # the driver's requests: a short timeout and few retries, so an unreachable server is said at once
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
        try:
            self.client = MlflowClient(tracking_uri=self.uri)
            experiment = self.client.get_experiment_by_name(self.cfg.tracking.mlflow_experiment)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(self.cfg.tracking.mlflow_experiment))
            self.run_id = self._resume(experiment_id)
            if self.run_id is None:
                run = self.client.create_run(experiment_id, run_name=self.run_name,
                                             tags={"raydist.run_dir": redact(self.run_dir)})
                self.run_id = run.info.run_id
                RunStore(self.run_dir).write_json(RECORD, {"tracking_uri": redact(self.uri), "run_id": self.run_id,
                                                           "experiment_id": experiment_id})
            logged = self.client.get_run(self.run_id).data.params
            params = [Param(k, v[:6000]) for k, v in flatten_config(self.cfg).items() if k not in logged]
            for i in range(0, len(params), 100):  # MLflow's batch limit
                self.client.log_batch(self.run_id, params=params[i:i + 100])
        except ConfigError:
            raise
        except Exception as exc:
            detail = (str(exc).strip().splitlines() or [""])[0][:300]
            raise ConfigError(redact(f"tracking.mlflow_uri={self.uri} cannot be used ({type(exc).__name__}: {detail}); "
                                     "start the tracking server, fix the URI, or set tracking.mlflow_uri=\"\""
                                     )) from None
        self.log(f"tracking: MLflow run {self.run_id} in experiment {self.cfg.tracking.mlflow_experiment!r} at "
                 f"{redact(self.uri)}")

    def _resume(self, experiment_id: str) -> str | None:
        """The run RUN_DIR/mlflow.json names, if it is on this server and in this experiment."""
        record = RunStore(self.run_dir).read_json(RECORD)
        if not isinstance(record, dict) or record.get("tracking_uri") != redact(self.uri):
            return None
        try:
            run = self.client.get_run(record["run_id"])
        except Exception:
            return None
        if run.info.experiment_id != experiment_id:
            return None
        self.client.update_run(run.info.run_id, status="RUNNING")
        return run.info.run_id

    # ---- follow -------------------------------------------------------------------------------
    def metric(self, rec: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step = int(rec.get("step") or 0)
        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in numeric_metrics(rec).items()]
        if metrics:
            self.guard(f"step {step}'s metrics", lambda: self.client.log_batch(self.run_id, metrics=metrics))

    def event(self, ev: dict[str, Any]) -> None:
        from mlflow.entities import Metric, RunTag

        kind = str(ev.get("kind"))
        self.events.append(ev)
        self.event_counts[kind] = self.event_counts.get(kind, 0) + 1
        step = int(ev.get("step") or 0)
        self.guard(f"the {kind} event", lambda: self.client.log_batch(
            self.run_id, metrics=[Metric(f"event.{kind}", self.event_counts[kind], int(time.time() * 1000), step)],
            tags=[RunTag("raydist.last_event", json.dumps(ev, default=str)[:5000])]))

    # ---- end ----------------------------------------------------------------------------------
    def end(self, status: str, summary: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        if self.run_id is None:
            return
        if status == "FINISHED" and summary:
            now = int(time.time() * 1000)
            step = int(summary.get("steps") or 0)
            metrics = [Metric(key, value, now, step) for key, value in summary_numbers(summary).items()]
            self.guard("the summary", lambda: self.client.log_batch(self.run_id, metrics=metrics))
        if self.events:
            text = "".join(json.dumps(e, default=str) + "\n" for e in self.events)
            self.guard("events.jsonl", lambda: self.client.log_text(self.run_id, text, "events.jsonl"))
        self.guard("the run's end", lambda: self.client.set_terminated(self.run_id, status))

