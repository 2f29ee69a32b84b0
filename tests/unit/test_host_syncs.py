"""No step makes the host wait for the device except the logged ones: the host runs ahead of the GPU.

Counted on the CPU with `raydist.testing.HostSyncCounter` (every call that would synchronise a CUDA run:
tensor reads, host copies, blocking copies of host data to the device, data-dependent shapes, explicit and
event syncs), step by step: zero on unlogged steps, and on a logged step exactly the reads of the loop's
figures: one host read for every pending step's losses and gradient norms, one more with a pipeline for
every pending step's stage times, and the object gather of the report's timeline once per run. On a GPU,
tests/gpu/test_host_syncs_cuda.py runs unlogged steps under `torch.cuda.set_sync_debug_mode("error")`.
"""

from __future__ import annotations

import inspect
import json
from collections import Counter

import pytest
import torch

from raydist.config import Config
from raydist.parallel.runtime import spawn
from raydist.testing import HostSyncCounter, tiny_config

STEPS, LOG_EVERY = 8, 4
TRAIN = {"steps": STEPS, "global_batch": 4, "micro_batch": 1, "log_every": LOG_EVERY}
SETTLE = ("tolist", "training/trainer.py")  # every pending step's losses and norms, one read
STAGE_TIMES = ("tolist", "parallel/pipeline_executor.py")  # every pending step's stage times, one read


def _steps(raw: dict) -> list[list[tuple[str, str]]]:
    """Per step, the syncs of `train_step` and, on logged steps, of reading what the loop's record reads
    (loss, grad norm, the pipeline's stage times and timeline, every step's busy time)."""
    from raydist.elastic.session import LocalSession
    from raydist.parallel.runtime import pick_device
    from raydist.training.trainer import Trainer

    cfg = Config.from_dict(raw)
    trainer = Trainer(cfg, pick_device(), LocalSession().start(cfg))
    per_step, interval = [], []
    try:
        with HostSyncCounter() as counter:
            for step in range(1, cfg.train.steps + 1):
                mark = counter.mark()
                stats = trainer.train_step()
                interval.append(stats)
                if step % cfg.train.log_every == 0:
                    stats.loss, stats.grad_norm, stats.pipeline
                    [s.pipeline_timeline for s in interval if s.records_timeline]
                    [s.busy_s for s in interval]
                    interval = []
                per_step.append(counter.since(mark))
    finally:
        trainer.close()
    return per_step


def _layouts(raws: list[dict]) -> list[list[list[tuple[str, str]]]]:
    return [_steps(raw) for raw in raws]


def _timeline_gather_lines() -> range:
    from raydist.training.runners import PipelineRunner

    lines, first = inspect.getsourcelines(PipelineRunner._gather_timeline)
    return range(first, first + len(lines))


def _check(per_step: list[list[tuple[str, str]]], logged: list[tuple[str, str]], timeline_at: int | None = None):
    """Zero syncs on unlogged steps; on logged ones `logged` (what, file) and, on the one after the timeline
    step, the timeline's object gather (its count is torch's: not ours to fix)."""
    gather = _timeline_gather_lines()
    for step, calls in enumerate(per_step, 1):
        if step % LOG_EVERY:
            assert calls == [], f"step {step} (not logged) synchronises: {calls}"
            continue
        ours = [(what, where.rsplit(":", 1)[0]) for what, where in calls
                if not (where.startswith("training/runners.py:") and int(where.rsplit(":", 1)[1]) in gather)]
        assert Counter(ours) == Counter(logged), f"logged step {step}: {calls}"
        gathered = len(calls) - len(ours)
        if timeline_at is not None and step == -(-timeline_at // LOG_EVERY) * LOG_EVERY:
            assert gathered > 0, f"step {step} should gather the timeline of step {timeline_at}"
        else:
            assert gathered == 0, f"step {step} gathers a timeline: {calls}"


def test_accumulation_runner_syncs_only_at_logged_steps(tiny_data):
    [per_step] = spawn(_steps, 1, tiny_config(tiny_data, train=TRAIN))
    _check(per_step, [SETTLE])


@pytest.fixture(scope="module")
def two_ranks(tiny_data):
    """Per layout, per rank: the per-step syncs of a 2-rank pipeline (1F1B), FSDP, ring CP and TP run."""
    from raydist.training.trainer import TIMELINE_STEP

    layouts = {"pp2-1f1b": {"pp": 2, "pp_schedule": "1f1b"}, "fsdp2": {"dp_shard": 2},
               "cp2-ring": {"cp": 2, "cp_impl": "ring"}, "tp2": {"tp": 2}}
    raws = [tiny_config(tiny_data, train=TRAIN, parallel={"dp_replicate": 1, **p}) for p in layouts.values()]
    per_rank = spawn(_layouts, 2, raws)
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(layouts)}, TIMELINE_STEP + 1


def test_pipeline_syncs_only_at_logged_steps(two_ranks):
    """The executor keeps the loss on the device, the clock reads its marks when asked, the stage times are
    gathered at the logged step for every step since the last (and the report's timeline with them)."""
    results, timeline_at = two_ranks
    for per_step in results["pp2-1f1b"]:
        _check(per_step, [SETTLE, STAGE_TIMES], timeline_at)


@pytest.mark.slow  # each case reads `two_ranks`, one spawn that runs every layout (~12 s)
@pytest.mark.parametrize("layout", ["fsdp2", "cp2-ring", "tp2"])
def test_sharded_layouts_sync_only_at_logged_steps(two_ranks, layout):
    results, _ = two_ranks
    for per_step in results[layout]:
        _check(per_step, [SETTLE])


def _fit(raw: dict, run_dir: str) -> list[list[tuple[str, str]]]:
    """`fit`'s syncs by step: from one `train_step` call to the next (the loop's bookkeeping included)."""
    from raydist.parallel.runtime import pick_device
    from raydist.training.loop import fit
    from raydist.training.trainer import Trainer

    trainer = Trainer(Config.from_dict(raw), pick_device())
    counter = HostSyncCounter()
    marks: list[int] = []
    step_fn = trainer.train_step

    def train_step(batch=None):
        marks.append(counter.mark())
        return step_fn(batch)

    trainer.train_step = train_step
    with counter:
        fit(trainer, run_dir, log=lambda *_: None)
    marks.append(counter.mark())  # the end
    return [counter.calls[a:b] for a, b in zip(marks, marks[1:])]


@pytest.mark.parametrize("parallel, world", [({}, 1), ({"pp": 2}, 2)], ids=["single", "pp2"])
def test_fit_reads_nothing_on_unlogged_steps(tiny_data, tmp_path, parallel, world):
    """The loop around the steps (heartbeat, goodput, metrics, events) reads nothing on unlogged steps, and
    still records the loss, norm, pipeline times and timeline of logged ones."""
    raw = tiny_config(tiny_data, train=TRAIN, parallel={"dp_replicate": 1, **parallel},
                      checkpoint={"every_steps": 0})
    per_rank = spawn(_fit, world, raw, str(tmp_path))
    for per_step in per_rank:
        assert len(per_step) == STEPS
        for step, calls in enumerate(per_step, 1):
            if step % LOG_EVERY:
                assert calls == [], f"step {step} (not logged) synchronises: {calls}"
            else:
                assert calls, f"logged step {step} read nothing"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in logged] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    assert all(isinstance(r["loss"], float) and isinstance(r["grad_norm"], float) for r in logged)
    if world > 1:
        assert all(len(r["pipeline"]["busy_s"]) == 2 and 0 <= r["pipeline"]["bubble"] < 1 for r in logged)
        timeline = json.loads((tmp_path / "pipeline_timeline.json").read_text())
        assert {a["rank"] for a in timeline} == {0, 1} and all(a["end_s"] >= a["start_s"] for a in timeline)


# ---- the clock's CUDA path, with stand-in events --------------------------------------------------


class _FakeEvent:
    """A CUDA event stand-in: `record` stamps a host time; `query` says whether the 'device' got there."""

    done = False

    def __init__(self, enable_timing: bool = False):
        self.at = None

    def record(self, stream=None):
        self.at = len(_FakeEvent.log)
        _FakeEvent.log.append(self)

    def query(self) -> bool:
        return _FakeEvent.done

    def synchronize(self) -> None:
        _FakeEvent.done = True

    def elapsed_time(self, end: "_FakeEvent") -> float:
        assert _FakeEvent.done, "elapsed_time before the events completed (CUDA raises)"
        return float(end.at - self.at)  # one 'millisecond' per recorded event


_FakeEvent.log = []


@pytest.mark.parametrize("device_reached_the_end", [False, True])
def test_cuda_clock_records_every_step_and_reads_when_asked(monkeypatch, device_reached_the_end):
    from raydist.schedule.clock import ActionClock

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    _FakeEvent.log, _FakeEvent.done = [], False
    clock = ActionClock(torch.device("cuda"))
    with HostSyncCounter() as counter:
        steps = []
        for _ in range(3):
            clock.start_step()
            for kind in ("F", "B"):
                began = clock.begin()
                clock.end(began, {"kind": kind})
            steps.append(clock.finish())
        assert counter.calls == []  # recorded, nothing read
        _FakeEvent.done = device_reached_the_end
        busy = [times.busy_s for times in steps]
        rows = steps[0].rows
    waits = [what for what, _ in counter.calls if what == "Event.synchronize"]
    assert waits == ([] if device_reached_the_end else ["Event.synchronize"])  # one wait at most, for all
    # origin, (begin, end) of F and of B, stop: one 'millisecond' apart
    assert busy == pytest.approx([0.002] * 3) and steps[0].wall_s == pytest.approx(0.005)
    assert [(r["kind"], r["start_s"], r["end_s"]) for r in rows] == [("F", 0.001, 0.002), ("B", 0.003, 0.004)]


def test_counter_sees_a_planted_sync():
    """The counter is not blind: a loss read per step (the executor's old `float(loss)`) is counted, a
    host tensor (made without a device, as on a CUDA run) is not, and neither is a non-blocking copy."""
    loss = torch.ones(())  # made before counting: a device tensor for the counter
    with HostSyncCounter() as counter:
        host = torch.tensor([1.0])
        float(loss)
        loss.tolist()
        int(host[0].long())
        host.to(torch.device("cpu"), non_blocking=True)
        torch.tensor([1.0], device="cpu")
        loss.reshape(1)[loss.reshape(1) > 0]
        torch.empty(1).copy_(loss.reshape(1))
        loss.to("cpu")
    assert [what for what, _ in counter.calls] == ["float", "tolist", "tensor(device=)", "boolean index",
                                                   "copy_ to the host", "to(cpu)"]
