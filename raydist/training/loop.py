"""The per-worker loop around `Trainer`: resume, train, evaluate, log, checkpoint, report.

    resume from the newest valid checkpoint in RUN_DIR/checkpoints (if any), straight into the shards;
        otherwise the keyed random init (a Trainer built with `defer_init` has not drawn it yet)
    step 0: untrained validation loss and first-batch loss
    steps: train; evaluate every eval_every; log every log_every; checkpoint every checkpoint.every_steps
    end: final checkpoint, summary.json (with goodput across restarts)

`fit` talks to whatever runs the workers through a `Session` (raydist.elastic.session): Ray Train
(`elastic.ray_session.ray_worker_entry`) or plain processes (`LocalSession`, the tests); it imports no Ray.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from raydist import strict
from raydist.checkpoint import CheckpointManager, compat
from raydist.checkpoint.manager import read_extra
from raydist.elastic.hang.timeouts import StepTimeouts, training_groups
from raydist.elastic.session import LocalSession, Session
from raydist.metrics.background import BackgroundWriter
from raydist.metrics.flops import run_peak_flops
from raydist.metrics.goodput import EventLog, Goodput
from raydist.metrics.logger import MetricsWriter, clean
from raydist.metrics.stragglers import StragglerDetector, per_rank, percentiles
from raydist.models.gpt import flops_per_token
from raydist.store.run_store import RunStore, join
from raydist.strict.audit import marking_host_tensors
from raydist.training.trainer import StepStats, Trainer, peak_memory_mb

# ---- logging ------------------------------------------------------------------------------------


class RunLogger:
    """Rank 0 writes metrics.jsonl; every rank keeps the interval's timings."""

    def __init__(self, trainer: Trainer, run_dir: str | None, run_start: float, attempt: int,
                 background=None, events: EventLog | None = None, workers: list[dict] | None = None,
                 timeouts: StepTimeouts | None = None):
        self.trainer = trainer
        self.timeouts = timeouts  # derived from the gathered step times (raydist.elastic.hang.timeouts)
        self.events, self.workers = events, workers or []
        self.rank0 = dist.get_rank() == 0
        self.writer = MetricsWriter(run_dir, background=background) if run_dir and self.rank0 else None
        cfg = trainer.cfg
        self.run_start = run_start
        self.attempt = attempt
        self.tokens_per_step = trainer.layout.global_batch * cfg.data.seq_len
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        # the device's peak FLOP/s for MFU (none on CPU: raydist.metrics.flops says why)
        self.peak_flops, self.peak_source = run_peak_flops(trainer.device)
        self.interval_time = self.interval_wait = 0.0
        self.interval_steps = 0
        self.step_times: list[float] = []  # this rank's step and busy times of the interval (stragglers)
        self.busy_steps: list[StepStats] = []
        per_stage = max(1, trainer.world_size // trainer.layout.pp)  # pp is the outermost mesh axis
        self.stragglers = StragglerDetector(
            cfg.monitor.straggler_factor, cfg.monitor.straggler_intervals,
            [list(range(s * per_stage, (s + 1) * per_stage)) for s in range(trainer.layout.pp)])
        self.last: dict[str, Any] = {}
        self.gate: Callable[[], bool] = lambda: True  # live recovery: only the quorum's rank 0 writes
        self._sent_at_record = 0  # the replica manager's sent_bytes at the last record

    def base(self) -> dict[str, Any]:
        t = self.trainer
        return {"step": t.step, "world_size": t.world_size, "mesh": t.layout.mesh(),
                "elapsed_s": round(time.time() - self.run_start, 3), "attempt": self.attempt,
                "kernels": t.kernels_ran(), "kernels_selected": t.kernels}

    def add_step(self, stats: StepStats) -> None:
        self.interval_time += stats.step_time_s
        self.interval_wait += stats.data_wait_s
        self.interval_steps += 1
        self.step_times.append(stats.step_time_s)
        self.busy_steps.append(stats)  # busy_s is read at the record (on CUDA it reads events)

    def _ranks(self, rec: dict) -> None:
        """Per-rank step and busy time percentiles of the interval (a collective over the active ranks), and
        on rank 0 the straggler rule (raydist.metrics.stragglers); every rank's longest step of the interval
        goes to the derived timeouts (the same list on every rank, so every rank derives the same limits)."""
        mine = {"step_time_s": percentiles(self.step_times), "busy_s": percentiles([s.busy_s for s in self.busy_steps]),
                "longest_step_s": self.timeouts.take() if self.timeouts is not None else None}
        self.step_times, self.busy_steps = [], []
        gathered: list = [mine]
        if self.trainer.world_size > 1:
            gathered = [None] * self.trainer.world_size
            dist.all_gather_object(gathered, mine, group=self.trainer.group)
        self._timeouts(rec, [g["longest_step_s"] for g in gathered])
        if not self.rank0 or self.trainer.world_size == 1:
            return
        rec["ranks"] = per_rank(gathered)
        for found in self.stragglers.update(rec["ranks"]["busy_s"]["p50"]):
            where = self.workers[found["rank"]] if found["rank"] < len(self.workers) else {}
            if self.events is not None:
                self.events.event("straggler", self.trainer.step, host=where.get("host"), pid=where.get("pid"),
                                  factor=self.trainer.cfg.monitor.straggler_factor, **found)

    def _timeouts(self, rec: dict, longest: list[float | None]) -> None:
        """Every rank: the derived limits (applied there when they move); rank 0: `timeouts` in the record and
        a `timeouts` event when they moved."""
        if self.timeouts is None:
            return
        moved = self.timeouts.update(self.trainer.step, longest)
        if not self.rank0 or self.timeouts.derived is None:
            return
        rec["timeouts"] = self.timeouts.record()
        if moved is not None and self.events is not None:
            e = self.trainer.cfg.elastic
            self.events.event("timeouts", self.trainer.step, **moved.to_dict(), factor=e.timeout_factor,
                              floor_s=e.timeout_floor_s, ceiling_s=e.collective_timeout_s)

    def record(self, stats: StepStats | None, val_loss: float | None = None, loss: float | None = None) -> dict:
        rec = self.base()
        if stats is not None:
            # Settling reads the steps since the last record (losses, norms, pipeline times: the only host
            # waits of those steps); the wait for the device's queued work belongs to those steps' time.
            settle_start = time.perf_counter()
            stats.loss
            self.interval_time += time.perf_counter() - settle_start
            steps = max(self.interval_steps, 1)
            tokens_per_s = self.tokens_per_step * self.interval_steps / max(self.interval_time, 1e-9)
            # (live recovery: the step's replicas share the work, each over its own world of world_size workers)
            achieved = tokens_per_s * self.flops_per_token / ((stats.replicas or 1) * self.trainer.world_size)
            rec.update(loss=stats.loss, lr=stats.lr, grad_norm=stats.grad_norm, tokens_per_s=round(tokens_per_s, 2),
                       step_time_s=round(self.interval_time / steps, 5),
                       data_wait_s=round(self.interval_wait / steps, 5),
                       mfu=round(achieved / self.peak_flops, 5) if self.peak_flops else None,
                       mfu_peak_source=self.peak_source,
                       tokens=self.trainer.step * self.tokens_per_step,
                       mem_peak_mb=round(peak_memory_mb(self.trainer.device), 1))
            rec.update(self.trainer.moe_metrics())
            if stats.pipeline is not None:
                rec["pipeline"] = stats.pipeline
            self._ranks(rec)
            self.interval_time = self.interval_wait = 0.0
            self.interval_steps = 0
        else:
            rec.update(loss=loss, tokens_per_s=0.0, tokens=self.trainer.step * self.tokens_per_step)
        if val_loss is not None:
            rec["val_loss"] = val_loss
        if getattr(stats, "replicas", None) is not None:
            rec["replicas"] = stats.replicas
            # what this rank sent to the other replicas per step since the last record (every step's
            # gradients, or a DiLoCo window's outer gradient at its end: raydist.elastic.diloco)
            sent = self.trainer.replicas.sent_bytes
            rec["replica_bytes_per_step"] = round((sent - self._sent_at_record) / max(steps, 1))
            self._sent_at_record = sent
        if self.writer is not None and self.gate():
            self.writer.write(rec)
        self.last = rec
        if "loss" in rec:  # (checkpointed: an attempt that resumes at the last step reports it too)
            self.trainer.notes["last_loss"] = rec["loss"]
        return rec


# ---- the loop -------------------------------------------------------------------------------------


class _Checkpoints:
    """Saving on schedule, agreeing on what is committed, and telling the session and the event log."""

    def __init__(self, trainer: Trainer, run_dir: str, events: EventLog | None, goodput: Goodput | None,
                 session: Session, log: Callable[[str], None]):
        self.trainer, self.events, self.goodput, self.session = trainer, events, goodput, session
        self.manager = CheckpointManager(run_dir, trainer.cfg.checkpoint.keep, trainer.checkpoint_group, log=log,
                                         timeout_s=trainer.cfg.elastic.checkpoint_timeout_s)
        self.reported = -1

    def resume(self) -> dict | None:
        """Loads the newest valid checkpoint into the trainer; returns its parts' JSON state (or None)."""
        newest = self.manager.latest()
        if newest is None:
            return None
        saved = (read_extra(newest.uri).get("run") or {}).get("compat")
        if saved:  # the driver checked too; this catches a checkpoint committed since
            problems = compat.differences(saved, compat.compat_record(self.trainer.cfg, self.trainer.manifest))
            if problems:
                raise compat.refuse(self.manager.root.rsplit("/checkpoints", 1)[0], newest.step, problems)
        found, state = self.manager.load_newest(self.trainer.checkpoint_parts())
        if found is None:
            return None
        for message in found.skipped:
            if self.events:
                self.events.event("checkpoint_skipped", found.step, reason=message)
        self.reported = found.step
        return state

    def save(self, blocking: bool) -> float:
        """Saves the trainer's state at its step; returns the seconds training stalled (goodput's checkpoint
        time)."""
        stall = self.manager.save(self.trainer.step, self.trainer.checkpoint_parts(), blocking=blocking)
        if self.goodput:
            self.goodput.add_checkpoint_stall(stall)
        return stall

    def sync(self, metrics: dict) -> None:
        """At a step every rank reaches: agree on the newest committed step; report it if new."""
        local = self.manager.poll()
        local = -1 if local is None else local
        agreed = torch.tensor([local], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.trainer.group)  # not the writer thread's group
        step = int(agreed)
        if step > self.reported:
            uri = join(self.manager.root, f"step_{step:08d}")
            if self.events:
                self.events.event("checkpoint", step, path=uri, write_s=round(self.manager.last_write_s, 3))
            self.session.commit(step, uri, metrics)
            self.reported = step


def fit(trainer: Trainer, run_dir: str | None, session: Session | None = None,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Resume, train to cfg.train.steps, evaluate, log, checkpoint; returns the summary (rank 0 writes it).
    The session hears every step (`heartbeat`), every newly committed checkpoint (`commit`, also the final
    one) and the end (`finish`)."""
    session = session or LocalSession()
    rank0 = dist.get_rank() == 0
    # rank 0's progress.json, metrics and event lines are written by one background thread, off the step
    bookkeeping = BackgroundWriter() if run_dir and rank0 else None
    # under NCCL's rules on the CPU, tensors made without a device are host tensors, which fail on a device
    # group as NCCL refuses CPU tensors (raydist.strict, raydist.strict.audit)
    marking = marking_host_tensors() if strict.active() else contextlib.nullcontext()
    try:
        with marking:
            summary = _fit(trainer, run_dir, session, log, bookkeeping)
    except BaseException:
        if bookkeeping is not None:
            try:
                bookkeeping.close()  # keep what can be kept; the run's own error is the one to report
            except Exception:
                pass
        raise
    if bookkeeping is not None:
        bookkeeping.close()  # raises a write error the run has not seen yet
    return summary


def _fit(trainer: Trainer, run_dir: str | None, session: Session, log: Callable[[str], None],
         bookkeeping: BackgroundWriter | None) -> dict[str, Any]:
    cfg, t = trainer.cfg, trainer.cfg.train
    rank0 = dist.get_rank() == 0
    goodput = Goodput(run_dir, trainer.options.start_time, bookkeeping) if run_dir and rank0 else None
    run_start = goodput.run_start if goodput else trainer.options.start_time
    events = EventLog(run_dir, run_start, background=bookkeeping) if run_dir and rank0 else None
    ckpt = _Checkpoints(trainer, run_dir, events, goodput, session, log) if run_dir else None
    replicas = trainer.replicas  # the replica manager (raydist.elastic.live); an ordinary run's is one replica
    lead = replicas.is_leader  # the replica that writes the run's bookkeeping and durable checkpoints
    for writer in (events, goodput):
        if writer is not None:
            writer.gate = lead
    _attach_replicas(trainer, replicas, goodput, events)
    replicas.writes_checkpoints = ckpt is not None
    session.phase("resume")
    # A replacement replica receives the live state from a peer in its first quorum: no storage round trip
    healed = replicas.join()
    resumed = ckpt.resume() if ckpt and not healed else None  # restores trainer.step, position, notes (and the weights)
    if not healed and resumed is None and trainer.weights_from != "init":
        # nothing resumed (or only a checkpoint that then failed to load: its partial weights are dropped)
        trainer.init_weights()
    if not healed:
        if replicas.nothing_left(trainer.step, t.steps):  # the others finished while this replica started
            trainer.close()
            session.finish({})
            return {"status": "completed", "steps": trainer.step}
        replicas.set_step(trainer.step)
    if healed:
        attempt = {"attempt": goodput.state["attempts"] if goodput else 1}
    else:
        attempt = goodput.on_start(trainer.step) if goodput else {"attempt": 1}
    workers = [None] * trainer.world_size  # where each rank runs, for operators (and failure tests)
    dist.all_gather_object(workers, {"host": socket.gethostname(), "pid": os.getpid()}, group=trainer.group)
    if events and not healed:
        kind = "start" if attempt["attempt"] == 1 else "restart"
        events.event(kind, trainer.step, world_size=trainer.world_size, mesh=trainer.layout.mesh(),
                     idle_workers=dist.get_world_size() - trainer.world_size, layout=trainer.layout.reason,
                     workers=workers, weights=trainer.weights_from, strict_collectives=strict.active(), **attempt)
        previous = (resumed or {}).get("run", {}).get("world_size")
        if previous is not None and previous != trainer.world_size:
            events.event("resize", trainer.step, from_world_size=previous, world_size=trainer.world_size,
                         mesh=trainer.layout.mesh())
    e = cfg.elastic
    # the step phase's limits from measured steps; with live recovery also the all-reduce between replicas,
    # and torchft's quorum at a step's start under the fixed limits (StepTimeouts.quorum)
    timeouts = StepTimeouts(session, lambda: training_groups(trainer.checkpoint_group) + replicas.timeout_targets(),
                            factor=e.timeout_factor, floor_s=e.timeout_floor_s,
                            ceiling_s=e.collective_timeout_s, warmup_steps=e.timeout_warmup_steps,
                            start_step=trainer.step, interval_s=cfg.monitor.heartbeat_interval_s)
    replicas.on_quorum = timeouts.quorum

    def phase(name: str) -> None:
        session.phase(name)
        timeouts.phase(name)

    logger = RunLogger(trainer, run_dir, run_start, attempt["attempt"], bookkeeping, events=events,
                       workers=workers, timeouts=timeouts)
    logger.gate = lead
    first_val = last_val = None
    pending = None
    timeline = None  # a step whose pipeline actions go to pipeline_timeline.json once read (with the next record)
    session.phase("first_step")  # the first data, and the untrained model's evaluation
    if trainer.step == 0:
        # Step 0: the untrained model's validation loss and its loss on the first training batch.
        pending = trainer.next_batch(whole=False)
        first_val = last_val = trainer.evaluate() if t.eval_every else None
        trainer.notes["first_val_loss"] = first_val
        logger.record(None, val_loss=first_val, loss=trainer.loss_on(pending[0]))
    # the training loop's wall time less its checkpoint stalls (goodput counts those as checkpoint time)
    wall_start, start_step, stalled = time.perf_counter(), trainer.step, 0.0
    every = cfg.checkpoint.every_steps
    while trainer.step < t.steps:
        stats = trainer.train_step(pending)
        if trainer.step == start_step + 1:  # the first step of this attempt is done
            session.phase("step")
        pending = None
        session.heartbeat(trainer.step)
        timeouts.step_done(trainer.step)
        logger.add_step(stats)
        done = trainer.step == t.steps
        logged = trainer.step % t.log_every == 0 or done
        val = None
        if t.eval_every and (trainer.step % t.eval_every == 0 or done):
            phase("evaluate")
            val = last_val = trainer.evaluate()
            phase("step")
        if ckpt and every and trainer.step % every == 0 and not done and lead():
            phase("save")  # waits for the save in flight, stages (and writes, when blocking)
            stalled += ckpt.save(blocking=not cfg.checkpoint.async_save)
            phase("step")
        if goodput:
            goodput.on_progress(trainer.step, logged)
        if trainer.options.record_samples and run_dir and trainer.last_span is not None:
            _record_live_samples(run_dir, trainer, stats)  # a quorum's share (tests account for every sample)
        if stats.records_timeline:
            timeline = stats
        if logged or val is not None:
            record = logger.record(stats, val_loss=val)  # reads every step since the last record, on every rank
            if timeline is not None:
                if run_dir and rank0 and lead():
                    RunStore(run_dir).write_json("pipeline_timeline.json", clean(timeline.pipeline_timeline))
                timeline = None
            if ckpt and not done:
                ckpt.sync(_numbers(record))
    wall = time.perf_counter() - wall_start - stalled
    trainer.close()
    summary = {
        # (an attempt that resumed at the last step, its predecessor having died after saving it: the loss
        # the checkpoint's notes hold)
        "status": "completed", "steps": trainer.step,
        "final_loss": logger.last.get("loss") if logger.last else trainer.notes.get("last_loss"),
        "first_val_loss": trainer.notes.get("first_val_loss"),
        "final_val_loss": last_val, "tokens": trainer.step * logger.tokens_per_step,
        "train_wall_s": round(wall, 3),
        "tokens_per_s": round((trainer.step - start_step) * logger.tokens_per_step / max(wall, 1e-9), 2),
        "mfu": logger.last.get("mfu"), "mfu_peak_source": logger.peak_source, "world_size": trainer.world_size,
        "mesh": trainer.layout.mesh(), "elapsed_s": round(time.time() - run_start, 3),
        "kernels": trainer.kernels_ran(), "kernels_selected": trainer.kernels,
        "kernels_measured": trainer.kernel_choices, **trainer.param_counts,
    }
    if ckpt and lead():
        phase("save")
        ckpt.save(blocking=True)
    if goodput:
        summary.update(goodput.summary(trainer.step, logger.tokens_per_step))
    if ckpt:
        ckpt.sync(_numbers(summary))
    summary.update(replicas.summary(trainer.retried_steps))
    if run_dir and rank0 and lead():
        bookkeeping.flush()  # progress, metrics and events are on storage before the summary says so
        RunStore(run_dir).write_json("summary.json", clean(summary))
        events.event("end", trainer.step, status="completed")
        bookkeeping.flush()
    session.finish(summary)
    return summary


def _attach_replicas(trainer: Trainer, replicas, goodput: Goodput | None, events: EventLog | None) -> None:
    """Live recovery: the live state a replacement receives is the checkpoint's parts plus the goodput
    accounting; quorum changes become replica_lost / replica_joined events (written by the leader)."""
    from raydist.checkpoint.state import AttributeState

    if goodput is not None:
        replicas.add_state("goodput", AttributeState(goodput, "state"))

    def on_events(changes: list[tuple[str, dict]]) -> None:
        for kind, fields in changes:
            if goodput is not None:
                if kind == "replica_lost":
                    goodput.on_replica_lost(fields["replica"])
                else:
                    goodput.on_replica_joined(fields["replica"], fields["time_to_rejoin_s"])
            if events is not None:
                events.event(kind, trainer.step, **fields)

    replicas.on_events = on_events


def _record_live_samples(run_dir: str, trainer: Trainer, stats: StepStats) -> None:
    """Tests (TrainerOptions.record_samples): every worker of every replica appends the sample ids of each
    step it committed, with its own span, its replica's span, (rank, size) in that step's quorum and
    (dp rank, dp) inside its replica, to RUN_DIR/samples/replica-<pid>.jsonl, so a test can account for
    every sample of a run. A worker killed between a step's commit and this line trained that step without
    recording it: the survivors' lines name the quorum it was part of."""
    if stats.sample_ids is None:
        return
    samples = RunStore(run_dir).appender(f"samples/replica-{os.getpid()}.jsonl")
    samples.append_line(json.dumps({"step": trainer.step, "span": list(trainer.last_span),
                                    "replica_span": list(trainer.last_replica_span), "quorum": list(trainer.last_quorum),
                                    "shard": [trainer.mesh.dp_rank, trainer.layout.dp],
                                    "ids": [int(i) for i in stats.sample_ids]}))


def _numbers(record: dict) -> dict:
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
