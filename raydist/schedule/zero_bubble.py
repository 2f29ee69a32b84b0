"""Zero-bubble schedules: the backward split into B (input gradient) and W (weight gradient).

Following Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism" (ICLR 2024). A layer y = x theta^T has
two backward products: dL/dx = dL/dy theta (B: the previous stage waits for it) and dL/dtheta =
dL/dy^T x (W: nobody waits for it until the optimizer step). 1F1B runs them together, so the gradient
crawls back through the pipeline at tb = B + W per stage; split, it moves at B per stage and the Ws fill
the idle slots. Costs below are per micro-batch through a rank's layers: F = tf, B = tb - tw, W = tw (the
paper's T_F, T_B, T_W; for a transformer layer T_B + T_W = 2 T_F and T_W < T_F < T_B).

ZB-H1 (`zbh1`, the paper's memory-efficient handcrafted schedule, its Figure 3 top): 1F1B's order of F
and B (rank r warms up with P - r - 1 forwards, then alternates F, B), with the W of micro-batch i run
right after the B of micro-batch i + r and the last r Ws at the end. The delay r makes every rank hold
the same P micro-batches in flight (F to W) that 1F1B's rank 0 holds, so the peak over ranks stays
1F1B's min(P, M), while B starts earlier on every rank and the late Ws fill the drain. Step time and
bubble (the paper's Table 2):

    T = M (F + B + W) + (P - 1)(F + B - W)        F = B = W = 1:  bubble = (P - 1) / (3 M + P - 1)

exact here whenever W <= F and W <= B (tests/unit/test_schedule_zero_bubble.py), against 1F1B's
(P - 1)(F + B + W) idle per rank: a third of it with equal costs (P = 4, M = 8: 1/9 against 3/11).

ZB-V (`zbv`, the paper's memory-efficient zero-bubble schedule): 2P chunks of half a rank's layers in a V
(rank r holds stages r and 2P - 1 - r, placement "v"), so each micro-batch starts and ends on rank 0 and
its backward starts as soon as its forward comes back, without a trip to the far end of the pipeline.
The paper lays it out as a warm-up of forwards, a steady 1F-1B-1W phase and a B-first drain with Ws in
the bubbles, found by a greedy heuristic under a memory limit of 1F1B's peak. We build it the same way: a
greedy list schedule for the given costs (default F = B = W, the paper's handcrafted case) that never
holds more than 2P chunk activations (F to W) = P micro-batches of a whole rank's layers. One rule is
ours: the executor matches point-to-point messages by order on each pair of ranks (NCCL), and each link
carries two kinds of message (r -> r+1: chunk-0 activations and chunk-1 gradients; r+1 -> r: chunk-1
activations and chunk-0 gradients), so every rank runs its chunk-0 Fs and chunk-1 Bs in one common order,
F^P (B F)^(M-P) B^P, and its chunk-1 Fs and chunk-0 Bs in the same pattern; the paper's free greedy can
order a link's two kinds differently at its two ends. At F = B = W, checked by `validate` and `simulate`
for every P <= 8, M in [P, 5P]:

    idle per rank = (P - 1) F / 2   the last rank's wait for its first input (a chunk's F costs F / 2):
                                    no V placement can idle less
    bubble = (P - 1) / (6 M + P - 1)                     half ZB-H1's idle; P = 4, M = 8: 1/17
    peak activations per rank = P micro-batches of a whole rank's layers = 1F1B's peak min(P, M)

The memory bound holds at any costs (the greedy enforces it). Built for realistic costs (T_W < T_F < T_B,
e.g. F = 1, B = 6/5, W = 4/5) it still beats ZB-H1; with extreme ones (B >= 3 F, W near 0, M = P + 1)
ZB-H1 can be faster.

Both need M >= P: ZB-H1's delayed Ws and ZB-V's link order assume P micro-batches fill the warm-up (with
fewer, ZB-H1 misses its formula: P = 3, M = 1 idles 4/7 of the step, not 2/5); use 1f1b.
"""

from __future__ import annotations

import heapq
from collections import deque
from fractions import Fraction

from raydist.errors import ConfigError
from raydist.schedule.actions import BACKWARD, FORWARD, WEIGHT, Action, Schedule, check_dims
from raydist.schedule.progress import ScheduleError


def microbatch_problem(kind: str, num_ranks: int, num_microbatches: int, config_keys: bool = False) -> str | None:
    """Both zero-bubble kinds need M >= P (their warm-up fills the pipeline with P micro-batches; see above):
    None when M is enough, else the problem in the generators' words or (config_keys) the config's."""
    if num_microbatches >= num_ranks:
        return None
    if config_keys:
        return (f"parallel.pp_schedule={kind!r} needs at least parallel.pp={num_ranks} micro-batches, got "
                f"{num_microbatches} (its warm-up fills the pipeline with P of them); raise "
                "parallel.num_microbatches (or train.global_batch) or use pp_schedule='1f1b'")
    return (f"{kind} needs num_microbatches >= pipeline stages: M={num_microbatches}, P={num_ranks}; "
            f"use M>={num_ranks}, or the 1f1b schedule")


def zbh1(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B's F/B order per rank, the W of micro-batch i after the B of micro-batch i + r on rank r
    (the paper's Figure 3, top: rank 1 of 4 runs ... B1 F4 B2 W1 F5 B3 W2 ... B6 W5 B7 W6 W7)."""
    check_dims(num_ranks, num_microbatches, 1)
    if problem := microbatch_problem("zbh1", num_ranks, num_microbatches):
        raise ConfigError(problem)
    p, m = num_ranks, num_microbatches
    ranks = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        seq = [Action(FORWARD, r, i) for i in range(warmup)]
        for i in range(m):
            if warmup + i < m:
                seq.append(Action(FORWARD, r, warmup + i))
            seq.append(Action(BACKWARD, r, i))
            if i >= r:
                seq.append(Action(WEIGHT, r, i - r))
        seq += [Action(WEIGHT, r, i) for i in range(max(m - r, 0), m)]
        ranks.append(tuple(seq))
    return Schedule("zbh1", p, m, 1, tuple(ranks))


def _stream(forward_chunk: int, backward_chunk: int, num_microbatches: int, lead: int) -> list[tuple[str, int, int]]:
    """[(kind, chunk, micro-batch)] in the order F^lead (B F)^(M - lead) B^lead, micro-batches ascending:
    the order of the messages one link carries in one direction."""
    kinds = [FORWARD] * lead + [BACKWARD, FORWARD] * (num_microbatches - lead) + [BACKWARD] * lead
    count = {FORWARD: 0, BACKWARD: 0}
    seq = []
    for kind in kinds:
        seq.append((kind, forward_chunk if kind == FORWARD else backward_chunk, count[kind]))
        count[kind] += 1
    return seq


def zbv(num_ranks: int, num_microbatches: int, tf: Fraction | int = 1, tb: Fraction | int = 2,
        tw: Fraction | int | None = None) -> Schedule:
    """ZB-V: two chunks per rank in a V, a greedy list schedule for the costs tf, tb, tw (`timeline`'s
    units; default F = B = W = 1, the paper's handcrafted case; see the module docstring).

    Event-driven with zero transfer time: whenever a rank is free it runs the first ready action of its
    chunk-1 F / chunk-0 B stream (moves micro-batches towards their end), its chunk-0 F / chunk-1 B
    stream, its oldest pending W. A forward never takes the rank past 2P held chunk activations (F to W):
    at the limit it yields to a pending W (the paper's memory recycling); with nothing else ready the
    pending Ws fill the bubble.
    """
    check_dims(num_ranks, num_microbatches, 2)
    if problem := microbatch_problem("zbv", num_ranks, num_microbatches):
        raise ConfigError(problem)
    tf, tb = Fraction(tf), Fraction(tb)
    tw = tb / 2 if tw is None else Fraction(tw)
    if not (tf > 0 and 0 <= tw <= tb):
        raise ScheduleError(f"zbv costs tf={tf}, tb={tb}, tw={tw}: need tf > 0 and 0 <= tw <= tb")
    cost = {FORWARD: tf, BACKWARD: tb - tw, WEIGHT: tw}
    p, m = num_ranks, num_microbatches
    last = 2 * p - 1  # the last virtual stage (rank 0, chunk 1)
    limit = 2 * p  # held chunk activations: P micro-batches of a whole rank's layers
    streams = (_stream(1, 0, m, p), _stream(0, 1, m, p))  # the same on every rank

    def stage(rank: int, chunk: int) -> int:
        return rank if chunk == 0 else last - rank

    finish: dict[Action, Fraction] = {}

    def ready(a: Action, now: Fraction) -> bool:
        deps = []
        if a.kind == FORWARD and a.stage > 0:
            deps.append(Action(FORWARD, a.stage - 1, a.microbatch))
        if a.kind == BACKWARD:
            deps.append(Action(FORWARD, a.stage, a.microbatch))
            if a.stage < last:
                deps.append(Action(BACKWARD, a.stage + 1, a.microbatch))
        return all(d in finish and finish[d] <= now for d in deps)

    position = [[0, 0] for _ in range(p)]
    held = [0] * p
    pending: list[deque[Action]] = [deque() for _ in range(p)]
    ranks: list[list[Action]] = [[] for _ in range(p)]
    free_at = [Fraction(0)] * p
    events = [Fraction(0)]  # heap of the times at which a rank frees up
    while events:
        now = heapq.heappop(events)
        while events and events[0] == now:
            heapq.heappop(events)
        for r in range(p):
            if free_at[r] > now:
                continue
            action = None
            for k, stream in enumerate(streams):
                if position[r][k] == len(stream):
                    continue
                kind, chunk, mb = stream[position[r][k]]
                candidate = Action(kind, stage(r, chunk), mb)
                if ready(candidate, now) and not (kind == FORWARD and held[r] >= limit):
                    action = candidate
                    position[r][k] += 1
                    break
            if action is None and pending[r]:
                action = pending[r].popleft()
            if action is None:
                continue
            if action.kind == FORWARD:
                held[r] += 1
            elif action.kind == BACKWARD:
                pending[r].append(Action(WEIGHT, action.stage, action.microbatch))
            else:
                held[r] -= 1
            ranks[r].append(action)
            finish[action] = free_at[r] = now + cost[action.kind]
            heapq.heappush(events, free_at[r])
    stalled = [r for r, seq in enumerate(ranks) if len(seq) < 6 * m]
    if stalled:  # never seen for any P, M, costs tried (tests/unit/test_schedule_zero_bubble.py)
        raise ScheduleError(f"zbv greedy stalled on rank {stalled[0]} at P={p}, M={m}, tf={tf}, tb={tb}, tw={tw} "
                            "(a bug in raydist.schedule.zero_bubble); use the zbh1 schedule")
    return Schedule("zbv", p, m, 2, tuple(tuple(seq) for seq in ranks), placement="v")
