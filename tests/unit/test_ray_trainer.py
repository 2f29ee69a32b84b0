"""raydist's TorchTrainer (raydist.driver.ray_trainer): Ray Train's default callbacks less the DatasetsCallback
when no datasets are passed, as raydist never does, and less the PlacementGroupCleanerCallback on a cluster
this process started without a dashboard; all of them otherwise. (A real run on such a cluster, which starts
neither actor and still trains: tests/ray/test_train_ray.py.)"""

from types import SimpleNamespace

import pytest
import ray
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer

from raydist.driver import ray_trainer
from raydist.driver.ray_trainer import Trainer

KWARGS = dict(scaling_config=ScalingConfig(num_workers=1))


def callback_names(trainer) -> list[str]:
    return [type(c).__name__ for c in trainer._create_default_callbacks()]


def test_the_pinned_ray_has_the_callbacks_where_they_are_read_from():
    assert ray_trainer.DatasetsCallback is not None and ray_trainer.PlacementGroupCleanerCallback is not None
    names = callback_names(TorchTrainer(lambda: None, **KWARGS))
    assert {"DatasetsCallback", "PlacementGroupCleanerCallback"} <= set(names)


def with_node(monkeypatch, node) -> None:
    monkeypatch.setattr(ray._private.worker, "_global_node", node)


@pytest.mark.parametrize("node, cleaner", [
    (None, True),  # not connected yet
    (SimpleNamespace(head=False, _ray_params=SimpleNamespace(include_dashboard=False)), True),  # joined a cluster
    (SimpleNamespace(head=True, _ray_params=SimpleNamespace(include_dashboard=None)), True),  # ray.init's default
    (SimpleNamespace(head=True, _ray_params=SimpleNamespace(include_dashboard=True)), True),
    (SimpleNamespace(head=True, _ray_params=SimpleNamespace(include_dashboard=False)), False),  # embedded
], ids=["unconnected", "joined", "default-dashboard", "dashboard", "started-here-without-dashboard"])
def test_only_the_callbacks_that_cannot_serve_the_run_are_left_out(monkeypatch, node, cleaner):
    with_node(monkeypatch, node)
    ray_train = callback_names(TorchTrainer(lambda: None, **KWARGS))
    unused = {"DatasetsCallback"} | ({"PlacementGroupCleanerCallback"} if not cleaner else set())
    assert callback_names(Trainer(lambda: None, **KWARGS)) == [n for n in ray_train if n not in unused]
    # given datasets, the DatasetsCallback stays
    with_datasets = callback_names(Trainer(lambda: None, datasets={"train": lambda: None}, **KWARGS))
    assert with_datasets == [n for n in ray_train if n not in unused - {"DatasetsCallback"}]
