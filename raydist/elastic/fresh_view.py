"""An elastic run's group size from the cluster as it is now, not as it was at the last 20-second tick.

Ray Train's ElasticScalingPolicy sizes a worker group from the resources Ray Data's AutoscalingCoordinator
reserved for it. The coordinator recomputes those reservations from `ray.nodes()` on a 20 s tick
(`_AutoscalingCoordinatorActor.TICK_INTERVAL_S`), and the policy asks it without `recompute`. When a node
dies, the group fails within a second, and the restart is sized from the last tick: still counting the
dead node's CPUs, it asks for every worker, the placement group can never be placed, and the run waits
out `elastic.group_start_timeout_s` (60 s by default) before the next try sees the smaller cluster.
Measured here on the node-loss test (tests/ray/test_node_loss.py): GCS marked the node dead, 0.56 s later
Ray Train decided to restart with 4 workers on what was then a 2-worker cluster, and the run trained again
about 60 s later. A node that joins is likewise seen only at the first resize check after the next tick.

`FreshViewScalingPolicy` asks with `recompute=True`, which runs one tick (the alive nodes from GCS) before
answering. It is asked at most once a second while a group is down (Ray's own rate limit,
`GET_RESERVED_RESOURCES_INTERVAL_S`) and once per `elastic.resize_check_interval_s` while it runs, so the
extra `ray.nodes()` calls are few. raydist.driver.ray_trainer.Trainer hands it to Ray Train's controller
in place of the policy Ray Train would make. Both are Ray Train internals: they are used only where the
installed Ray has them with the signatures read here (`fresh_view_supported`), and otherwise Ray Train's
own policy runs.
"""

from __future__ import annotations

import inspect

import ray
from ray.train.torch import TorchTrainer

try:  # Ray Train internals (checked in `fresh_view_supported`)
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import _AutoscalingCoordinatorActor
    from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy
    from ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client import \
        AUTOSCALING_REQUESTS_GET_TIMEOUT_S
    from ray.train.v2._internal.util import time_monotonic
except ImportError:  # pragma: no cover (another Ray: Ray Train's own policy runs)
    _AutoscalingCoordinatorActor = ElasticScalingPolicy = None


def fresh_view_supported() -> bool:
    """Whether this Ray has the policy, the controller hook and a coordinator that recomputes on request."""
    return (ElasticScalingPolicy is not None
            and "recompute" in inspect.signature(_AutoscalingCoordinatorActor.get_reserved_resources).parameters
            and hasattr(ElasticScalingPolicy, "_get_reserved_resources")
            and hasattr(TorchTrainer, "_initialize_and_run_controller"))


class FreshViewScalingPolicy(ElasticScalingPolicy or object):
    """Ray Train's elastic policy, its reservations recomputed from the alive nodes at each ask."""

    def _get_reserved_resources(self):
        if time_monotonic() - self._latest_reserved_resources_query_time < self.GET_RESERVED_RESOURCES_INTERVAL_S:
            return self._latest_reserved_resources
        reserved = None
        try:
            reserved = ray.get(self._autoscaling_coordinator.get_reserved_resources.remote(
                self._requester_id, recompute=True), timeout=AUTOSCALING_REQUESTS_GET_TIMEOUT_S)
        except Exception:  # as Ray's own: no decision this time, the next ask retries
            pass
        self._latest_reserved_resources_query_time = time_monotonic()
        self._latest_reserved_resources = reserved
        return reserved

