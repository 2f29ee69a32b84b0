"""The pipeline bubble measured on 4 processes, against the theory and against torch.distributed.pipelining.

Every stage is a sleep with a known cost per micro-batch and rank: its forward sleeps tf and its backward
tb, split as in a zero-bubble schedule (Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism", ICLR
2024) into the input gradient (B, tb - tw) and the weight gradient (W, tw). The stage is
y = SleepInput(x) * w: SleepInput's backward is the input path and sleeps tb - tw; the multiply's
backward sleeps tw only when autograd will accumulate w's gradient in that backward
(`torch._C._will_engine_execute_node` on a view of w), so an unsplit backward sleeps tb, a B (input gradient only)
tb - tw and a W tw, whichever executor asks. The first stage makes its input a leaf that requires a
gradient when it arrives without one (as torch.distributed.pipelining passes it), so its backward costs
tb too (torch's split schedules then run it whole in the first stage's W). A sleeping process leaves its core free, so the 2 CPU
cores of a dev machine do not distort it. With P = 4 ranks and M micro-batches the ideal step is

    1F1B / GPipe:        (M + P - 1) (tf + tb)
    interleaved, V = 2:  (M + (P - 1) / V) (tf + tb)     (each chunk sleeps tf / V and tb / V)
    ZB-H1:               M (tf + tb) + (P - 1)(tf + tb - 2 tw)
    ZB-V (2 chunks):     M (tf + tb) + (P - 1) tf / 2     (at F = B = W)

(`raydist.schedule.timeline.ideal_step_time`). For each M this prints the measured step time of
raydist's executor over the ideal, the same ratio for torch.distributed.pipelining on the same sleep
stages - Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, and for the zero-bubble rows its
ScheduleInterleavedZeroBubble (ZB1P, one stage per rank, next to zbh1) and ScheduleZBVZeroBubble (next to
zbv) - the ratio raydist / torch, and the bubble raydist's executor reports (idle / wall: what training
logs as pp_bubble; median step, mean over ranks) next to the theory at unit costs. Steps are timed
between barriers on every rank, raydist and torch alternating step by step; medians over the measured
steps. One run, side by side. `--json` also prints the rows as one JSON line.

Neither side reaches the ideal: its costs are exact and transfers free. On a 2-core development machine
(measured) a stage's forward overran its 20 ms sleep by about 0.35 ms alone and 0.5-0.7 ms with four
ranks on the two cores, a backward its 40 ms by 0.55 and 0.7-0.9 ms, and a gloo send to a waiting
receive took 0.2-0.3 ms; 1F1B's critical path holds 2 (M + P - 1) actions and 10 (M = 4) to 28
(M = 16) such transfers, about 3% of the ideal at every M, whichever executor runs it.

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

from raydist.runtime import spawn

P, V = 4, 2
SHAPE = (1, 4, 8)  # (B_micro, T, D) of the activations passed between stages: tiny, the cost is the sleep
KINDS = ("gpipe", "1f1b", "interleaved", "zbh1", "zbv")
TORCH_NAME = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
              "zbh1": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}


class _SleepInput(torch.autograd.Function):
    """Identity that sleeps forward_s in forward and input_s (the input-gradient part) in backward."""

    @staticmethod
    def forward(ctx, x, forward_s, input_s):
        time.sleep(forward_s)
        ctx.input_s = input_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.input_s)
        return grad, None, None


class _ScaleWeight(torch.autograd.Function):
    """h * w; its backward sleeps weight_s when this backward computes w's gradient (when autograd will
    run the node `accumulator` between w and its AccumulateGrad)."""

    @staticmethod
    def forward(ctx, h, weight, weight_s, accumulator):
        ctx.save_for_backward(h, weight)
        ctx.weight_s, ctx.accumulator = weight_s, accumulator
        return h * weight

    @staticmethod
    def backward(ctx, grad):
        h, weight = ctx.saved_tensors
        grad_weight = None
        if torch._C._will_engine_execute_node(ctx.accumulator):
            time.sleep(ctx.weight_s)
            grad_weight = (grad * h).sum().reshape(weight.shape)
        return grad * weight, grad_weight, None, None


class SleepStage(nn.Module):
    """y = x * w with a forward that sleeps forward_s and a backward that sleeps backward_s, of which
    weight_s is the weight gradient's."""

    def __init__(self, forward_s: float, backward_s: float, weight_s: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        self.forward_s, self.input_s, self.weight_s = forward_s, backward_s - weight_s, weight_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and not x.requires_grad:
            # The first stage's input needs no gradient (token ids in a model; torch.distributed.pipelining
            # passes it as given). Its backward still costs tb: the layers' input path runs to reach the
            # earlier layers' weights. Without this, autograd would drop _SleepInput's node there and that
            # side's first stage would sleep tw instead of tb, 20 ms less per micro-batch than the ideal.
            x = x.detach().requires_grad_()
        h = _SleepInput.apply(x, self.forward_s, self.input_s)
        # a view: a node between w and its accumulator, which autograd.grad (torch's W) can be asked about
        weight = self.weight.view_as(self.weight)
        return _ScaleWeight.apply(h, weight, self.weight_s, weight.grad_fn)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def _timed_pair(ours, theirs, steps: int, warmup: int) -> tuple[list[float], list[float]]:
    """Alternate one step of each side, timed between barriers, so load changes hit both alike."""
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(warmup + steps):
        for side, run_step in enumerate((ours, theirs)):
            dist.barrier()
            start = time.perf_counter()
            run_step()
            dist.barrier()
            if i >= warmup:
                times[side].append(time.perf_counter() - start)
    return times


def _chunks(kind: str) -> int:
    from raydist.schedule.actions import chunks_per_rank

    return chunks_per_rank(kind, V)


def raydist_runner(kind: str, m: int, tf: float, tb: float, tw: float):
    from raydist.schedule.executor import PipelineExecutor
    from raydist.schedule.generators import make_schedule

    rank = dist.get_rank()
    v = _chunks(kind)
    chunks = [SleepStage(tf / v, tb / v, tw / v) for _ in range(v)]
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

    return step, bubbles


def torch_runner(kind: str, m: int, tf: float, tb: float, tw: float):
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage

    rank = dist.get_rank()
    batch = torch.randn((m * SHAPE[0],) + SHAPE[1:])
    target = torch.randn_like(batch)
    schedule_class = getattr(pipelining, TORCH_NAME[kind])
    cpu = torch.device("cpu")
    # Activation shapes are inferred at the first step (the static input_args path left middle stages
    # without output gradients in torch 2.13).
    if kind in ("gpipe", "1f1b"):
        schedule = schedule_class(PipelineStage(SleepStage(tf, tb, tw), rank, P, cpu), m, loss_fn=mse)
        first, last = rank == 0, rank == P - 1
    elif kind == "zbh1":  # ZB1P with one stage per rank
        schedule = schedule_class([PipelineStage(SleepStage(tf, tb, tw), rank, P, cpu)], m, loss_fn=mse)
        first, last = rank == 0, rank == P - 1
    elif kind == "zbv":  # the V: rank r holds stages r and 2P - 1 - r
        stages = [PipelineStage(SleepStage(tf / 2, tb / 2, tw / 2), s, 2 * P, cpu) for s in (rank, 2 * P - 1 - rank)]
        schedule = schedule_class(stages, m, loss_fn=mse)
        first = last = rank == 0
    else:
        stages = [PipelineStage(SleepStage(tf / V, tb / V, tw / V), c * P + rank, P * V, cpu) for c in range(V)]
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

    return step


def _bench(kinds: list[str], microbatches: list[int], tf: float, tb: float, tw: float, steps: int,
           warmup: int) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    for m in microbatches:
        for kind in kinds:
            if kind in ("zbh1", "zbv") and m < P:
                continue  # the zero-bubble schedules need M >= P
            step, bubbles = raydist_runner(kind, m, tf, tb, tw)
            ours, theirs = _timed_pair(step, torch_runner(kind, m, tf, tb, tw), steps, warmup)
            rows.append({"m": m, "kind": kind, "ours": ours, "theirs": theirs,
                         "bubble": statistics.median(bubbles[warmup:])})
    return rows


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
    header = (f"{'M':>3} {'schedule':<15} {'ideal ms':>9} {'raydist ms':>11} {'/ideal':>7} {'torch schedule':<30} "
              f"{'torch ms':>9} {'/ideal':>7} {'raydist/torch':>14} {'bubble: measured':>17} {'unit-cost theory':>17}")
    print(header)
    print("-" * len(header))
    out = []
    for i, row in enumerate(per_rank[0]):
        m, kind = row["m"], row["kind"]
        v = _chunks(kind)
        ideal = ideal_step_time(kind, P, m, v, tf, tb, tw)
        # A step ends at a barrier on every rank, so any rank's median is the step time; take the slowest.
        ours = max(statistics.median(r[i]["ours"]) for r in per_rank)
        theirs = max(statistics.median(r[i]["theirs"]) for r in per_rank)
        bubble = statistics.mean(r[i]["bubble"] for r in per_rank)  # each rank's median step
        theory = float(theoretical_bubble(kind, P, m, v))
        label = kind + (f" V={v}" if kind == "interleaved" else "")
        print(f"{m:>3} {label:<15} {ideal * 1e3:>9.1f} {ours * 1e3:>11.1f} {ours / ideal:>7.3f} "
              f"{TORCH_NAME[kind]:<30} {theirs * 1e3:>9.1f} {theirs / ideal:>7.3f} {ours / theirs:>14.3f} "
              f"{bubble:>17.3f} {theory:>17.3f}")
        out.append({"m": m, "schedule": kind, "virtual_stages": v, "ideal_ms": round(ideal * 1e3, 2),
                    "raydist_ms": round(ours * 1e3, 2), "torch_schedule": TORCH_NAME[kind],
                    "torch_ms": round(theirs * 1e3, 2), "raydist_bubble": round(bubble, 4),
                    "theory_bubble_unit_costs": round(theory, 4)})
    if args.json:
        print(json.dumps({"benchmark": "pipeline_bubble", "ranks": P, "tf_ms": args.tf_ms, "tb_ms": args.tb_ms,
                          "tw_ms": args.tw_ms, "steps": args.steps, "rows": out}))


if __name__ == "__main__":
    main()
