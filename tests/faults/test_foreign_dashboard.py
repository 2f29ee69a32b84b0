"""Another Ray cluster's dashboard on the machine must not be able to end this cluster's training.

Ray Train's PlacementGroupCleaner asks the state API whether the run's controller is alive and removes the
run's placement group (every worker dies) when the answer is "no such actor". With an embedded cluster that
records the default dashboard address (127.0.0.1:8265) while serving no dashboard, that answer came from
whichever other cluster served 8265: this is what tore whole live-recovery groups down mid-run. Here a
stand-in for that other cluster's dashboard answers "no such actor" on 8265 (or a real one already does),
and the cleaner's own check, run inside the cluster as the cleaner runs it, must not report a live actor
dead."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from ray_runs import ray_4cpu  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.ray]


class _ForeignDashboard(BaseHTTPRequestHandler):
    """The state API of a cluster that has never heard of our actors: every list is empty."""

    asked: ClassVar[list[str]] = []

    def do_GET(self):
        _ForeignDashboard.asked.append(self.path)
        body = json.dumps({"result": True, "msg": "", "data": {"result": {
            "result": [], "total": 0, "num_after_truncation": 0, "num_filtered": 0,
            "partial_failure_warning": None, "warnings": None}}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def foreign_dashboard():
    """A stand-in dashboard on 127.0.0.1:8265; None when something already serves that port (on a shared
    machine: usually another Ray cluster's real dashboard, the very case under test)."""
    try:
        server = ThreadingHTTPServer(("127.0.0.1", 8265), _ForeignDashboard)
    except OSError:
        yield None
        return
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_the_placement_group_cleaner_never_takes_a_live_controller_for_dead(foreign_dashboard, ray_4cpu):
    ray = ray_4cpu

    @ray.remote(num_cpus=0)
    class Alive:
        def actor_id(self) -> str:
            return ray.get_runtime_context().get_actor_id()

    @ray.remote(num_cpus=0)
    def cleaner_check(actor_id: str) -> str:
        # what PlacementGroupCleaner._monitor_loop does each second, with its own imports and timeout
        from ray.train.v2._internal.constants import GET_ACTOR_TIMEOUT_S
        from ray.train.v2._internal.state.util import is_actor_alive
        from ray.util.state.exception import RayStateApiException

        try:
            return "alive" if is_actor_alive(actor_id=actor_id, timeout=GET_ACTOR_TIMEOUT_S) else "dead"
        except RayStateApiException:
            return "unknown"  # the cleaner keeps monitoring

    actor = Alive.remote()
    # RAY_ADDRESS names this cluster's GCS: the cleaner finds it by looking for GCS processes, which on a
    # machine running several clusters is ambiguous (it caches the first it found alone)
    own_gcs = {"env_vars": {"RAY_ADDRESS": ray.get_runtime_context().gcs_address}}
    verdict = ray.get(cleaner_check.options(runtime_env=own_gcs).remote(ray.get(actor.actor_id.remote())),
                      timeout=120)
    ray.kill(actor)
    assert verdict != "dead", "the cleaner would remove this run's placement group and kill every worker"
    if foreign_dashboard is not None:
        assert not _ForeignDashboard.asked, "this cluster's state API queries went to another cluster"
