"""The pipeline bubble measured on 4 processes, against the theory and against torch.distributed.pipelining.

Every stage is a sleep with a known cost per micro-batch and rank: its forward sleeps tf and its backward
tb, split as in a zero-bubble schedule (Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism", ICLR
2024) into the input gradient (B, tb - tw) and the weight gradient (W, tw). The stage is
y = SleepInput(x) * w: SleepInput's backward is the input path and sleeps tb - tw; the multiply's
backward sleeps tw only when autograd will accumulate w's gradient in that backward
(`torch._C._will_engine_execute_node` on a view of w), so an unsplit backward sleeps tb, a B (input
gradient only) tb - tw and a W tw, whichever executor asks. The first stage makes its input a leaf that
requires a gradient when it arrives without one (as torch.distributed.pipelining passes it), so its
backward costs tb too (torch's split schedules then run it whole in the first stage's W). A sleeping
process leaves its core free, so the 2 CPU cores of a dev machine do not distort it. With P = 4 ranks
and M micro-batches the ideal step is

    1F1B / GPipe:        (M + P - 1) (tf + tb)
    interleaved, V = 2:  (M + (P - 1) / V) (tf + tb)     (each chunk sleeps tf / V and tb / V)
    ZB-H1:               M (tf + tb) + (P - 1)(tf + tb - 2 tw)
    ZB-V (2 chunks):     M (tf + tb) + (P - 1) tf / 2     (at F = B = W)

(`raydist.schedule.timeline.ideal_step_time`). Each row runs one schedule on both sides: raydist's
executor and torch.distributed.pipelining on the same sleep stages - Schedule1F1B, ScheduleGPipe,
ScheduleInterleaved1F1B, and for the zero-bubble rows its ScheduleInterleavedZeroBubble (ZB1P, one stage
per rank, next to zbh1) and ScheduleZBVZeroBubble (next to zbv). Steps are timed between barriers on
every rank, raydist and torch alternating step by step; a side's step time is the median over its timed
steps (the slowest rank's median). One run, side by side. The columns:

    nominal ideal   the formula above at the sleeps asked for (--tf-ms, --tb-ms, --tw-ms).
    /nominal        step / nominal ideal: everything the sleeps do not cover, the stage's own overrun included.
    /measured       step / the same formula at the stage costs that side measured in its own timed steps
                    (the second table): what the schedule's execution adds - bubbles beyond the schedule's,
                    transfers, the executor's work between actions, autograd's between the stage's nodes -
                    but not what the stage itself took beyond its sleeps. 1.000: every action took exactly
                    what the stage measured and nothing else took time.
    raydist/torch   the two step times' ratio.
    bubble          what raydist's executor reports (idle / wall: what training logs as pp_bubble; median
                    step, mean over ranks), next to the theory at unit costs.

The stage costs are measured inside the stage, the same code on both sides: the wall time of each whole
`SleepStage.forward` (tf, from its entry to its return: both autograd functions' forwards and sleeps),
and of the bodies of the two backward functions, in two parts per micro-batch: the input part
(`_SleepInput.backward`'s sleep and the input half of `_ScaleWeight.backward`) and the weight part
(`_ScaleWeight.backward`'s sleep and w's gradient, when autograd computes it). tb = input + weight part,
tw = weight part, whichever executor actions ran them: an unsplit backward, raydist's B and W, torch's
`stage_backward_input` and `stage_backward_weight` (both sides' W re-run `_ScaleWeight.backward` from
the node where B kept the gradient, so the parts match; torch's first stage runs its whole backward in
W: same parts, same sum). What runs outside these bodies - the call into autograd, the graph walk of a
split backward, the view and accumulation nodes, the loss function on the last stage - counts against
the schedule, on both sides alike. Costs are pooled over micro-batches, chunks and ranks: a rank's tf is
V times its chunks' mean forward. Means, not medians: a step is the sum of the actions on its critical
path and the mean of a sum is the sum of the means, so the late wake-ups of a sleep (four ranks on two
cores) that every step pays stay with the stage; medians would hand that tail to the executor (the
JSON line carries the medians too, `*_stage_median_ms`). A cost is recorded with two or three
`time.perf_counter` calls and an add per function call (0.1 us a part, measured; under 1 us a
micro-batch against 10-40 ms of sleep), only in the timed steps (the first `--warmup` steps are not
recorded), and the run stops with an error when a side's timed steps did not record exactly one forward
and one whole backward per micro-batch and chunk.

Neither side reaches the nominal ideal: its costs are exact and transfers free. On a 2-core development
machine (measured, 15 steps, 20/40/20 ms) the stages took tf 20.4-20.5 and tb 40.5-40.8 ms on both sides
(20.6-20.9 and 40.8-41.1 in interleaved and zbv, whose chunks run twice the actions): the sleeps wake
about 0.2-0.25 ms late with four ranks on the two cores, and the stage's own code runs. That puts every
measured-stage ideal 1.4-3.2% above the nominal one; against it 1F1B ran at 1.023-1.031 on both sides. A
trace of raydist's 1F1B critical path at M = 16 (38 actions, 17-18 hops;
`stats.timeline` of `executor.step`, with the stage's bodies time-stamped) put the remaining 28-33 ms
in: autograd outside the stage's backward bodies, 0.4 ms per B (0.14 entering the engine, 0.06 between
the nodes, 0.16 leaving it; in one process alone 0.14 in all after sleeps, 0.08 after busy-waits of the
same length, 0.05 with no wait), 7.7 ms; the forwards' 0.05 ms each and the last stage's loss, 1.6 ms;
gloo hops at about 0.4 ms, 7 ms; gaps on a rank between its actions, 7.5-10 ms (posting a send and the
next receive, 0.15-0.2 ms, and waiting for a tensor whose sender finished about when this rank did); the
step's end (loss broadcast, barrier), 2-3 ms.

    python benchmarks/pipeline_bubble.py [--tf-ms 20] [--tb-ms 40] [--tw-ms 20] [--steps 5] [--warmup 2]
        [--microbatches 4 8 16] [--kinds gpipe 1f1b interleaved zbh1 zbv] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from fractions import Fraction

import torch
import torch.distributed as dist
from torch import nn

from raydist.parallel.runtime import spawn
from raydist.schedule.registry import KINDS, chunks_per_rank, make_schedule

P, V = 4, 2
SHAPE = (1, 4, 8)  # (B_micro, T, D) of the activations passed between stages: tiny, the cost is the sleep
TORCH_NAME = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
              "zbh1": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}


class StageClock:
    """The stage's own wall time on one rank for one side, per micro-batch and chunk: each forward (the whole
    `SleepStage.forward`), and its backward in two parts, wherever the executor runs them: the input part
    (the bodies of `_SleepInput.backward` and of the input half of `_ScaleWeight.backward`: B's work) and
    the weight part (the weight half of `_ScaleWeight.backward`: W's). Off until `recording` is set."""

    def __init__(self):
        self.recording = False
        self.forward_s: list[float] = []
        self.backward_s: list[list[float]] = []  # per micro-batch: [input part s, weight part s]

    def new_backward(self) -> list[float] | None:
        if not self.recording:
            return None
        parts = [0.0, 0.0]
        self.backward_s.append(parts)
        return parts


class _SleepInput(torch.autograd.Function):
    """Identity that sleeps forward_s in forward and input_s (the input-gradient part) in backward."""

    @staticmethod
    def forward(ctx, x, forward_s, input_s, parts):
        time.sleep(forward_s)
        ctx.input_s, ctx.parts = input_s, parts
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        began = time.perf_counter()
        time.sleep(ctx.input_s)
        if ctx.parts is not None:
            ctx.parts[0] += time.perf_counter() - began
        return grad, None, None, None


class _ScaleWeight(torch.autograd.Function):
    """h * w; its backward sleeps weight_s when this backward computes w's gradient (when autograd will
    run the node `accumulator` between w and its AccumulateGrad)."""

    @staticmethod
    def forward(ctx, h, weight, weight_s, accumulator, parts):
        ctx.save_for_backward(h, weight)
        ctx.weight_s, ctx.accumulator, ctx.parts = weight_s, accumulator, parts
        return h * weight

    @staticmethod
    def backward(ctx, grad):
        began = time.perf_counter()
        h, weight = ctx.saved_tensors
        grad_weight = None
        if torch._C._will_engine_execute_node(ctx.accumulator):
            time.sleep(ctx.weight_s)
            grad_weight = (grad * h).sum().reshape(weight.shape)
            weighed = time.perf_counter()
            if ctx.parts is not None:
                ctx.parts[1] += weighed - began
            began = weighed
        grad_input = grad * weight
        if ctx.parts is not None:
            ctx.parts[0] += time.perf_counter() - began
        return grad_input, grad_weight, None, None, None


class SleepStage(nn.Module):
    """y = x * w with a forward that sleeps forward_s and a backward that sleeps backward_s, of which
    weight_s is the weight gradient's; `clock` records what each of them took."""

    def __init__(self, forward_s: float, backward_s: float, weight_s: float, clock: StageClock):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        self.forward_s, self.input_s, self.weight_s = forward_s, backward_s - weight_s, weight_s
        self.clock = clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        began = time.perf_counter()
        parts = self.clock.new_backward() if torch.is_grad_enabled() else None
        if torch.is_grad_enabled() and not x.requires_grad:
            # The first stage's input needs no gradient (token ids in a model; torch.distributed.pipelining
            # passes it as given). Its backward still costs tb: the layers' input path runs to reach the
            # earlier layers' weights. Without this, autograd would drop _SleepInput's node there and that
            # side's first stage would sleep tw instead of tb, 20 ms less per micro-batch than the ideal.
            x = x.detach().requires_grad_()
        h = _SleepInput.apply(x, self.forward_s, self.input_s, parts)
        # a view: a node between w and its accumulator, which autograd.grad (torch's W) can be asked about
        weight = self.weight.view_as(self.weight)
        out = _ScaleWeight.apply(h, weight, self.weight_s, weight.grad_fn, parts)
        if self.clock.recording:
            self.clock.forward_s.append(time.perf_counter() - began)
        return out


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def _timed_pair(ours, theirs, steps: int, warmup: int, clocks: tuple[StageClock, StageClock]
                ) -> tuple[list[float], list[float]]:
    """Alternate one step of each side, timed between barriers, so load changes hit both alike. The
    stages' clocks record from the first timed step on (each side's stages run only in its own steps)."""
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(warmup + steps):
        for clock in clocks:
            clock.recording = i >= warmup
        for side, run_step in enumerate((ours, theirs)):
            dist.barrier()
            start = time.perf_counter()
            run_step()
            dist.barrier()
            if i >= warmup:
                times[side].append(time.perf_counter() - start)
    return times


def _chunks(kind: str) -> int:
    return chunks_per_rank(kind, V)


def raydist_runner(kind: str, m: int, tf: float, tb: float, tw: float):
    from raydist.parallel.pipeline_executor import PipelineExecutor

    rank = dist.get_rank()
    v = _chunks(kind)
    clock = StageClock()
    chunks = [SleepStage(tf / v, tb / v, tw / v, clock) for _ in range(v)]
    # zbv's greedy order is built for the costs (in units of tf)
    schedule = make_schedule(kind, P, m, v, tf=1, tb=Fraction(tb / tf).limit_denominator(1000),
                             tw=Fraction(tw / tf).limit_denominator(1000))
    executor = PipelineExecutor(chunks, schedule, rank, None, activation_shape=SHAPE, loss_fn=mse)
    inputs = [torch.randn(SHAPE) for _ in range(m)]
    targets = [torch.randn(SHAPE) for _ in range(m)]
    bubbles = []

    def step():
        stats = executor.step(inputs, targets)
        bubbles.append(stats.bubble_fraction)

    return step, bubbles, clock


def torch_runner(kind: str, m: int, tf: float, tb: float, tw: float):
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage

    rank = dist.get_rank()
    batch = torch.randn((m * SHAPE[0],) + SHAPE[1:])
    target = torch.randn_like(batch)
    schedule_class = getattr(pipelining, TORCH_NAME[kind])
    cpu = torch.device("cpu")
    clock = StageClock()
    # Activation shapes are inferred at the first step (the static input_args path left middle stages
    # without output gradients in torch 2.13).
    if kind in ("gpipe", "1f1b"):
        schedule = schedule_class(PipelineStage(SleepStage(tf, tb, tw, clock), rank, P, cpu), m, loss_fn=mse)
        first, last = rank == 0, rank == P - 1
    elif kind == "zbh1":  # ZB1P with one stage per rank
        schedule = schedule_class([PipelineStage(SleepStage(tf, tb, tw, clock), rank, P, cpu)], m, loss_fn=mse)
        first, last = rank == 0, rank == P - 1
    elif kind == "zbv":  # the V: rank r holds stages r and 2P - 1 - r
        stages = [PipelineStage(SleepStage(tf / 2, tb / 2, tw / 2, clock), s, 2 * P, cpu)
                  for s in (rank, 2 * P - 1 - rank)]
        schedule = schedule_class(stages, m, loss_fn=mse)
        first = last = rank == 0
    else:
        stages = [PipelineStage(SleepStage(tf / V, tb / V, tw / V, clock), c * P + rank, P * V, cpu) for c in range(V)]
        schedule = schedule_class(stages, m, loss_fn=mse)
        first, last = rank == 0, rank == P - 1

    def step():
        if first and last:
            schedule.step(batch, target=target)
        elif first:
            schedule.step(batch)
        elif last:
            schedule.step(target=target)
        else:
            schedule.step()

    return step, clock


def _bench(kinds: list[str], microbatches: list[int], tf: float, tb: float, tw: float, steps: int,
           warmup: int) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    for m in microbatches:
        for kind in kinds:
            if kind in ("zbh1", "zbv") and m < P:
                continue  # the zero-bubble schedules need M >= P
            step, bubbles, our_clock = raydist_runner(kind, m, tf, tb, tw)
            their_step, their_clock = torch_runner(kind, m, tf, tb, tw)
            ours, theirs = _timed_pair(step, their_step, steps, warmup, (our_clock, their_clock))
            for side, clock in (("raydist", our_clock), ("torch", their_clock)):
                _check_samples(clock, side, kind, steps * m * _chunks(kind), tw)
            rows.append({"m": m, "kind": kind, "ours": ours, "theirs": theirs,
                         "bubble": statistics.median(bubbles[warmup:]),
                         "stage": {"ours": (our_clock.forward_s, our_clock.backward_s),
                                   "theirs": (their_clock.forward_s, their_clock.backward_s)}})
    return rows


def _check_samples(clock: StageClock, side: str, kind: str, expected: int, tw: float) -> None:
    """Every micro-batch of every chunk in the timed steps ran one forward and a whole backward: B's part
    always, W's too when the weight gradient sleeps (a missing W would make the measured ideal too low)."""
    forwards, backwards = len(clock.forward_s), len(clock.backward_s)
    missing = sum(1 for parts in clock.backward_s if parts[0] <= 0 or (tw > 0 and parts[1] <= 0))
    if forwards != expected or backwards != expected or missing:
        raise RuntimeError(f"error: {side} {kind} on rank {dist.get_rank()} recorded {forwards} forwards and "
                           f"{backwards} backwards ({missing} incomplete), expected {expected} whole ones: "
                           "the stage clock no longer sees every action; check SleepStage")


def stage_costs(samples: list[tuple[list[float], list[list[float]]]], v: int,
                average=statistics.fmean) -> dict[str, float]:
    """A rank's (tf, tb, tw) per micro-batch, seconds, from every rank's samples of one side: v times the
    average chunk's forward, backward (input + weight parts) and weight part, pooled over ranks."""
    forwards = [f for forward_s, _ in samples for f in forward_s]
    backwards = [parts for _, backward_s in samples for parts in backward_s]
    return {"tf": v * average(forwards), "tb": v * average(i + w for i, w in backwards),
            "tw": v * average(w for _, w in backwards)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tf-ms", type=float, default=20.0, help="forward sleep per micro-batch per rank")
    parser.add_argument("--tb-ms", type=float, default=40.0, help="backward sleep per micro-batch per rank")
    parser.add_argument("--tw-ms", type=float, default=20.0, help="of which the weight gradient (W)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="also print the rows as one JSON line")
    args = parser.parse_args()
    if not 0 <= args.tw_ms <= args.tb_ms:
        parser.error(f"--tw-ms={args.tw_ms:g} must be within [0, --tb-ms={args.tb_ms:g}]: W is part of the backward")
    tf, tb, tw = args.tf_ms / 1000, args.tb_ms / 1000, args.tw_ms / 1000

    from raydist.schedule.timeline import ideal_step_time, theoretical_bubble

    per_rank = spawn(_bench, P, args.kinds, args.microbatches, tf, tb, tw, args.steps, args.warmup,
                     timeout_s=1800)
    print(f"P={P} ranks (gloo, 1 thread each), tf={args.tf_ms:g} ms, tb={args.tb_ms:g} ms (W {args.tw_ms:g} ms), "
          f"median of {args.steps} steps after {args.warmup} warm-up; interleaved V={V}, zbv 2 chunks per rank")
    header = (f"{'M':>3} {'schedule':<15} {'nominal ideal':>13} {'raydist ms':>11} {'/nominal':>9} {'/measured':>10} "
              f"{'torch schedule':<30} {'torch ms':>9} {'/nominal':>9} {'/measured':>10} {'raydist/torch':>14} "
              f"{'bubble: measured':>17} {'unit-cost theory':>17}")
    costs_header = (f"{'M':>3} {'schedule':<15} {'raydist tf':>11} {'tb':>7} {'tw':>7} {'ideal ms':>9}   "
                    f"{'torch tf':>9} {'tb':>7} {'tw':>7} {'ideal ms':>9}")
    table, costs_table, out = [], [], []
    for i, row in enumerate(per_rank[0]):
        m, kind = row["m"], row["kind"]
        v = _chunks(kind)
        ideal = ideal_step_time(kind, P, m, v, tf, tb, tw)
        # A step ends at a barrier on every rank, so any rank's median is the step time; take the slowest.
        step = {"ours": max(statistics.median(r[i]["ours"]) for r in per_rank),
                "theirs": max(statistics.median(r[i]["theirs"]) for r in per_rank)}
        costs = {side: stage_costs([r[i]["stage"][side] for r in per_rank], v) for side in step}
        medians = {side: stage_costs([r[i]["stage"][side] for r in per_rank], v, statistics.median) for side in step}
        measured = {side: ideal_step_time(kind, P, m, v, c["tf"], c["tb"], c["tw"]) for side, c in costs.items()}
        bubble = statistics.mean(r[i]["bubble"] for r in per_rank)  # each rank's median step
        theory = float(theoretical_bubble(kind, P, m, v))
        label = kind + (f" V={v}" if kind == "interleaved" else "")
        ours, theirs = step["ours"], step["theirs"]
        table.append(f"{m:>3} {label:<15} {ideal * 1e3:>13.1f} {ours * 1e3:>11.1f} {ours / ideal:>9.3f} "
                     f"{ours / measured['ours']:>10.3f} {TORCH_NAME[kind]:<30} {theirs * 1e3:>9.1f} "
                     f"{theirs / ideal:>9.3f} {theirs / measured['theirs']:>10.3f} {ours / theirs:>14.3f} "
                     f"{bubble:>17.3f} {theory:>17.3f}")
        costs_table.append(f"{m:>3} {label:<15} " + "   ".join(
            f"{costs[side]['tf'] * 1e3:>{width}.2f} {costs[side]['tb'] * 1e3:>7.2f} {costs[side]['tw'] * 1e3:>7.2f} "
            f"{measured[side] * 1e3:>9.1f}" for side, width in (("ours", 11), ("theirs", 9))))
        out.append({"m": m, "schedule": kind, "virtual_stages": v, "ideal_ms": round(ideal * 1e3, 2),
                    "raydist_ms": round(ours * 1e3, 2), "raydist_vs_ideal": round(ours / ideal, 4),
                    "raydist_measured_ideal_ms": round(measured["ours"] * 1e3, 2),
                    "raydist_vs_measured_ideal": round(ours / measured["ours"], 4),
                    "raydist_stage_mean_ms": _ms(costs["ours"]), "raydist_stage_median_ms": _ms(medians["ours"]),
                    "torch_schedule": TORCH_NAME[kind], "torch_ms": round(theirs * 1e3, 2),
                    "torch_vs_ideal": round(theirs / ideal, 4),
                    "torch_measured_ideal_ms": round(measured["theirs"] * 1e3, 2),
                    "torch_vs_measured_ideal": round(theirs / measured["theirs"], 4),
                    "torch_stage_mean_ms": _ms(costs["theirs"]), "torch_stage_median_ms": _ms(medians["theirs"]),
                    "raydist_bubble": round(bubble, 4), "theory_bubble_unit_costs": round(theory, 4)})
    print("\n".join([header, "-" * len(header)] + table))
    print("\nStage costs measured inside the stage during each side's timed steps (ms per micro-batch per rank, "
          "mean over micro-batches, chunks and ranks) and the ideal step they give:")
    print("\n".join([costs_header, "-" * len(costs_header)] + costs_table))
    if args.json:
        print(json.dumps({"benchmark": "pipeline_bubble", "ranks": P, "tf_ms": args.tf_ms, "tb_ms": args.tb_ms,
                          "tw_ms": args.tw_ms, "steps": args.steps, "rows": out}))


def _ms(costs: dict[str, float]) -> dict[str, float]:
    return {name: round(seconds * 1e3, 3) for name, seconds in costs.items()}


if __name__ == "__main__":
    main()
