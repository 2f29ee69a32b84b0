"""The TorchTrainer a raydist run starts: Ray Train's own, with two of its defaults changed.

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

Both are Ray Train internals: each is used only where the installed Ray has what it relies on
(`fresh_view_supported`, `_create_default_callbacks` and the callback class), and otherwise Ray Train's own
behaviour runs.
"""

from __future__ import annotations

from ray.train.torch import TorchTrainer

from raydist.elastic.fresh_view import FreshViewScalingPolicy, fresh_view_supported

try:  # a Ray Train internal (checked in `without_datasets_callback`)
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
except ImportError:  # pragma: no cover (another Ray: its default callbacks run as they are)
    DatasetsCallback = None


def without_datasets_callback(callbacks: list, datasets) -> list:
    """Ray Train's default callbacks less its DatasetsCallback, for a trainer given no datasets."""
    if datasets or DatasetsCallback is None:
        return callbacks
    return [c for c in callbacks if not isinstance(c, DatasetsCallback)]


class Trainer(TorchTrainer):
    """TorchTrainer with an elastic run sized from the alive nodes and no DatasetManager without datasets."""

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        if self.scaling_config.elasticity_enabled and fresh_view_supported():
            controller_init_kwargs["scaling_policy"] = FreshViewScalingPolicy(self.scaling_config)
        return super()._initialize_and_run_controller(**controller_init_kwargs)

    def _create_default_callbacks(self):
        return without_datasets_callback(super()._create_default_callbacks(), self.datasets)
