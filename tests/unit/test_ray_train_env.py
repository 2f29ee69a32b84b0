"""raydist's Ray Train settings: which clusters get which, the user's own values winning, and that a driver
which started Ray itself gets them too (Ray Train hands the driver's RAY_TRAIN_* variables on)."""

import pytest

from raydist import strict
from raydist.driver.ray_cluster import (CONTROLLER_ENV, EMBEDDED_RAY_ENV, EMBEDDED_RAY_TRAIN_ENV, RAY_TRAIN_ENV,
                                        train_env)


@pytest.fixture
def clean_env(monkeypatch):
    for key in {**RAY_TRAIN_ENV, **CONTROLLER_ENV, **EMBEDDED_RAY_TRAIN_ENV, **EMBEDDED_RAY_ENV}:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv(strict.ENV, raising=False)  # (the suite runs under it: tests/conftest.py)
    return monkeypatch


def test_embedded_clusters_get_the_extra_settings_and_joined_ones_do_not(clean_env):
    assert train_env(embedded=True) == {**RAY_TRAIN_ENV, **CONTROLLER_ENV, **EMBEDDED_RAY_TRAIN_ENV, **EMBEDDED_RAY_ENV}
    assert train_env(embedded=False) == {**RAY_TRAIN_ENV, **CONTROLLER_ENV}
    assert "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in train_env(embedded=False)  # real clusters drain nodes
    assert "RAY_prestart_worker_first_driver" not in train_env(embedded=False)  # (their raylets run already)


def test_the_strict_mode_reaches_the_workers_of_any_cluster(clean_env):
    clean_env.setenv(strict.ENV, "1")
    assert train_env(embedded=False)[strict.ENV] == "1" and train_env(embedded=True)[strict.ENV] == "1"


def test_a_value_the_user_set_wins(clean_env):
    clean_env.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "3")
    clean_env.setenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "1")
    env = train_env(embedded=True)
    assert env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "3" and env["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "1"


def test_every_setting_is_one_ray_train_hands_from_the_driver_to_its_controller_and_workers():
    from ray.train.v2._internal.constants import ENV_VARS_TO_PROPAGATE

    assert set(RAY_TRAIN_ENV) | set(EMBEDDED_RAY_TRAIN_ENV) <= ENV_VARS_TO_PROPAGATE


def test_the_controller_settings_are_the_ones_ray_train_reads_and_does_not_hand_on():
    """They must reach the controller through the processes' environment or the job's runtime env."""
    from ray.train.constants import TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
    from ray.train.v2._internal.constants import ENV_VARS_TO_PROPAGATE

    assert set(CONTROLLER_ENV) == {TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S}
    assert not set(CONTROLLER_ENV) & ENV_VARS_TO_PROPAGATE
    assert float(CONTROLLER_ENV[TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S]) < 30  # Ray's default, paid per hang


def test_a_driver_that_started_ray_itself_gets_the_settings(clean_env):
    import ray

    from raydist.config import Config
    from raydist.driver.ray_cluster import connect_ray

    clean_env.setattr(ray, "is_initialized", lambda: True)
    assert connect_ray(Config(), None, 2) is False  # nothing started
    import os

    assert {k: os.environ.get(k) for k in RAY_TRAIN_ENV} == RAY_TRAIN_ENV
    assert "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in os.environ  # not known to be a local cluster


def test_the_configured_group_start_timeout_reaches_ray_train_and_a_later_run_sets_its_own(clean_env):
    from raydist.config import Config
    from raydist.driver.ray_cluster import GROUP_START_TIMEOUT

    clean_env.delenv(GROUP_START_TIMEOUT, raising=False)
    first = Config.load(None, ["elastic.group_start_timeout_s=25"])
    assert train_env(embedded=False, cfg=first)[GROUP_START_TIMEOUT] == "25.0"
    clean_env.setenv(GROUP_START_TIMEOUT, "25.0")  # the first run's driver environment
    assert train_env(embedded=True, cfg=Config())[GROUP_START_TIMEOUT] == "60.0"  # Ray Train's own default
    from ray.train.v2._internal.constants import ENV_VARS_TO_PROPAGATE

    assert GROUP_START_TIMEOUT in ENV_VARS_TO_PROPAGATE


def test_a_group_start_timeout_that_is_not_positive_is_refused():
    from raydist.config import Config, ConfigError

    with pytest.raises(ConfigError, match=r"elastic.group_start_timeout_s=0.0 must be > 0"):
        Config.load(None, ["elastic.group_start_timeout_s=0"])
