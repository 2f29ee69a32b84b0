"""Peak resident memory per rank while the model is constructed, against 4N/p, for FSDP over p = 1, 2, 4.

Each rank (gloo, CPU) starts from its resident set after imports and process-group setup (the baseline),
resets the kernel's peak counter (/proc/self/clear_refs), builds, and reads the peak (VmHWM) at the end of
construction and, for the Trainer, after the step-0 validation loss (one forward of a validation batch; before
any optimizer state exists): the peak reported is the larger. Two ways, side by side in one run:

    meta   the Trainer: model on the meta device, FSDP applied there, `to_empty` allocates each rank's
           shards, init keyed by parameter name (raydist.models.init)
    eager  what the Trainer did before: the whole fp32 model built on every rank, then sharded

The figure to read is the peak above the baseline against 4N/p (this rank's share of the fp32 weights):
eager stays at or above 4N whatever p; meta holds 4N/p after construction (init writes one ~4 MiB
generator block at a time straight into the shards) and peaks in the validation forward, where FSDP
gathers units. `--trace` prints the resident set as each unit's forward starts and ends. Measured with
`--preset 750m` (953M parameters, 4N = 3636 MiB), FSDP 4, MiB above the baseline (2 CPU cores, glibc):

    1042  after construction: 909 of shards (4N/p) + 87 of file-backed pages (torch's code first run:
          FSDP, gloo, the init kernels) + ~46 of anonymous memory (process groups, Python state)
    +755  as the embedding's forward starts: the embedding gathered (250) and FSDP2's all-gather output
          for it (250: FSDP2 keeps a unit's all-gather buffer until the next unit's copy-out), block 0's
          prefetched all-gather output (196), activations and bookkeeping (~60)
    +196  the peak (1993) during that prefetch: one more block-sized buffer while the all-gather runs
          Each block's forward then holds 2-3 block-sized buffers (196 each) and stays below the peak;
          the head (250, a unit of its own, kept gathered for the backward) is gathered only at the end.

So the overhead above 4N/p is what FSDP needs to compute, about 2 x the largest unit + 2 x a block here,
which does not shrink with p: 1084 MiB over 909 at p = 4. The whole model at fp32 (4N) is never reached for p >= 2.
Before the head became a unit of its own (raydist.parallel.fsdp) the root gathered it, with its buffer,
as the forward started: 2231 MiB. With 2 validation micro-batches per rank (p = 2 here) the head is
still gathered from the first when the second starts.

    python benchmarks/build_memory.py [--d-model 1024 --layers 8 --ffn 2816 --vocab 32000] [--p 1 2 4] [--json]
    python benchmarks/build_memory.py --preset 750m     # the issue's case: d_model 2048, 16 layers, ffn 5632
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile

import torch

from raydist.config import Config
from raydist.parallel.runtime import spawn

PRESETS = {"750m": dict(d_model=2048, layers=16, ffn=5632, heads=16, kv_heads=16, vocab=32000)}


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current resident set (Linux >= 4.0)
        return True
    except OSError:
        return False


def _local_bytes(model) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in model.parameters())


def _trace_units(model, baseline_kib: int, marks: list) -> list:
    """Forward hooks on the FSDP units (input embedding, blocks, final norm + head) that record the resident
    set and its peak above `baseline_kib` as each starts (after FSDP's pre-forward gathered it) and ends
    (after its post-forward resharded it): where the validation forward's memory goes."""
    units = [("embedding", model.tok_embeddings)] + [(f"block {i}", b) for i, b in model.layers.items()]
    units += [("norm", model.norm), ("head", model.output)]

    def record(label):
        def hook(*_):
            marks.append((label, (_rss_kib("VmRSS") - baseline_kib) / 1024, (_rss_kib("VmHWM") - baseline_kib) / 1024))
        return hook

    handles = []
    for name, module in units:
        handles.append(module.register_forward_pre_hook(record(f"{name} in")))
        handles.append(module.register_forward_hook(record(f"{name} out")))
    return handles


def _build_on_rank(raw: dict, mode: str, trace: bool = False) -> dict:
    import torch.distributed as dist

    from raydist.planner.policy import plan_layout
    from raydist.training.trainer import Trainer

    cfg = Config.from_dict(raw)
    layout = plan_layout(cfg, dist.get_world_size())
    torch.zeros(1)  # touch the allocator before the baseline
    dist.barrier()
    baseline, file_baseline = _rss_kib("VmRSS"), _rss_kib("RssFile")
    exact = _reset_peak()
    val_peak, marks, file_backed = None, [], None
    if mode == "meta":
        trainer = Trainer(cfg, torch.device("cpu"), layout)
        model, close = trainer.pm.model, trainer.close
        build_peak = _rss_kib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        local = _local_bytes(model)  # before the forward: FSDP leaves the root's parameters gathered after it
        handles = _trace_units(model, baseline, marks) if trace else []
        marks.append(("built", (_rss_kib("VmRSS") - baseline) / 1024, (build_peak - baseline) / 1024))
        file_backed = (_rss_kib("RssFile") - file_baseline) / 1024  # code and data pages mapped from files
        trainer.loss_on(trainer.val_batch(0))  # the step-0 validation line: FSDP gathers each block in turn
        val_peak = _rss_kib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        marks.append(("validated", (_rss_kib("VmRSS") - baseline) / 1024, (val_peak - baseline) / 1024))
        for handle in handles:
            handle.remove()
    else:
        from raydist.models.gpt import build_model
        from raydist.parallel.parallelize import parallelize

        model = build_model(cfg.model, cfg.data.seq_len, cfg.train.seed)
        model = parallelize(model, layout.spec.build("cpu"), layout, torch.device("cpu")).model
        local = _local_bytes(model)
        close = lambda: None  # noqa: E731
    if val_peak is None:
        build_peak = _rss_kib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = build_peak if val_peak is None else val_peak
    close()
    dist.barrier()
    return {"baseline_mib": baseline / 1024, "peak_mib": peak / 1024, "above_baseline_mib": (peak - baseline) / 1024,
            "build_above_baseline_mib": (build_peak - baseline) / 1024,
            "local_param_mib": local / 2**20, "peak_exact": exact, "trace": marks if trace else None,
            "built_file_backed_mib": file_backed}


def config(args, data: str) -> dict:
    from raydist.testing import tiny_config

    model = dict(num_layers=args.layers, d_model=args.d_model, num_heads=args.heads, num_kv_heads=args.kv_heads,
                 ffn_hidden=args.ffn, vocab_size=args.vocab, tie_embeddings=False)
    return tiny_config(data, seq_len=32, model=model, train={"global_batch": 4, "micro_batch": 1, "eval_every": 1})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS))
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--p", type=int, nargs="+", default=[1, 2, 4], help="FSDP degrees (one process each)")
    p.add_argument("--modes", nargs="+", default=["meta", "eager"], choices=["meta", "eager"])
    p.add_argument("--json", action="store_true", help="also print one JSON line of every figure")
    p.add_argument("--trace", action="store_true",
                   help="meta: the resident set above the baseline as each FSDP unit's forward starts and ends")
    args = p.parse_args()
    for key, value in PRESETS.get(args.preset, {}).items():
        setattr(args, key, value)

    from raydist.config import DataConfig
    from raydist.data.prepare import prepare
    from raydist.models.gpt import param_counts

    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        prepare(DataConfig(corpus="stdlib", seq_len=32, max_corpus_mb=0.6, shard_rows=1024, val_fraction=0.15),
                data, log=lambda *_: None)
        raw = config(args, data)
        n = param_counts(Config.from_dict(raw).model)["total"]
        full_mib = 4 * n / 2**20
        print(f"model: {n / 1e6:.1f}M parameters, 4N = {full_mib:.0f} MiB (fp32); per rank, MiB:")
        print(f"{'mode':6} {'p':>2} {'4N/p':>8} {'local params':>13} {'peak-baseline':>14} {'(build only)':>13} "
              f"{'peak':>8} {'baseline':>9}")
        rows = []
        for mode in args.modes:
            for size in args.p:
                raw_p = json.loads(json.dumps(raw))
                raw_p["parallel"].update(dp_shard=size)
                ranks = spawn(_build_on_rank, size, raw_p, mode, args.trace, timeout_s=1200)
                worst = max(ranks, key=lambda r: r["above_baseline_mib"])
                rows.append({"mode": mode, "p": size, "share_mib": full_mib / size, **worst,
                             "ranks": ranks})
                print(f"{mode:6} {size:2d} {full_mib / size:8.0f} {worst['local_param_mib']:13.0f} "
                      f"{worst['above_baseline_mib']:14.0f} {worst['build_above_baseline_mib']:13.0f} "
                      f"{worst['peak_mib']:8.0f} {worst['baseline_mib']:9.0f}")
                if worst["trace"]:
                    print(f"    of the resident set after construction, {worst['built_file_backed_mib']:.0f} MiB above the "
                          "baseline is file-backed (pages of torch's libraries first touched)")
                    print("    resident / peak above baseline, MiB, as each unit's forward starts and ends:")
                    for label, now, high in worst["trace"]:
                        print(f"      {label:14} {now:7.0f} {high:7.0f}")
    if args.json:
        print(json.dumps({"benchmark": "build_memory", "params": n, "full_fp32_mib": full_mib, "rows": rows}))


if __name__ == "__main__":
    main()
