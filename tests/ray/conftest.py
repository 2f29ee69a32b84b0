import pytest


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray for the module's tests (token authentication on, as Ray sets it)."""
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=True, logging_level="warning")
    yield ray
    ray.shutdown()
