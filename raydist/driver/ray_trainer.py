"""The TorchTrainer a raydist run starts: Ray Train's own, with three of its defaults changed.

- An elastic run's group is sized by `FreshViewScalingPolicy` (raydist.elastic.fresh_view), from the nodes
  alive now, not as Ray Data's coordinator saw them at its last 20-second tick.
- No Ray Data `DatasetManager`. Ray Train's `DatasetsCallback` (DataParallelTrainer._create_default_callbacks,
  Ray 2.60) creates one actor per worker-group start, in `before_init_train_context`, whether or not the run
  passed any datasets, and hands it to every worker as the `dataset_shard_provider` of `get_dataset_shard`.
  raydist passes Ray Train no datasets (each rank streams its own rows, raydist.data.stream), so that actor
  only costs a process per start: its import of Ray Data, on the controller's node, beside the workers'
  start (1.6 s of CPU each, 34 s over the Ray tests of one suite run, tests/ray). Where no datasets are
  passed the callback is left out: the workers' `dataset_shard_provider` is then None (its default, read
  only by `get_dataset_shard`, which raydist never calls), and the DataContext it would copy to the workers
  is Ray Data's default. A trainer given datasets keeps it.
- No PlacementGroupCleaner on a cluster this driver started without a dashboard (an embedded cluster,
  raydist.driver.ray_cluster.embedded_dashboard). Ray Train's PlacementGroupCleanerCallback starts a detached
  actor per run that asks the dashboard's state API every second whether the controller is alive, to
  remove the run's placement group if it died. Without a dashboard every ask fails and the cleaner only
  keeps monitoring, so it can never clean; such a cluster ends with its driver, placement groups and all.
  It costs a process per run (2 s of CPU here) and a request a second. On any other cluster it stays.

All are Ray Train internals: each is used only where the installed Ray has what it relies on
(`fresh_view_supported`, `_create_default_callbacks`, the callback classes and Ray's record of the node this
process started), and otherwise Ray Train's own behaviour runs.
"""

from __future__ import annotations

from ray.train.torch import TorchTrainer

from raydist.elastic.fresh_view import FreshViewScalingPolicy, fresh_view_supported

try:  # Ray Train internals (checked in `left_out`)
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
except ImportError:  # pragma: no cover (another Ray: its default callbacks run as they are)
    DatasetsCallback = PlacementGroupCleanerCallback = None


def started_here_without_dashboard() -> bool:
    """Whether this process started the Ray cluster it is connected to (`ray.init` of a new local cluster), with
    no dashboard. A driver that joined a cluster holds a node record that is not the head's."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    params = getattr(node, "_ray_params", None)
    return getattr(node, "head", False) is True and getattr(params, "include_dashboard", None) is False


def left_out(datasets) -> tuple[type, ...]:
    """The classes of Ray Train's default callbacks a trainer given `datasets` leaves out here."""
    out = []
    if not datasets and DatasetsCallback is not None:
        out.append(DatasetsCallback)
    if PlacementGroupCleanerCallback is not None and started_here_without_dashboard():
        out.append(PlacementGroupCleanerCallback)
    return tuple(out)


class Trainer(TorchTrainer):
    """TorchTrainer with an elastic run sized from the alive nodes, no DatasetManager without datasets and no
    PlacementGroupCleaner where it cannot work."""

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        if self.scaling_config.elasticity_enabled and fresh_view_supported():
            controller_init_kwargs["scaling_policy"] = FreshViewScalingPolicy(self.scaling_config)
        return super()._initialize_and_run_controller(**controller_init_kwargs)

    def _create_default_callbacks(self):
        unused = left_out(self.datasets)
        return [c for c in super()._create_default_callbacks() if not isinstance(c, unused)]
