"""raydist's TorchTrainer (raydist.driver.ray_trainer): Ray Train's default callbacks less the DatasetsCallback
when no datasets are passed, as raydist never does; all of them otherwise. (That a real run then starts no
DatasetManager and still trains: tests/ray/test_train_ray.py.)"""

from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer

from raydist.driver import ray_trainer
from raydist.driver.ray_trainer import Trainer


def callback_names(trainer) -> list[str]:
    return [type(c).__name__ for c in trainer._create_default_callbacks()]


def test_without_datasets_only_the_datasets_callback_is_left_out():
    assert ray_trainer.DatasetsCallback is not None  # the pinned Ray has it where it is read from
    kwargs = dict(scaling_config=ScalingConfig(num_workers=1))
    ray_train = callback_names(TorchTrainer(lambda: None, **kwargs))
    assert "DatasetsCallback" in ray_train
    assert callback_names(Trainer(lambda: None, **kwargs)) == [n for n in ray_train if n != "DatasetsCallback"]
    # given datasets, the trainer is Ray Train's own
    assert callback_names(Trainer(lambda: None, datasets={"train": lambda: None}, **kwargs)) == ray_train
