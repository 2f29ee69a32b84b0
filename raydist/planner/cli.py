"""`raydist plan`: rank parallel layouts for a config and a world size by the cost model.

    raydist plan workloads/gpt_tiny.toml --world 4 --device cpu [--calibrate] [--json] [--top 5]
    raydist plan CONFIG --world 16384 --gpus-per-node 8 --device h100
    raydist plan --from-run runs/NAME     # the plan for a run against what it measured
    raydist plan --published table        # predicted against measured for published runs, with the error
    raydist plan --published all          # the table, then Llama 3 405B and Megatron 1T: paper layout vs planner's best
"""

from __future__ import annotations

import argparse
import json

from raydist.config import Config, ConfigError
from raydist.planner.enumerate import ALL_FEATURES, implemented_features, plan
from raydist.planner.hardware import DEVICE_NAMES, config_signature, get_hardware
from raydist.planner.placement import Workload


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("plan", help="rank parallel layouts by estimated memory, step time and MFU",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="TOML config (model, seq_len, global_batch are read from it)")
    p.add_argument("--world", type=int, help="number of ranks (devices)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="devices per node (default: 8; cpu: --world)")
    p.add_argument("--device", default=None,
                   help=f"one of {', '.join(DEVICE_NAMES)} (default h100; with --from-run the run's own device)")
    p.add_argument("--top", type=int, default=5, help="plans to print (default 5)")
    p.add_argument("--json", action="store_true", help='print {"plans": [...]} as JSON, best first')
    p.add_argument("--calibrate", action="store_true",
                   help="measure alpha/beta, matmul peak and memory bandwidth with --world local processes "
                        "and store them for --device cpu plans")
    p.add_argument("--implemented-only", action="store_true",
                   help="only parallelisms this checkout implements (what parallel = \"auto\" uses)")
    p.add_argument("--published", choices=["all", "table", "llama3-405b", "megatron-1t"],
                   help="table: the cost model's predictions for published runs against what they measured; "
                        "llama3-405b / megatron-1t: a published layout against the planner's best; all: both")
    p.add_argument("--from-run", metavar="RUN_DIR",
                   help="the plan for a run's config and world against its measured step time, MFU and memory "
                        "(metrics.jsonl); a CPU run is priced on this machine's --calibrate figures; with "
                        "--calibrate, the workload's compute rate is fitted to this run's step first")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value (repeatable)")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    args.device = args.device.lower() if args.device else None
    if args.device is not None and args.device not in DEVICE_NAMES:
        raise ConfigError(f"--device {args.device!r} is not one of {', '.join(DEVICE_NAMES)}")
    if args.published:
        return _published(args)
    if args.from_run:
        if args.calibrate:
            from raydist.planner.from_run import calibrate_from_run

            record, scale = calibrate_from_run(args.from_run)
            if not args.json:
                print(f"calibrated on this machine, then the compute rate scaled x{scale:.3g} to the run's measured "
                      f"step; saved to {record['path']}")
        return _from_run(args)
    args.device = args.device or "h100"
    if args.calibrate:
        from raydist.planner.calibrate import calibrate, format_calibration

        if not args.world or args.world < 1:
            raise ConfigError("--calibrate needs --world N (the local processes to measure with)")
        cfg_for_calibration = Config.load(args.config, args.overrides) if args.config else None
        record = calibrate(args.world, config=cfg_for_calibration)
        if not args.json:
            print(format_calibration(record))
        if not args.config:
            if args.json:
                print(json.dumps({"calibration": record}, indent=1))
            return 0
        args.device = "cpu"
    if not args.config:
        raise ConfigError("raydist plan needs a CONFIG (e.g. workloads/gpt_tiny.toml) unless --published is given")
    if not args.world or args.world < 1:
        raise ConfigError(f"--world={args.world} must be a positive number of ranks, e.g. --world 8")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node={args.gpus_per_node} must be >= 1")
    cfg = Config.load(args.config, args.overrides)
    hw = get_hardware(args.device, args.world, args.gpus_per_node, config_signature(cfg))
    w = Workload.from_config(cfg, hw.compute_dtype_bytes, name=args.config)
    features = implemented_features() if args.implemented_only else ALL_FEATURES
    plans, counts = plan(w, args.world, hw, top=args.top, features=features)
    configured = configured_estimate(cfg, w, args.world, hw)
    if args.json:
        print(json.dumps({"plans": [e.to_dict() for e in plans], "world_size": args.world, "device": args.device,
                          "hardware": hw.to_dict(), "counts": counts,
                          "configured": configured if isinstance(configured, str) else configured.to_dict()},
                         indent=1))
        return 0 if plans else 1
    print(f"{args.config}: {w.model.num_layers} layers, d_model {w.model.d_model}, seq {w.seq_len}, "
          f"global batch {w.global_batch}, {'bf16' if w.compute_dtype_bytes == 2 else 'fp32'}")
    print(f"{args.world} x {hw.name} ({hw.gpus_per_node} per node), peak {hw.peak_flops / 1e12:.4g} TFLOP/s, "
          f"{hw.memory_bytes / 1e9:.3g} GB; links {_link(hw.intra)} intra, {_link(hw.inter)} inter; {hw.source}")
    print(f"searched {counts['considered']} layouts: {counts['fit']} fit, {counts['too_big']} too big, "
          f"{counts['invalid']} invalid" + ("" if features == ALL_FEATURES else
                                            f" (parallelisms limited to DP/FSDP + {sorted(features)})"))
    if isinstance(configured, str):
        print(f"    the config's own layout on {args.world}: {configured}")
    else:
        print(f"    the config's own layout: {configured.layout.describe()}, {configured.memory_gb:.3g} GB, step "
              f"{_seconds(configured.step_time_s)}, MFU {configured.mfu:.2%}: "
              + ("fits" if configured.fits else f"DOES NOT FIT in {configured.memory_limit_bytes / 1e9:.3g} GB"))
    if not plans:
        print("no layout fits: add devices, shrink the model or sequence, or lower train.global_batch")
        return 1
    print(f"{'#':>2}  {'layout':48s} {'memory':>9s} {'step':>10s} {'MFU':>7s} {'tokens/s':>10s}")
    have = implemented_features()
    for i, est in enumerate(plans, 1):
        tokens_per_s = w.tokens_per_step / est.step_time_s
        print(f"{i:>2}  {est.layout.describe():48s} {est.memory_gb:7.3g}GB {_seconds(est.step_time_s):>10s} "
              f"{est.mfu:7.2%} {tokens_per_s:10.4g}")
        for reason in est.reasons:
            print(f"      {reason}")
        missing = [f for f in ("tp", "cp", "pp") if getattr(est.layout, f) > 1 and f not in have]
        if missing:
            print(f"      needs {', '.join(missing)}: not implemented in this checkout yet (--implemented-only)")
    return 0


def configured_estimate(cfg: Config, w: Workload, world: int, hw):
    """The estimate for the layout the config itself trains with on `world` ranks (its [parallel] section,
    resolved as the runtime resolves it), or why it has none (a one-line reason)."""
    from raydist.planner.policy import plan_layout
    from raydist.planner.cost_model import estimate

    if cfg.parallel.auto:
        return "parallel = \"auto\": the planner's first choice above"
    try:
        layout = plan_layout(cfg, world)
    except ConfigError as exc:
        return f"invalid ({exc})"
    return estimate(w, layout, hw)


def _from_run(args) -> int:
    from raydist.planner.from_run import compare_run, format_comparison

    comparison = compare_run(args.from_run, args.device, args.gpus_per_node)
    print(json.dumps(comparison.to_dict(), indent=1) if args.json else format_comparison(comparison))
    return 0


def _published(args) -> int:
    from raydist.planner.published import PUBLISHED, compare, format_comparison, megatron_accounting
    from raydist.planner.published_runs import format_table, predict_all, summary

    out = {}
    if args.published in ("all", "table"):
        predictions = predict_all()
        if args.json:
            out["table"] = {"runs": [p.to_dict() for p in predictions], "summary": summary(predictions)}
        else:
            print(format_table(predictions))
            print()
    keys = {"all": list(PUBLISHED), "table": []}.get(args.published, [args.published])
    for key in keys:
        pub = PUBLISHED[key]
        result = compare(pub, top=args.top)
        if args.json:
            out[key] = {"published": result["published"].to_dict(),
                        "best": [e.to_dict() for e in result["best"]], "counts": result["counts"],
                        "megatron_accounting_gb": megatron_accounting(pub) / 1e9}
        else:
            print(format_comparison(pub, result))
            print()
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


def _link(link) -> str:
    return f"{link.alpha_s * 1e6:.3g}us/{link.beta_bytes_per_s / 1e9:.3g}GB/s"


def _seconds(value: float) -> str:
    return f"{value * 1e3:.4g} ms" if value < 1 else f"{value:.4g} s"
