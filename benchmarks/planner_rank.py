"""Does the planner rank layouts the way they really run? Calibrate, plan, measure, compare ranks.

1. `raydist plan --calibrate` for the workload at --world local gloo processes (alpha, beta, matmul peak,
   memory bandwidth, this model's forward/backward rate and recompute cost);
2. the planner ranks every layout of --world ranks (all parallelisms);
3. the first --measure layouts in the planner's order that this checkout can build (a layout whose
   Trainer raises because its parallelism is missing is skipped and printed), plus reference layouts
   (DDP / FSDP / HSDP with and without recompute) are trained side by side in one set of --world
   processes: every round runs --steps steps of each layout in turn, so slow spells of the shared
   machine hit all layouts alike; a layout's time is the best round's median (after warm-up) of the
   slowest rank's step time;
4. prints predicted vs measured, whether the planner's top three (among the buildable layouts) come in
   the measured order, and Spearman's rank correlation over all measured layouts.

    python benchmarks/planner_rank.py [--config workloads/gpt_tiny.toml] [--world 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from raydist.config import Config
from raydist.parallel.runtime import spawn
from raydist.planner.calibrate import calibrate, format_calibration
from raydist.planner.cost_model import Estimate
from raydist.planner.enumerate import ALL_FEATURES, enumerate_estimates
from raydist.planner.hardware import config_signature, get_hardware
from raydist.planner.placement import Layout, Workload

REFERENCES = [  # (mesh, micro_batch, policy): kept in the measured set to spread the ranking
    ({"dp_replicate": -1, "dp_shard": 1}, 4, "none"),
    ({"dp_replicate": 1, "dp_shard": -1}, 4, "none"),
    ({"dp_replicate": 2, "dp_shard": -1}, 4, "none"),
    ({"dp_replicate": -1, "dp_shard": 1}, 4, "full"),
    ({"dp_replicate": -1, "dp_shard": 1}, 4, "selective"),
    ({"dp_replicate": 1, "dp_shard": -1}, 1, "none"),
]


def _measure(config_path: str, layouts: list[dict], wanted: int, rounds: int, steps: int, warmup: int) -> dict:
    """On every rank: build Trainers in planner order until `wanted` ranked layouts are built (those that
    raise are skipped), plus every reference layout; then rounds of steps."""
    import torch.distributed as dist

    from raydist.training.trainer import Trainer

    trainers, skipped = {}, {}
    built_ranked = 0
    for item in layouts:
        if not item["reference"] and built_ranked >= wanted:
            continue
        if item["key"] in trainers:
            continue
        try:
            cfg = Config.load(config_path, [item["data"], "train.eval_every=0", "train.steps=100000"])
            trainers[item["key"]] = Trainer(cfg, torch.device("cpu"), Layout.from_dict(item["layout"]))
            built_ranked += 0 if item["reference"] else 1
        except Exception as exc:  # a parallelism this checkout does not implement yet, or a bad layout
            skipped[item["key"]] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        dist.barrier()
    times: dict[str, list[list[float]]] = {k: [] for k in trainers}  # per round, per step
    order = list(trainers)
    for r in range(rounds):
        rotated = order[r % len(order):] + order[:r % len(order)] if order else []
        for key in rotated:
            times[key].append([])
            for i in range(warmup + steps):
                dist.barrier()
                t = torch.tensor([trainers[key].train_step().step_time_s])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank ends
                if i >= warmup:
                    times[key][-1].append(float(t))
    for trainer in trainers.values():
        trainer.close()
    return {"times": times, "skipped": skipped}


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    if n < 2:
        return float("nan")
    d2 = sum((x - y) ** 2 for x, y in zip(ra, rb))
    return 1 - 6 * d2 / (n * (n * n - 1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="workloads/gpt_tiny.toml")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--measure", type=int, default=6, help="planner's top buildable layouts to measure")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--skip-calibrate", action="store_true", help="use the stored calibration")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)

    from raydist.driver.launcher import with_prepared_data
    from raydist.planner.enumerate import implemented_features

    from raydist.planner.policy import plan_layout

    cfg = with_prepared_data(Config.load(args.config))  # prepares the default corpus on first use
    data_override = f"data.path={cfg.data.path}"
    if not args.skip_calibrate:
        print(format_calibration(calibrate(args.world, config=cfg)), flush=True)
    hw = get_hardware("cpu", args.world, None, config_signature(cfg))
    workload = Workload.from_config(cfg, hw.compute_dtype_bytes)
    ranked, counts = enumerate_estimates(workload, args.world, hw, features=ALL_FEATURES)
    print(f"\nplanner: {counts['fit']} layouts fit ({hw.source})")

    by_key: dict[str, Estimate] = {}
    for est in ranked:
        by_key.setdefault(est.layout.describe(), est)
    references = []
    for mesh, micro_batch, policy in REFERENCES:
        spec = plan_layout(Config.load(args.config, [f"parallel.{k}={v}" for k, v in mesh.items()]
                                       + [f"train.micro_batch={micro_batch}", data_override]), args.world)
        for est in ranked:
            lay = est.layout
            if (lay.mesh() == spec.mesh() and lay.micro_batch == micro_batch and lay.activation_checkpoint == policy
                    and lay.fsdp_reshard_after_forward):
                references.append(lay.describe())
                break
    ranked_keys = list(by_key)[: args.measure * 5]  # spares for layouts that cannot be built yet
    # A mesh degree whose parallelism is not in this checkout would build and silently run as data
    # parallel (the degree unused), so such layouts are skipped up front rather than measured.
    have = implemented_features()
    missing = {k: sorted(f for f in ("tp", "cp", "pp") if getattr(by_key[k].layout, f) > 1 and f not in have)
               for k in ranked_keys}
    for key, features in missing.items():
        if features:
            print(f"  skipped {key}: {', '.join(features)} not implemented in this checkout")
    ranked_keys = [k for k in ranked_keys if not missing[k]]
    layouts = [{"key": k, "reference": k in references,
                "layout": by_key[k].layout.to_dict(), "data": data_override}
               for k in dict.fromkeys(ranked_keys + references)]
    start = time.time()
    result = spawn(_measure, args.world, args.config, layouts, args.measure, args.rounds, args.steps, args.warmup,
                   timeout_s=3000)[0]
    print(f"measured {len(result['times'])} layouts in {time.time() - start:.0f} s "
          f"({args.rounds} rounds x {args.steps} steps each, interleaved)")
    for key, why in result["skipped"].items():
        print(f"  skipped {key}: {why}")
    # A layout's time: the best round's median step. Other jobs share this machine; a round that they
    # slowed down says nothing about the layout.
    measured = {k: min(statistics.median(r) for r in v) for k, v in result["times"].items() if v}
    keys = list(measured)
    print(f"\n{'planner':>7} {'measured':>8}  {'layout':42s} {'predicted':>10} {'measured':>10} {'ratio':>6}")
    measured_rank = {k: i for i, k in enumerate(sorted(keys, key=lambda k: measured[k]))}
    for i, key in enumerate(sorted(keys, key=lambda k: by_key[k].step_time_s)):
        pred, got = by_key[key].step_time_s, measured[key]
        print(f"{i + 1:>7} {measured_rank[key] + 1:>8}  {key:42s} {pred * 1e3:8.1f}ms {got * 1e3:8.1f}ms "
              f"{got / pred:6.2f}")
    top3 = sorted(keys, key=lambda k: by_key[k].step_time_s)[:3]
    top3_measured = sorted(top3, key=lambda k: measured[k])
    agree = top3 == top3_measured
    rho = spearman([by_key[k].step_time_s for k in keys], [measured[k] for k in keys])
    print(f"\nplanner's top 3: {top3}")
    print(f"measured order : {top3_measured}  -> {'SAME ORDER' if agree else 'DIFFERENT ORDER'}")
    print(f"Spearman rank correlation over {len(keys)} layouts: {rho:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"predicted_s": {k: by_key[k].step_time_s for k in keys}, "measured_s": measured,
                       "all_times_s": result["times"], "skipped": result["skipped"], "top3_same_order": agree,
                       "spearman": rho}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
