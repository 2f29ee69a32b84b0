"""Pure schedule generators: GPipe, 1F1B (PipeDream-flush) and interleaved 1F1B (the zero-bubble
schedules ZB-H1 and ZB-V, which split the backward, live in `zero_bubble.py`).

With P ranks, M micro-batches and uniform per-micro-batch costs tf (forward) and tb (backward) for a whole
rank's layers, the step takes (the pipeline bubble: Huang et al. 2019, "GPipe"; Narayanan et al. 2021 for
1F1B and interleaving)

    GPipe, 1F1B:      T = (M + P - 1) (tf + tb)          bubble = (P - 1) / (M + P - 1)
    interleaved (V):  T = (M + (P - 1) / V) (tf + tb)    bubble = (P - 1) / (V M + P - 1)

1F1B has GPipe's bubble but stores at most P - r micro-batches of activations on rank r instead of M
(Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"):
after a warm-up of P - r - 1 forwards each rank alternates one forward and one backward, so a backward frees a
micro-batch as soon as a new one enters. Interleaving gives each rank V chunks of 1/V of its layers, which
shrinks the fill and drain of the pipeline V-fold.
"""

from __future__ import annotations

from raydist.errors import ConfigError
from raydist.schedule.actions import BACKWARD, FORWARD, Action, Schedule, check_dims


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards: every rank holds all M micro-batches' activations at the peak."""
    check_dims(num_ranks, num_microbatches, 1)
    ranks = []
    for r in range(num_ranks):
        forwards = [Action(FORWARD, r, m) for m in range(num_microbatches)]
        backwards = [Action(BACKWARD, r, m) for m in range(num_microbatches)]
        ranks.append(tuple(forwards + backwards))
    return Schedule("gpipe", num_ranks, num_microbatches, 1, tuple(ranks))


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """PipeDream-flush: warm-up min(P - r - 1, M) forwards, then alternate F and B, then drain the Bs."""
    check_dims(num_ranks, num_microbatches, 1)
    ranks = []
    for r in range(num_ranks):
        warmup = min(num_ranks - r - 1, num_microbatches)
        seq = [Action(FORWARD, r, m) for m in range(warmup)]
        for i in range(num_microbatches - warmup):
            seq += [Action(FORWARD, r, warmup + i), Action(BACKWARD, r, i)]
        seq += [Action(BACKWARD, r, m) for m in range(num_microbatches - warmup, num_microbatches)]
        ranks.append(tuple(seq))
    return Schedule("1f1b", num_ranks, num_microbatches, 1, tuple(ranks))


def interleaved_microbatch_problem(kind: str, num_ranks: int, num_microbatches: int,
                                   config_keys: bool = False) -> str | None:
    """Interleaved 1F1B runs micro-batches in groups of P: M must be a multiple of P (None when it is)."""
    if num_microbatches % num_ranks == 0:
        return None
    if config_keys:
        return (f"interleaved 1F1B needs the micro-batch count ({num_microbatches}) to be a multiple of "
                f"parallel.pp={num_ranks}; set parallel.num_microbatches accordingly")
    lower = (num_microbatches // num_ranks) * num_ranks
    options = f"{lower} or {lower + num_ranks}" if lower else f"{num_ranks}"
    return (f"interleaved 1F1B needs num_microbatches a multiple of the pipeline stages: M={num_microbatches}, "
            f"P={num_ranks}; use M={options}, or the 1f1b schedule")


def _interleaved_unit(k: int, num_ranks: int, virtual_stages: int, backward: bool) -> tuple[int, int]:
    """(chunk, micro-batch) of a rank's k-th forward (or backward) unit.

    Units go in groups of P micro-batches: P micro-batches through chunk 0, the same P through chunk 1,
    ..., then the next P micro-batches. Backwards visit the chunks in reverse (V-1 first).
    """
    group, within = divmod(k, num_ranks * virtual_stages)
    chunk = within // num_ranks
    if backward:
        chunk = virtual_stages - 1 - chunk
    return chunk, group * num_ranks + within % num_ranks


def interleaved(num_ranks: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Megatron's interleaved 1F1B: V chunks per rank (chunk c of rank r is virtual stage c*P + r).

    Rank r warms up with min(2 (P - r - 1) + (V - 1) P, M V) forward units, then alternates one forward
    and one backward unit, then drains the remaining backwards. M must be a multiple of P.
    """
    check_dims(num_ranks, num_microbatches, virtual_stages)
    if problem := interleaved_microbatch_problem("interleaved", num_ranks, num_microbatches):
        raise ConfigError(problem)
    total = num_microbatches * virtual_stages  # forward units (and backward units) per rank
    ranks = []
    for r in range(num_ranks):
        warmup = min(2 * (num_ranks - r - 1) + (virtual_stages - 1) * num_ranks, total)

        def unit(k: int, backward: bool) -> Action:
            chunk, m = _interleaved_unit(k, num_ranks, virtual_stages, backward)
            return Action(BACKWARD if backward else FORWARD, chunk * num_ranks + r, m)

        seq = [unit(k, False) for k in range(warmup)]
        for i in range(total - warmup):
            seq += [unit(warmup + i, False), unit(i, True)]
        seq += [unit(k, True) for k in range(total - warmup, total)]
        ranks.append(tuple(seq))
    return Schedule("interleaved", num_ranks, num_microbatches, virtual_stages, tuple(ranks))
