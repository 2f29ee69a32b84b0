"""Recovery time after a worker kill, split into its parts; checkpoint save throughput against raw writes.

Recovery (a local Ray, the default workload's model, 2 workers, a checkpoint every 10 steps, every
step logged): a training worker is SIGKILLed mid-run; from events.jsonl and metrics.jsonl:

    detection  kill -> the first surviving worker's `worker_error` (its collective failed); 0 when Ray
               Train's health check saw the dead actor first and removed the group before that
    restart    -> the new worker group's `launch` (Ray Train tore the group down and started another),
                  split by rank 0's new process (its `launch` event says when it started and when
                  raydist's train function was entered):
      group down + spawn  -> the new worker process started (the controller's next poll sees the error,
                             removes the group and its placement group, places a new one, forks workers);
                             `spare` when the process was a warm spare started before the kill
                             (elastic.warm_spares): its time is then all in `worker start`
      worker start        -> raydist's train function entered (import ray, Ray Train's worker actor and
                             train context, which import torch; the gloo process group; unpickling the
                             train function, which imports its module raydist.training.ray_session; a
                             spare imported all of these before the kill)
      entry               -> the `launch` event (raydist's imports, session, layout broadcast)
    load       -> the `restart` event (Trainer built: mesh, model, data; checkpoint verified and loaded)
    first step -> the first step completed after it

The recovery runs through `launch` as `raydist train` does (an embedded Ray with raydist's Ray Train
settings, raydist.driver.ray_cluster). --compare runs it a second time, first, with the settings raydist had
before (PREVIOUS: no warm spare processes), and prints both side by side. What the spares cost is shown
beside: the first attempt's steps 2-30 (the spares are asked for after step 1, and start and import while
those steps train) and each spare's memory at the kill, resident and proportional (PSS: shared pages
divided among the processes sharing them).

Live recovery, measured in the same run (`elastic.live_recovery`, dp_replicate 2, each replica one worker
and, with --live-shards 1,2, also two workers with FSDP inside: 4 workers): the last worker of replica 1 is
SIGKILLed; the surviving replica keeps stepping and Ray Train replaces only the victim's replica group:

    detection      kill -> the survivor's `replica_lost` (its quorum without the dead replica)
    survivor stall the longest gap between the survivor's consecutive steps from the kill on
    rejoin         the replacement's `replica_joined` time_to_rejoin_s (lost -> back in the quorum)
    restarts, steps_redone from summary.json (both 0: nothing restarted, nothing redone)

Save throughput (2 gloo processes, a model of --params parameters, fp32 weights + AdamW moments): a
blocking `CheckpointManager.save` (DCP shards + checksums + commit) against writing the same bytes as
one raw file per rank through fsspec to the same directory, best of --repeats each, as a ratio; and
what an asynchronous save stalls training (staging the state to host memory), also as a share of one
training step of a GPT of --params parameters on a rank's share of the default workload's batch.

    python benchmarks/recovery.py [--params 20e6] [--repeats 3] [--compare] [--skip-live] [--live-shards 1,2]
                                  [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import threading
import time

import torch

from raydist.config import Config
from raydist.parallel.runtime import spawn


def _lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# raydist's settings before warm spare processes (raydist.elastic.warm)
PREVIOUS = ["elastic.warm_spares=false"]
PARTS = ("detection", "restart", "group down + spawn", "worker start", "entry", "load", "first step")


def recovery(data_path: str, root: str, name: str = "recovery", overrides: list[str] = ()) -> dict:
    """One kill-and-restart run through `launch` (its embedded Ray); `overrides` are --set settings for this
    run only."""
    from raydist.driver.launcher import launch

    cfg = Config.load("workloads/gpt_tiny.toml", [f"data.path={data_path}", "data.reader=arrow", "train.steps=150",
                                                  "train.eval_every=0", "train.log_every=1",
                                                  "checkpoint.every_steps=10", "checkpoint.async_save=false",
                                                  f"checkpoint.storage={root}", f"train.run_name={name}",
                                                  *overrides])
    run_dir = os.path.join(root, name)
    saved = dict(os.environ)
    try:
        errors: list = []
        job = threading.Thread(target=lambda: errors.append(launch(cfg, log=lambda *_: None)), daemon=True)
        job.start()
        while not any(r["step"] >= 35 for r in _lines(os.path.join(run_dir, "metrics.jsonl"))):
            time.sleep(0.2)
        starts = [e for e in _lines(os.path.join(run_dir, "events.jsonl")) if e["kind"] == "start"]
        spares = _spares()  # (what the kill finds ready)
        killed_at = time.time()
        os.kill(starts[-1]["workers"][-1]["pid"], signal.SIGKILL)
        job.join(600)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    events = _lines(os.path.join(run_dir, "events.jsonl"))
    after = [e for e in events if e["time"] > killed_at]
    # the survivor's collective fails within ~0.1 s, unless Ray Train's health check saw the dead actor
    # first and removed the group before the survivor noticed: then the restart is counted from the kill
    error = min((e["time"] for e in after if e["kind"] == "worker_error"), default=killed_at)
    launch_event = min((e for e in after if e["kind"] == "launch"), key=lambda e: e["time"])
    launched = launch_event["time"]
    spawned = launch_event.get("process_started") or float("nan")
    entered = launch_event.get("entered") or float("nan")
    restarted = next(e for e in after if e["kind"] == "restart")
    first_step = next(r for r in _lines(os.path.join(run_dir, "metrics.jsonl"))
                      if r.get("attempt") == 2 and r["step"] > restarted["step"])
    first_step_time = restarted["time"] + (first_step["elapsed_s"] - restarted["elapsed_s"])
    spare = spawned < killed_at  # a warm spare process took rank 0's actor
    first_attempt = {r["step"]: r["elapsed_s"] for r in _lines(os.path.join(run_dir, "metrics.jsonl"))
                     if r.get("attempt") == 1}
    return {"detection": error - killed_at, "restart": launched - error,
            "group down + spawn": float("nan") if spare else spawned - error,
            "worker start": entered - (error if spare else spawned), "entry": launched - entered,
            "load": restarted["time"] - launched, "spare": spare,
            "first step": first_step_time - restarted["time"], "total": first_step_time - killed_at,
            "steps 2-30": first_attempt[30] - first_attempt[1], **spares,
            "resumed_step": restarted["step"], "steps_redone": restarted.get("steps_to_redo", 0)}


def _spares() -> dict:
    """The warm spare processes (raydist.elastic.warm) of the embedded cluster this process runs, idle and
    ready, and their memory: resident (RSS) and proportional (PSS: shared pages divided among the processes
    sharing them), per process."""
    import ray

    from raydist.elastic import warm

    def stat(pid, name):
        with open(f"/proc/{pid}/{name}") as f:
            return f.read()

    raylet = next((pid for pid in filter(str.isdigit, os.listdir("/proc")) if stat(pid, "stat").split(")")[0]
                   .endswith("(raylet") and stat(pid, "stat").split(")")[1].split()[1] == str(os.getpid())), None)
    job = ray.get_runtime_context().get_job_id()
    out = {}
    for kind, controller in (("worker", False), ("controller", True)):
        pids = warm.spare_pids(job, raylet, controller=controller, ready_only=True) if raylet else []
        kib = {k: [int(line.split()[1]) for pid in pids for line in stat(pid, f).splitlines() if line.startswith(k)]
               for k, f in (("VmRSS:", "status"), ("Pss:", "smaps_rollup"))}
        out.update({f"{kind} spares": len(pids), f"{kind} spare rss MiB": sum(kib["VmRSS:"]) / 1024 / max(len(pids), 1),
                    f"{kind} spare pss MiB": sum(kib["Pss:"]) / 1024 / max(len(pids), 1)})
    return out


def live_recovery(data_path: str, root: str, steps: int = 400, shard: int = 1) -> dict[str, float | None]:
    import ray

    from raydist.driver.launcher import launch
    from raydist.driver.ray_cluster import embedded_dashboard, train_env

    cfg = Config.load("workloads/gpt_tiny.toml", [f"data.path={data_path}", "data.reader=arrow", f"train.steps={steps}",
                                                  "train.eval_every=0", "train.log_every=1",
                                                  "checkpoint.every_steps=10", "checkpoint.async_save=false",
                                                  f"checkpoint.storage={root}", f"train.run_name=live{shard}",
                                                  "parallel.dp_replicate=2", f"parallel.dp_shard={shard}",
                                                  f"ray.num_workers={2 * shard}", f"ray.cpus_per_worker={1 / shard}",
                                                  "elastic.live_recovery=true", "elastic.collective_timeout_s=60"])
    run_dir = os.path.join(root, f"live{shard}")
    saved = dict(os.environ)
    os.environ.update(train_env(embedded=True))  # as raydist's own embedded cluster (raydist.driver.ray_cluster)
    ray.init(address="local", num_cpus=4, logging_level="warning", **embedded_dashboard())
    try:
        done: list = []
        job = threading.Thread(target=lambda: done.append(launch(cfg, log=lambda *_: None)), daemon=True)
        job.start()
        while not any(r["step"] >= 35 for r in _lines(os.path.join(run_dir, "metrics.jsonl"))):
            time.sleep(0.2)
        victim = next(e["pid"] for e in _lines(os.path.join(run_dir, "events.jsonl"))
                      if e["kind"] == "launch" and e.get("replica") == 1 and e.get("replica_rank") == shard - 1)
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        job.join(900)
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)
    summary = done[0] if done else {}
    events = _lines(os.path.join(run_dir, "events.jsonl"))
    lost = next((e for e in events if e["kind"] == "replica_lost"), None)
    joined = next((e for e in events if e["kind"] == "replica_joined"), None)
    metrics = _lines(os.path.join(run_dir, "metrics.jsonl"))
    offset = events[0]["time"] - events[0]["elapsed_s"]  # elapsed_s -> wall time (every record's origin)
    times = sorted(offset + r["elapsed_s"] for r in metrics if r.get("replicas"))
    after = [t for t in times if t >= killed_at]
    stall = max(b - a for a, b in zip([killed_at] + after, after)) if after else None
    step_s = statistics.median(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else None
    return {"detection": lost["time"] - killed_at if lost else None, "survivor stall": stall,
            "median step": step_s, "rejoin": joined["time_to_rejoin_s"] if joined else None,
            "lost_step": lost["step"] if lost else None, "joined_step": joined["step"] if joined else None,
            "restarts": summary.get("restarts"), "steps_redone": summary.get("steps_redone"),
            "steps_retried": summary.get("replica_steps_retried")}


def _step_s(params: int, world: int) -> float:
    """Seconds of one training step (forward, backward, AdamW) of a GPT of about `params` parameters on this
    rank's share of the default workload's batch (global_batch 16 x seq_len 128), measured on every rank at
    once (each rank's own copy, no gradient all-reduce: a lower bound of a data-parallel step): what an
    asynchronous save's stall is compared with."""
    from raydist.config import ModelConfig
    from raydist.models.gpt import build_model
    from raydist.models.loss import cross_entropy

    layers, width = 8, 512  # 8 x (attention 0.79M + SwiGLU 3 x 512 x ffn) + embedding 0.16M
    ffn = max(64, int((params / layers - 0.79e6) / (3 * width)) // 64 * 64)
    cfg = ModelConfig(num_layers=layers, d_model=width, num_heads=8, num_kv_heads=4, ffn_hidden=ffn)
    model = build_model(cfg, 128, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, cfg.vocab_size, (16 // world, 129), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(3):  # the first warms up (allocations, AdamW's moments)
        start = time.perf_counter()
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return min(times[1:])


def _save_vs_raw(params: int, directory: str, repeats: int, step: bool) -> dict[str, float]:
    import fsspec
    import torch.distributed as dist

    from raydist.checkpoint import CheckpointManager

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    n = params // world  # each rank holds its shard (as under FSDP): weights + 2 AdamW moments
    mesh = init_device_mesh("cpu", (world,))

    def shard() -> DTensor:
        return DTensor.from_local(torch.randn(n), mesh, [Shard(0)])

    state = {"model": {"w": shard()}, "optim": {"m": shard(), "v": shard()}}

    class Part:  # one stateful checkpoint part holding the three tensors
        def state_dict(self):
            return state

        def load_state_dict(self, _):
            pass

    parts = {"state": Part()}
    nbytes = 3 * n * 4
    group = dist.new_group(backend="gloo")
    manager = CheckpointManager(directory, keep=1, group=group, log=lambda *_: None)
    saves, raws, stalls = [], [], []
    for i in range(repeats):
        dist.barrier()
        stalls.append(manager.save(100 + i, parts, blocking=False))  # training waits this long
        manager.wait()
        dist.barrier()
        start = time.perf_counter()
        manager.save(i, parts, blocking=True)
        dist.barrier()
        saves.append(time.perf_counter() - start)
        blob = torch.cat([t.to_local() for t in (state["model"]["w"], state["optim"]["m"], state["optim"]["v"])])
        blob = blob.numpy().tobytes()
        dist.barrier()
        start = time.perf_counter()
        with fsspec.open(f"{directory}/raw_{rank}_{i}.bin", "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        dist.barrier()
        raws.append(time.perf_counter() - start)
    out = {"bytes": nbytes * world, "save_s": min(saves), "raw_s": min(raws), "async_stall_s": min(stalls)}
    if step:
        dist.barrier()
        out["step_s"] = _step_s(params, world)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=25e6, help="parameters (x 3 fp32 tensors: ~300 MB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-recovery", action="store_true", help="only the save throughput")
    parser.add_argument("--skip-live", action="store_true", help="no live-recovery measurement")
    parser.add_argument("--live-shards", default="1,2",
                        help="workers per replica (parallel.dp_shard) of the live-recovery runs, comma-separated")
    parser.add_argument("--skip-step", action="store_true",
                        help="do not time a training step of a model of --params parameters (the async stall's share)")
    parser.add_argument("--compare", action="store_true",
                        help="also measure the recovery with raydist's previous Ray Train settings, side by side")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = parser.parse_args()
    from raydist.driver.launcher import with_prepared_data

    cfg = Config.load("workloads/gpt_tiny.toml")
    cfg = with_prepared_data(cfg)
    r = before = None
    live: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_recovery:
            if args.compare:
                before = recovery(cfg.data.path, tmp, "recovery_before", PREVIOUS)
            r = recovery(cfg.data.path, tmp)
            if not args.skip_live:
                for shard in (int(v) for v in args.live_shards.split(",")):
                    live[shard] = live_recovery(cfg.data.path, tmp, shard=shard)
        t = spawn(_save_vs_raw, 2, int(args.params), os.path.join(tmp, "save"), args.repeats,
                  not args.skip_step)[0]
    if r is not None:
        print(f"\nworker kill -> first step after restart: {r['total']:.1f} s "
              f"(resumed at step {r['resumed_step']}, {r['steps_redone']} steps to redo)")
        if before is not None:
            print(f"  {'':<22} {'before':>7} {'now':>7}   (before: {' '.join(PREVIOUS)})")

        def secs(run, part):
            return "   spare " if part == "group down + spawn" and run["spare"] else f"{run[part]:6.2f} s "
        for part in PARTS + ("total",):
            indent = "    " if part in ("group down + spawn", "worker start", "entry") else "  "
            was = secs(before, part) if before is not None else ""
            print(f"{indent}{part:<{24 - len(indent)}} {was}{secs(r, part)}")
        print(f"  the first attempt's steps 2-30 (the spares start and import meanwhile): "
              + (f"before {before['steps 2-30']:.2f} s, " if before is not None else "") + f"now {r['steps 2-30']:.2f} s")
        for kind in ("worker", "controller"):
            print(f"  {kind} spares ready at the kill: {r[f'{kind} spares']}, each {r[f'{kind} spare rss MiB']:.0f} MiB "
                  f"resident ({r[f'{kind} spare pss MiB']:.0f} MiB proportional)")

    def seconds(v):
        return "n/a" if v is None else f"{v:.2f} s"

    for shard, run in live.items():
        print(f"\nlive recovery (worker kill, dp_replicate 2 x dp_shard {shard}): survivor stall "
              f"{seconds(run['survivor stall'])} (median step {seconds(run['median step'])}), detection "
              f"{seconds(run['detection'])}, replacement back in the quorum after {seconds(run['rejoin'])} (lost at "
              f"step {run['lost_step']}, joined at step {run['joined_step']}); restarts {run['restarts']}, steps "
              f"redone {run['steps_redone']}")
    mb = t["bytes"] / 2**20
    print(f"\ncheckpoint save of {mb:.0f} MiB (2 ranks): {t['save_s']:.2f} s = {mb / t['save_s']:.0f} MiB/s; "
          f"raw write of the same bytes {t['raw_s']:.2f} s = {mb / t['raw_s']:.0f} MiB/s; "
          f"save/raw throughput ratio {t['raw_s'] / t['save_s']:.2f}")
    print(f"an asynchronous save stalls training {t['async_stall_s']:.3f} s (staging to host memory), "
          f"{100 * t['async_stall_s'] / t['save_s']:.0f}% of the blocking save"
          + (f", {100 * t['async_stall_s'] / t['step_s']:.1f}% of a {t['step_s']:.2f} s training step of a "
             f"{args.params / 1e6:.0f}M-parameter GPT (8 x 128 tokens per rank)" if "step_s" in t else ""))
    if args.json:
        figures = {"save_mib": round(mb, 1), "save_s": round(t["save_s"], 4), "raw_s": round(t["raw_s"], 4),
                   "save_over_raw_throughput": round(t["raw_s"] / t["save_s"], 3),
                   "async_stall_s": round(t["async_stall_s"], 4)}
        if "step_s" in t:
            figures.update({"step_s": round(t["step_s"], 4),
                            "async_stall_share_of_step": round(t["async_stall_s"] / t["step_s"], 4)})
        for prefix, run in (("recovery", r), ("recovery_before", before)):
            if run is not None:
                figures.update({f"{prefix}_{k.replace(' + ', '_').replace(' ', '_')}_s": round(run[k], 3)
                                for k in PARTS + ("total",) if run[k] == run[k]})  # (NaN: a spare)
                figures[f"{prefix}_spare"] = run["spare"]
                figures.update({f"{prefix}_{k.replace(' ', '_').replace('-', '_')}": round(run[k], 3) if isinstance(
                    run[k], float) else run[k] for k in ("steps 2-30", "worker spares", "worker spare rss MiB",
                                                         "worker spare pss MiB", "controller spares",
                                                         "controller spare rss MiB", "controller spare pss MiB")})
        for shard, run in live.items():  # dp_shard 1 keeps the earlier names (live_...), others live_shard<N>_...
            prefix = "live_" if shard == 1 else f"live_shard{shard}_"
            figures.update({prefix + k.replace(' ', '_') + ("_s" if k in ("detection", "survivor stall", "median step",
                                                                         "rejoin") else ""):
                            (round(v, 3) if isinstance(v, float) else v) for k, v in run.items()})
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
