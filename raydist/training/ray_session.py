"""The Session on Ray Train V2, and the function each Ray Train worker runs.

Ray Train owns the worker lifecycle: it starts the group (TorchTrainer has already initialised the
process group when `ray_worker_entry` starts), restarts it after a failure and resizes elastic runs. What
raydist adds here:
- `ray.train.report` is a barrier over all workers, so a worker that fits no layout (idle) must report
  exactly when the active ones do: rank 0 publishes each report in the process group's key-value store and
  idle workers follow (`control.ControlChannel`), giving up if rank 0's heartbeat stops;
- committed checkpoints are reported to Ray Train (no upload: they already are on the run's storage);
- a step watchdog ends a worker whose training stops making progress (`control.Watchdog`), so a hang no
  collective notices becomes a failure Ray Train restarts; after warm-up its limit for a step, and the
  monitor's for a collective, are derived from measured steps (`step_limits`, raydist.elastic.hang.timeouts);
- where collectives never raise in Python (NCCL, the strict-collectives mode), the hang monitor watches this
  rank's in-flight collectives (raydist.elastic.inflight) and, when one has waited longer than
  `elastic.collective_timeout_s`, diagnoses and ends the worker, before the group's own (later) timeout
  aborts it without a word (`hang.trigger.group_timeout_s`, given to the groups by the launcher and the Trainer);
- `launch` and `worker_error` lines in events.jsonl (restart timing, the first error each worker saw);
- hang diagnosis (`raydist.elastic.hang`): every rank publishes what it is doing; when a collective times out or
  the watchdog fires, the rank names the ranks that never arrived, writes every live rank's stack to
  RUN_DIR/logs/hang-<time>-rank<r>/ and a `hang` event, then fails so that Ray Train restarts the run. The
  diagnosis is bounded (hang.trigger.DIAGNOSE_BUDGET_S) whatever the rendezvous store does: its server lives in
  rank 0's process, which may be the stopped one.

With `elastic.live_recovery` each replica is a Ray Train replica group of dp_shard x cp x tp x pp workers
whose own process group is its world (raydist.elastic.replica_groups), and joins the others through torchft
(raydist.elastic.live).
Commits are then not reported to Ray Train: `ray.train.report` waits for every worker, so a survivor would
block on it while a replica is being replaced. raydist's own checkpoints on storage are what a whole-group
restart resumes from; Ray Train's checkpoint record is not used.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from raydist import strict
from raydist.config import Config, RunFacts
from raydist.elastic import failures, warm
from raydist.elastic import inflight
from raydist.elastic.control import ControlChannel, Watchdog
from raydist.elastic.hang.diagnosis import HangMonitor
from raydist.elastic.hang.heartbeat import track_collectives
from raydist.elastic.hang.trigger import is_hang, watched
from raydist.elastic.session import Idle, Session, bind_when_all_train, layout_through_store
from raydist.metrics.actions import ACTIONS
from raydist.metrics.goodput import EventLog, Goodput
from raydist.parallel.layout import Layout


class RaySession(Session):
    def __init__(self, cfg: Config, run_dir: str, start_time: float, heartbeat_interval_s: float = 1.0):
        self.cfg, self.run_dir, self.start_time = cfg, run_dir, start_time
        self.live = cfg.elastic.live_recovery
        self.identity = live_identity(cfg) if self.live else None  # this worker's replica and rank in it
        self.replica = self.identity.replica if self.live else None
        self.rank = dist.get_rank()
        self.channel = ControlChannel(dist.distributed_c10d._get_default_store(), self.rank)
        self._diagnosis_lock = threading.Lock()
        self._diagnosed = threading.Event()  # set when this worker's diagnosis is over
        e = cfg.elastic
        step_s = 2 * e.collective_timeout_s
        self.limits = {"start": e.startup_timeout_s, "resume": e.startup_timeout_s,
                       "first_step": e.startup_timeout_s, "step": step_s,
                       "evaluate": step_s * max(1, cfg.train.eval_batches), "save": e.checkpoint_timeout_s,
                       "report": step_s}
        self.fixed_step_s = step_s  # the step phase's limit without derived ones (step_limits)
        self.monitor: HangMonitor | None = None
        try:  # what each rank is doing, published for hang diagnosis (never a reason to fail training;
            # live recovery's replicas meet only through torchft: not monitored)
            if self.live:
                raise RuntimeError("not with live recovery")
            track_collectives()
            watch = watch_collectives()
            self.monitor = HangMonitor(self.rank, dist.get_world_size(), run_dir, cfg.monitor.heartbeat_interval_s,
                                       cfg.monitor.hang_stacks, on_hang=self._hang_event, flight=watch,
                                       collective_timeout_s=e.collective_timeout_s if watch else None,
                                       on_stuck=self._collective_stuck).start()
        except Exception as exc:
            if not self.live:
                print(f"warning: rank {self.rank}: hang monitoring is off ({type(exc).__name__}: {exc})", flush=True)
        # from the first moment: construction, planning and resume can hang too
        self.watchdog = Watchdog(self.limits["start"], phase="start", on_hang=self._watchdog_fired).start()
        self.heartbeat_interval_s = heartbeat_interval_s
        self._last_beat = 0.0
        self.timings: dict[str, float | None] = {}  # this worker process's start, the train function's entry
        self._spares_due = 0.0  # time.monotonic() of the next spares top-up (inf: none)
        self._spares_thread = None
        self.driver_node: str | None = None  # the node the driver (and so Ray Train's controller) runs on

    def _fill_spares(self) -> None:
        """Local rank 0 of each node: warm spare processes for the next restart's workers on this node
        (raydist.elastic.warm), asked for off the training thread, and topped up every warm.TOP_UP_S."""
        self._spares_due = math.inf
        if not warm.enabled(self.cfg) or (self._spares_thread is not None and self._spares_thread.is_alive()):
            return
        import threading

        import ray
        import ray.train

        ctx = ray.train.get_context()
        if ctx.get_local_rank() != 0:
            return
        on_driver_node = ray.get_runtime_context().get_node_id() == self.driver_node  # the controller's node
        args = (ctx.get_local_world_size(), warm.CONTROLLER_ACTORS if on_driver_node else 0)

        def ask() -> None:
            if warm.request_spares(*args) is not None:  # (None: it cannot ask, and said so once)
                self._spares_due = time.monotonic() + warm.TOP_UP_S

        self._spares_thread = threading.Thread(target=ask, daemon=True, name="raydist-spares")
        self._spares_thread.start()

    def _diagnose(self, trigger: str, error: BaseException | None = None, stuck: dict | None = None) -> None:
        """Once per worker, whoever asks first (a collective's exception, the monitor, the watchdog); a later
        caller waits for that diagnosis to end (it is bounded) instead of starting another."""
        if self.monitor is None:
            return
        if not self._diagnosis_lock.acquire(blocking=False):
            self._diagnosed.wait(self.monitor.budget_s + 5.0)
            return
        try:
            self.monitor.diagnose(trigger, error, stuck)
        except Exception as exc:  # the diagnosis must never hide the failure itself
            print(f"warning: rank {self.rank}: hang diagnosis failed ({type(exc).__name__}: {exc})", flush=True)
        finally:
            self._diagnosed.set()

    def _hang_event(self, diagnosis: dict) -> None:
        run_event(self.run_dir, self.start_time, "hang", step=ACTIONS.step, rank=self.rank,
                  trigger=diagnosis["trigger"], culprits=diagnosis["culprits"], waiting=diagnosis["waiting"],
                  collective=diagnosis.get("collective"), store_reachable=diagnosis.get("store_reachable"),
                  stacks=diagnosis["stacks"], stacks_written=diagnosis["stacks_written"],
                  **({"incomplete": diagnosis["incomplete"]} if diagnosis.get("incomplete") else {}))

    def _watchdog_fired(self) -> None:
        self._diagnose(f"watchdog: no progress in phase '{self.watchdog.name}' for {self.watchdog.timeout_s:.0f}s")
        self.watchdog._exit()

    def _collective_stuck(self, op: dict) -> None:
        """The monitor saw `op` pending longer than its limit (elastic.collective_timeout_s, or the one derived
        from measured steps: step_limits) (its thread calls this): a
        thread of its own diagnoses and ends the worker, so the monitor keeps beating and answering the
        diagnoser's stack request meanwhile."""
        waited = time.time() - op["since"]
        limit = self.monitor.collective_timeout_s if self.monitor is not None else None
        derived = limit is not None and limit != self.cfg.elastic.collective_timeout_s
        trigger = (f"collective stuck: {inflight.describe_op(op)} pending for {waited:.0f}s "
                   + (f"(limit {limit:.3g}s derived from measured steps, elastic.timeout_factor="
                      f"{self.cfg.elastic.timeout_factor:g})" if derived else
                      f"(elastic.collective_timeout_s={self.cfg.elastic.collective_timeout_s:g})"))
        threading.Thread(target=self._end_stuck, args=(trigger, op), daemon=True, name="raydist-hang").start()

    def _end_stuck(self, trigger: str, op: dict) -> None:
        self.watchdog.stop()
        self._diagnose(trigger, stuck=op)
        run_event(self.run_dir, self.start_time, "worker_error", rank=self.rank, error=trigger[:300],
                  deterministic=False)
        print(f"error: rank {self.rank}: {trigger}; ending this worker so the run restarts", file=sys.stderr,
              flush=True)
        os._exit(Watchdog.EXIT_CODE)

    def share_layout(self, cfg: Config) -> Layout:
        # through the store: the world group may be bound to the GPU only after every rank knows whether
        # any is idle (ray_worker_entry), and NCCL's first collective would connect it unbound
        return layout_through_store(cfg, dist.distributed_c10d._get_default_store(), given=self.given_layout)

    def start(self, cfg: Config) -> Layout | Idle:
        started = super().start(cfg)
        if self.live:  # every worker says which replica (and rank in it) started, and where
            run_event(self.run_dir, self.start_time, "launch", world_size=dist.get_world_size(), replica=self.replica,
                      replica_rank=self.identity.rank, host=socket.gethostname(), pid=os.getpid())
        elif self.rank == 0:  # the attempt's worker group is up (restart timing: detection -> restart -> load)
            run_event(self.run_dir, self.start_time, "launch", world_size=dist.get_world_size(), **self.timings)
        if isinstance(started, Idle):
            self.watchdog.stop()  # an idle worker follows rank 0's heartbeat instead
        return started

    def phase(self, name: str) -> None:
        self.watchdog.phase(name, self.limits[name])
        ACTIONS.enter(name)

    def step_limits(self, limits) -> None:
        """The step phase's derived limits (raydist.elastic.hang.timeouts), or None for the fixed ones: the
        watchdog's limit for the step phase, at once if the worker is in it, and the hang monitor's limit
        for a pending collective."""
        step_s = limits.watchdog_s if limits is not None else self.fixed_step_s
        self.limits["step"] = step_s
        if self.watchdog is not None and self.watchdog.name == "step":
            self.watchdog.timeout_s = step_s
        if self.monitor is not None and self.monitor.collective_timeout_s is not None:
            self.monitor.collective_timeout_s = (limits.collective_s if limits is not None
                                                 else self.cfg.elastic.collective_timeout_s)

    def heartbeat(self, step: int) -> None:
        if self.watchdog is not None:
            self.watchdog.beat()
        now = time.monotonic()
        if now >= self._spares_due:  # from the first step on: the spares' imports do not slow this start
            self._fill_spares()
        if now - self._last_beat >= self.heartbeat_interval_s:  # a store write: not every step
            self.channel.heartbeat(step)
            self._last_beat = now

    def commit(self, step: int, uri: str, metrics: dict) -> None:
        import ray.train
        from ray.train import Checkpoint
        from ray.train.v2.api.report_config import CheckpointUploadMode

        if self.live:  # no barrier over the replicas on the step path (see the module docstring)
            return
        previous = (self.watchdog.name, self.watchdog.timeout_s)
        self.phase("report")  # a barrier over every worker: bounded by the watchdog
        self.channel.publish({"kind": "report", "metrics": metrics, "checkpoint": uri})
        checkpoint = Checkpoint(uri) if uri and self.rank == 0 else None
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
        self.watchdog.phase(*previous)

    def fail(self, error: BaseException) -> None:
        self.watchdog.stop()
        if is_hang(error):  # a peer never arrived: name it, write the stacks, then fail
            self._diagnose(f"collective timeout: {failures.first_line(error)[:200]}", error)
        deterministic = failures.is_deterministic(error)
        run_event(self.run_dir, self.start_time, "worker_error", rank=self.rank, error=str(error).strip()[:300],
                  deterministic=deterministic)
        if deterministic:  # the next attempt ends the run at once instead of failing the same way
            failures.record(self.run_dir, error, self.rank)

    def finish(self, summary: dict) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.monitor is not None:
            self.monitor.stop()
        self.channel.publish({"kind": "done"})

    def follow(self) -> None:
        """An idle worker: report whenever the active workers do, until they are done."""
        import ray.train

        ACTIONS.enter("idle")  # (hang diagnosis leaves idle workers out)
        self._fill_spares()
        self.channel.follow(lambda m: ray.train.report(m["metrics"], checkpoint=None),
                            self.cfg.elastic.collective_timeout_s)


def watch_collectives() -> bool:
    """Whether the monitor watches this worker's in-flight collectives (hang.trigger.watched): on NCCL, and under the
    strict-collectives mode, whose flight record it then reads (registered here, before the first beat; only
    where the groups are strict ones: on a GPU run the mode is off and NCCL's recorder is read)."""
    backend = str(dist.get_backend())
    if strict.BACKEND in backend:
        source = inflight.strict_source()
        if source is None:
            print(f"warning: rank {dist.get_rank()}: the strict mode's flight record (raydist.strict.flight) is "
                  "missing: stuck collectives are not watched", flush=True)
            return False
        inflight.register_flight_source("strict", source)
    return watched(backend)


def ray_worker_entry(payload: dict[str, Any]) -> None:
    """What each Ray Train worker runs; the process group is already initialised by TorchTrainer."""
    entered = time.time()  # (with the process's start: where a restart's time goes, in the `launch` event)
    import ray.train

    from raydist.training.loop import fit
    from raydist.training.trainer import Trainer, TrainerOptions

    from raydist.elastic.diloco import replica_manager
    from raydist.elastic.live import TorchftReplicas

    cfg = Config.from_dict(payload["config"])  # the user's, as given
    facts = RunFacts.from_dict(payload["facts"])  # what the driver resolved: run directory, data path
    live = cfg.elastic.live_recovery  # (then this worker is in one replica, whose layout the driver sent)
    # (live recovery: Ray's train context numbers a replacement replica's workers for groups of one)
    local_rank = live_identity(cfg).local_rank if live else ray.train.get_context().get_local_rank()
    threads = max(1, int(cfg.ray.cpus_per_worker))
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    device = torch.device("cuda", local_rank) if payload["use_gpu"] else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    fatal = failures.recorded(facts.run_dir, payload["start_time"])
    if fatal is not None:  # an earlier attempt failed in a way no restart fixes: end here, the driver says why
        print(f"worker {dist.get_rank()}: not training: {fatal['error']}", flush=True)
        return
    session = RaySession(cfg, facts.run_dir, payload["start_time"])
    session.given_layout = payload.get("layout")  # the driver's, for the world size it planned it for
    session.timings = {"process_started": process_start_time(), "entered": entered, "preloaded": warm.preloaded_at}
    session.driver_node = payload.get("driver_node")
    try:
        started = session.start(cfg)
        bind_when_all_train(started, device)  # (not with idle workers: they build no mesh to split)
        if isinstance(started, Idle):
            print(f"worker {dist.get_rank()} is idle: {started.reason}", flush=True)
            session.follow()
            return
        trainer = Trainer(cfg, device, started, TrainerOptions(start_time=payload["start_time"], defer_init=True,
                                                               record_samples=payload.get("record_samples", False),
                                                               data_path=facts.data_path))
        if live:  # after the trainer is built: the quorum waits for a replica only once it can step
            me = session.identity
            trainer.replicas = replica_manager(
                TorchftReplicas(me.replica, device, cfg.elastic.collective_timeout_s, trainer.state_parts,
                                replicas=me.replicas, rank=me.rank, workers=me.size), trainer)
        try:
            fit(trainer, facts.run_dir, session)
        finally:
            if trainer.replicas is not None:
                trainer.replicas.shutdown()
    except BaseException as exc:  # a peer died, a collective timed out, bad input...: say so before Ray Train
        session.fail(exc)         # restarts (and whether a restart can help)
        raise


def live_identity(cfg: Config):
    """Live recovery: this worker's replica and rank in it (raydist.elastic.live.replica_identity)."""
    from raydist.elastic.live import replica_identity, workers_per_replica

    return replica_identity(workers_per_replica(cfg))


def process_start_time() -> float | None:
    """When this process started (wall time, 10 ms resolution), from /proc; None where there is none."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime: clock ticks since boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])  # seconds since boot, same clock
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def run_event(run_dir: str, driver_start: float, kind: str, step: int | None = None, **fields: Any) -> None:
    """One events.jsonl line from outside `fit` (any rank; local storage appends atomically per line)."""
    try:
        EventLog(run_dir, Goodput(run_dir, driver_start).run_start).event(kind, step, **fields)
    except Exception:  # bookkeeping must never mask the real failure
        pass
