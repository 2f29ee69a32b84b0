"""The pipeline bubble measured on 4 processes, against the theory and against torch.distributed.pipelining.

Every stage is a sleep: its forward sleeps tf and its backward tb (an autograd Function whose backward
sleeps), so compute cost is fixed and known and the 2 CPU cores of a dev machine do not distort it (a
sleeping process leaves the core free). With P = 4 ranks and M micro-batches the ideal step is

    1F1B / GPipe:        (M + P - 1) (tf + tb)
    interleaved, V = 2:  (M + (P - 1) / V) (tf + tb)     (each chunk sleeps tf / V and tb / V)

(seed 001/003: bubble (P - 1) / (M + P - 1); Narayanan et al. 2021 for interleaving). For each M in
{4, 8, 16} this prints the measured step time of raydist's executor over the ideal, the same ratio for
torch.distributed.pipelining's Schedule1F1B (ScheduleGPipe, ScheduleInterleaved1F1B for the other rows)
on the same sleep stages, the ratio raydist / torch, and the bubble raydist's executor reports
(idle / wall: what training logs as pp_bubble; median step, mean over ranks) next to the theory.
Steps are timed between barriers on every rank, raydist and torch alternating step by step; medians
over the measured steps. One run, side by side.

    python benchmarks/pipeline_bubble.py [--tf-ms 20] [--tb-ms 40] [--steps 5] [--warmup 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from raydist.runtime import spawn

P, V = 4, 2
SHAPE = (1, 4, 8)  # (B_micro, T, D) of the activations passed between stages: tiny, the cost is the sleep


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, forward_s, backward_s):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        ctx.save_for_backward(x, weight)
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        x, weight = ctx.saved_tensors
        return grad * weight, (grad * x).sum().reshape(weight.shape), None, None


class SleepStage(nn.Module):
    """y = x * w, with a forward that sleeps forward_s and a backward that sleeps backward_s."""

    def __init__(self, forward_s: float, backward_s: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.weight, self.forward_s, self.backward_s)


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


def raydist_runner(kind: str, m: int, tf: float, tb: float):
    from raydist.schedule.executor import PipelineExecutor
    from raydist.schedule.generators import make_schedule

    rank = dist.get_rank()
    v = V if kind == "interleaved" else 1
    chunks = [SleepStage(tf / v, tb / v) for _ in range(v)]
    executor = PipelineExecutor(chunks, make_schedule(kind, P, m, v), rank, None,
                                activation_shape=SHAPE, loss_fn=mse)
    inputs = [torch.randn(SHAPE) for _ in range(m)]
    targets = [torch.randn(SHAPE) for _ in range(m)]
    bubbles = []

    def step():
        stats = executor.step(inputs, targets)
        bubbles.append(stats.bubble_fraction)

    return step, bubbles


def torch_runner(kind: str, m: int, tf: float, tb: float):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    rank = dist.get_rank()
    batch = torch.randn((m * SHAPE[0],) + SHAPE[1:])
    target = torch.randn_like(batch)
    # Activation shapes are inferred at the first step (the static input_args path left middle stages
    # without output gradients in torch 2.13).
    if kind in ("gpipe", "1f1b"):
        stage = PipelineStage(SleepStage(tf, tb), rank, P, torch.device("cpu"))
        schedule = (Schedule1F1B if kind == "1f1b" else ScheduleGPipe)(stage, m, loss_fn=mse)
        first, last = rank == 0, rank == P - 1
    else:
        stages = [PipelineStage(SleepStage(tf / V, tb / V), c * P + rank, P * V, torch.device("cpu"))
                  for c in range(V)]
        schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=mse)
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

    return step, None


def _bench(microbatches: list[int], tf: float, tb: float, steps: int, warmup: int) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    for m in microbatches:
        for kind in ("gpipe", "1f1b", "interleaved"):
            step, bubbles = raydist_runner(kind, m, tf, tb)
            ours, theirs = _timed_pair(step, torch_runner(kind, m, tf, tb)[0], steps, warmup)
            bubble = statistics.median(bubbles[warmup:])
            rows.append({"m": m, "kind": kind, "ours": ours, "theirs": theirs, "bubble": bubble})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tf-ms", type=float, default=20.0, help="forward sleep per micro-batch per rank")
    parser.add_argument("--tb-ms", type=float, default=40.0, help="backward sleep per micro-batch per rank")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    tf, tb = args.tf_ms / 1000, args.tb_ms / 1000

    from raydist.schedule.timeline import ideal_step_time, theoretical_bubble

    per_rank = spawn(_bench, P, args.microbatches, tf, tb, args.steps, args.warmup, timeout_s=900)
    print(f"P={P} ranks (gloo, 1 thread each), tf={args.tf_ms:g} ms, tb={args.tb_ms:g} ms, "
          f"median of {args.steps} steps after {args.warmup} warm-up; interleaved V={V}")
    header = (f"{'M':>3} {'schedule':<15} {'ideal ms':>9} {'raydist ms':>11} {'/ideal':>7} "
              f"{'torch ms':>9} {'/ideal':>7} {'raydist/torch':>14} {'bubble: measured':>17} {'theory':>7}")
    print(header)
    print("-" * len(header))
    for i, row in enumerate(per_rank[0]):
        m, kind = row["m"], row["kind"]
        v = V if kind == "interleaved" else 1
        ideal = ideal_step_time(kind, P, m, v, tf, tb)
        # A step ends at a barrier on every rank, so any rank's median is the step time; take the slowest.
        ours = max(statistics.median(r[i]["ours"]) for r in per_rank)
        bubble = statistics.mean(r[i]["bubble"] for r in per_rank)  # each rank's median step
        theory = float(theoretical_bubble(kind, P, m, v))
        label = kind + (f" V={v}" if v > 1 else "")
        line = f"{m:>3} {label:<15} {ideal * 1e3:>9.1f} {ours * 1e3:>11.1f} {ours / ideal:>7.3f} "
        t = max(statistics.median(r[i]["theirs"]) for r in per_rank)
        line += f"{t * 1e3:>9.1f} {t / ideal:>7.3f} {ours / t:>14.3f} "
        print(line + f"{bubble:>17.3f} {theory:>7.3f}")


if __name__ == "__main__":
    main()
