"""A real local Ray head for tests: `ray start --head --block` with the dashboard and token auth on.

Every test cluster is isolated from any other Ray on the machine (other engineers' tests, a user's own
cluster): its own temp dir (so `ray.init()` elsewhere never finds it through /tmp/ray), its own free
ports, its own token file (RAY_AUTH_TOKEN_PATH; ~/.ray/auth_token is left alone). It is stopped by
process identity, never by name: `ray stop --force` would kill every Ray process on the machine. The
`ray start` process and all its descendants carry a marker environment variable; teardown ends the
process tree and then every process still carrying the marker (fake nodes that outlived their parent).

    with LocalHead(num_cpus=4) as head:
        head.ray("job", "submit", "--working-dir", ".", "--", "raydist", "train", ...)
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARKER = "RAYDIST_TEST_CLUSTER"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_ip() -> str:
    """The address `ray start` binds the GCS to (what fake nodes must be told to join)."""
    import ray._private.services

    return ray._private.services.get_node_ip_address()


# ---- processes by identity (Linux /proc) ------------------------------------------------------------


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # fields after "(comm)": state ppid ...


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid in _pids():
        parent = _ppid(pid)
        if parent is not None:
            children.setdefault(parent, []).append(pid)
    found, stack = set(), [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def marked(token: str) -> set[int]:
    """Processes whose environment holds MARKER=token (inherited from our `ray start`)."""
    needle = f"{MARKER}={token}".encode()
    out = set()
    for pid in _pids():
        try:
            if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                out.add(pid)
        except OSError:
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _signal_all(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while (alive := {p for p in pids if _alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


# ---- the head ----------------------------------------------------------------------------------------


class LocalHead:
    """`ray start --head --block` in a subprocess; `ray(...)` runs the Ray CLI as a client of it."""

    def __init__(self, num_cpus: int, autoscaling_config: dict | None = None, object_store_mb: int = 200):
        self.num_cpus = num_cpus
        self.autoscaling_config = autoscaling_config
        self.object_store_mb = object_store_mb
        self.id = secrets.token_hex(6)
        # Short: Ray's unix sockets live under it and socket paths must stay under 108 bytes.
        self.root = Path(tempfile.mkdtemp(prefix="rd-"))
        self.token_path = self.root / "auth_token"
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        self.gcs_address = f"{node_ip()}:{self.gcs_port}"
        self.log_path = self.root / "head.log"
        self.proc: subprocess.Popen | None = None

    # The environment every process of this cluster and every client call gets.
    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        for key in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_API_SERVER_ADDRESS"):
            env.pop(key, None)
        bin_dir = str(Path(sys.executable).parent)
        env.update(PATH=bin_dir + os.pathsep + env.get("PATH", ""), RAY_AUTH_MODE="token",
                   RAY_AUTH_TOKEN_PATH=str(self.token_path), RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1",
                   # A default corpus prepared by a job goes here, not into the user's ~/.cache.
                   RAYDIST_CACHE=str(self.root / "cache"))
        env.update(extra)
        return env

    def start(self, timeout_s: float = 120) -> "LocalHead":
        self.token_path.write_text(secrets.token_hex(32))
        self.token_path.chmod(0o600)
        cmd = [self._ray_bin(), "start", "--head", "--block", f"--temp-dir={self.root / 'ray'}",
               f"--port={self.gcs_port}", f"--dashboard-port={self.dashboard_port}", "--dashboard-host=127.0.0.1",
               f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
               f"--num-cpus={self.num_cpus}", f"--object-store-memory={self.object_store_mb * 2**20}",
               "--disable-usage-stats"]
        extra = {MARKER: self.id}
        if self.autoscaling_config is not None:
            config = dict(self.autoscaling_config)
            # Fake nodes join the GCS at provider.gcs_address (Ray's default is this machine's port 6379).
            config["provider"] = dict(config["provider"], gcs_address=self.gcs_address)
            path = self.root / "autoscaling.json"
            path.write_text(json.dumps(config))
            cmd.append(f"--autoscaling-config={path}")
            extra.update(RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=self.env(**extra), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait_ready(timeout_s)
        return self

    def _ray_bin(self) -> str:
        return str(Path(sys.executable).parent / "ray")

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.dashboard_url}/api/gcs_healthz", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"the head was not ready after {timeout_s:.0f}s:\n{self.log_path.read_text()[-3000:]}")

    def ray(self, *args: str, timeout_s: float = 300, check: bool = False, token: bool = True,
            cwd: Path = REPO) -> subprocess.CompletedProcess:
        """The Ray CLI as a client of this cluster (RAY_ADDRESS = the dashboard, token auth on)."""
        env = self.env(RAY_ADDRESS=self.dashboard_url)
        if not token:
            env.pop("RAY_AUTH_MODE")
            env.pop("RAY_AUTH_TOKEN_PATH")
            env["HOME"] = str(self.root / "no-home")  # not even ~/.ray/auth_token
        return subprocess.run([self._ray_bin(), *args], env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=timeout_s, check=check)

    def stop(self) -> None:
        if self.proc is not None:
            tree = descendants(self.proc.pid) | {self.proc.pid} | marked(self.id)
            if self.proc.poll() is None:
                # `ray start --block` stops its children gracefully, one after another: an idle head in 2.5 s
                # here, one that has run a job never within 8 s (test_job_submit.py's teardown after its
                # autoscaling job: 8.3 s each run), so the SIGKILLs below end the rest either way
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    pass
            left = {p for p in tree | marked(self.id) if _alive(p)}
            _signal_all(left, signal.SIGKILL)
            left = _wait_gone(left, 10)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
            if left:
                raise RuntimeError(f"test cluster processes still alive after SIGKILL: {sorted(left)}")
        shutil.rmtree(self.root, ignore_errors=True)

    def leftover_processes(self) -> set[int]:
        return {p for p in marked(self.id) if _alive(p)}

    def __enter__(self) -> "LocalHead":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def job_status(head: LocalHead, job_id: str) -> str:
    """SUCCEEDED / FAILED / STOPPED / RUNNING / PENDING, as `ray job status` prints it."""
    result = head.ray("job", "status", job_id, timeout_s=60)
    out = result.stdout + result.stderr
    for phrase, status in (("succeeded", "SUCCEEDED"), ("failed", "FAILED"), ("was stopped", "STOPPED")):
        if f"Job '{job_id}' {phrase}" in out:
            return status
    match = re.search(rf"Status for job '{re.escape(job_id)}': (\w+)", out)
    if match is None:
        raise AssertionError(f"no status for {job_id} in:\n{out[-2000:]}")
    return match.group(1)
