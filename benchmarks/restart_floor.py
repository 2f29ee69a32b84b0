"""Ray's own floor under a worker-group restart on this machine, with nothing of raydist's training in it.

    actors      2 trivial Ray actors created at once, each importing torch in its constructor: creation ->
                both ready (a fresh Python process each, `import ray`, `import torch`)
    ray train   a trivial 2-worker Ray Train V2 TorchTrainer (gloo) whose rank 1 exits mid-run while rank 0
                waits in a barrier: the exit -> the train function entered again on the restarted group
                (split at the new rank 0 process's start), and -> every new worker entered
    warm        the same restart with raydist's warm spares (raydist.elastic.warm): rank 0 asks for them,
                rank 1 exits once they are idle (started, imports done); the restarted group's processes
                are the spares, started before the exit

All on an embedded local Ray started with raydist's Ray Train settings (raydist.driver.ray_cluster.train_env) and
the job's setup hook (raydist.elastic.warm.job_runtime_env: it imports nothing in the cold runs' workers),
4 logical CPUs as `raydist train` starts it on this machine.

    python benchmarks/restart_floor.py [--repeats 2] [--json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import tempfile
import time

import ray


def _process_start_time() -> float:  # (a copy of raydist.training.ray_session's: nothing of raydist here)
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def actors(repeats: int) -> list[float]:
    import ray

    @ray.remote(num_cpus=1)
    class Torch:
        def __init__(self):
            import torch  # noqa: F401

        def ready(self) -> bool:
            return True

    times = []
    for _ in range(repeats):
        start = time.time()
        handles = [Torch.remote() for _ in range(2)]
        ray.get([h.ready.remote() for h in handles])
        times.append(time.time() - start)
        for h in handles:
            ray.kill(h)
        time.sleep(1)
    return times


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return sum(int(v) for v in f.read().rsplit(")", 1)[1].split()[11:13])  # utime + stime


def _wait_for_idle_spares(wanted: int) -> None:
    """Until `wanted` spares of each kind are started and used no CPU for a second (their imports done)."""
    from raydist.elastic import warm

    job = ray.get_runtime_context().get_job_id()
    while True:
        pids = [warm.spare_pids(job, controller=c, ready_only=True) for c in (False, True)]
        if all(len(p) >= wanted for p in pids):
            before = {pid: _cpu_ticks(pid) for p in pids for pid in p}
            time.sleep(1)
            if all(_cpu_ticks(pid) == ticks for pid, ticks in before.items()):
                return
        time.sleep(0.2)


def _train_fn(config: dict) -> None:
    import ray.train
    import torch.distributed as dist

    entered = time.time()
    d, rank = config["dir"], ray.train.get_context().get_world_rank()
    with open(os.path.join(d, f"enter_{os.getpid()}.json"), "w") as f:
        json.dump({"rank": rank, "entered": entered, "started": _process_start_time()}, f)
    if os.path.exists(os.path.join(d, "exited")):
        return  # the restarted group: done
    if rank == 0 and config["warm"]:
        from raydist.elastic import warm

        warm.request_spares(2, warm.CONTROLLER_ACTORS)
        _wait_for_idle_spares(2)
        open(os.path.join(d, "spares_ready"), "w").close()
    if rank == 1:
        while config["warm"] and not os.path.exists(os.path.join(d, "spares_ready")):
            time.sleep(0.1)
        time.sleep(3)
        with open(os.path.join(d, "exited"), "w") as f:
            f.write(repr(time.time()))
        os._exit(1)  # as a killed worker: no cleanup
    while True:  # rank 0: its barrier fails once the peer is gone
        dist.barrier()
        time.sleep(0.05)


def ray_train_restart(root: str, warm_spares: bool = False) -> dict[str, float]:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from raydist.elastic import warm

    d = tempfile.mkdtemp(dir=root)
    TorchTrainer(_train_fn, train_loop_config={"dir": d, "warm": warm_spares}, torch_config=TorchConfig(backend="gloo"),
                 scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                 run_config=RunConfig(name=os.path.basename(d), storage_path=root,
                                      failure_config=FailureConfig(max_failures=1),
                                      worker_runtime_env=warm.worker_runtime_env() if warm_spares else {})).fit()
    with open(os.path.join(d, "exited")) as f:
        exited = float(f.read())
    entries = []
    for path in glob.glob(os.path.join(d, "enter_*.json")):
        with open(path) as f:
            entries.append(json.load(f))
    new = [e for e in entries if e["entered"] > exited]
    rank0 = next(e for e in new if e["rank"] == 0)
    return {"exit -> new rank 0 process": rank0["started"] - exited,
            "-> its train function": rank0["entered"] - rank0["started"],
            "exit -> all new workers in their train function": max(e["entered"] for e in new) - exited}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = parser.parse_args()
    from raydist.elastic import warm
    from raydist.driver.ray_cluster import embedded_dashboard, train_env

    saved = dict(os.environ)
    os.environ.update(train_env(embedded=True))
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 4), logging_level="warning",
             runtime_env=warm.job_runtime_env(), **embedded_dashboard())
    try:
        started = actors(args.repeats)
        with tempfile.TemporaryDirectory() as root:
            restarts = [ray_train_restart(root) for _ in range(args.repeats)]
            warm_restarts = [ray_train_restart(root, warm_spares=True) for _ in range(args.repeats)]
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)
    print(f"2 actors importing torch, created at once -> both ready: "
          f"{', '.join(f'{t:.2f}' for t in started)} s (median {statistics.median(started):.2f} s)")
    print("trivial 2-worker Ray Train restart (gloo), a worker's exit ->")
    for key in restarts[0]:
        print(f"  {key:<50} {', '.join(f'{r[key]:.2f}' for r in restarts)} s")
    key, ahead = "exit -> all new workers in their train function", "exit -> new rank 0 process"
    print(f"  {key + ', warm spares':<50} {', '.join(f'{r[key]:.2f}' for r in warm_restarts)} s (their processes "
          f"started {', '.join(f'{-r[ahead]:.1f}' for r in warm_restarts)} s before the exit)")
    if args.json:
        figures = {"actors_torch_ready_s": round(statistics.median(started), 3)}
        figures.update({"ray_train_" + k.replace("->", "to").replace(" ", "_"): round(statistics.median(
            r[k] for r in restarts), 3) for k in restarts[0]})
        figures["ray_train_warm_exit_to_all_new_workers_in_their_train_function"] = round(statistics.median(
            r[key] for r in warm_restarts), 3)
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
