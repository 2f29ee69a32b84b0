"""cluster_configs/: every cluster-launcher YAML validates against the schema Ray ships, and says what
raydist needs (token auth on every node, raydist installed, a GPU worker type that scales, a head without
GPUs); the KubeRay RayJob manifest (cluster_configs/kubernetes/, not a launcher config) has its shape
checked. No cloud is contacted: these are static checks.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

import ray.autoscaler

from raydist.config import Config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "cluster_configs"
LAUNCHER_YAMLS = sorted(CONFIGS.glob("*.yaml"))
CLOUD_YAMLS = [p for p in LAUNCHER_YAMLS if p.stem in ("aws", "gcp")]
SCHEMA = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_the_expected_configs_exist():
    assert {p.name for p in LAUNCHER_YAMLS} == {"aws.yaml", "gcp.yaml", "local_fake.yaml"}
    assert (CONFIGS / "kubernetes" / "rayjob.yaml").is_file()


@pytest.mark.parametrize("path", LAUNCHER_YAMLS, ids=lambda p: p.name)
def test_validates_against_rays_schema(path):
    config = load(path)
    jsonschema.validate(config, SCHEMA)
    # What Ray's own validate_config adds to the schema: the head type exists, min workers fit.
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    assert sum(t.get("min_workers", 0) for t in types.values()) <= config["max_workers"]
    for name, node_type in types.items():
        assert node_type.get("max_workers", 0) <= config["max_workers"], name


def test_the_schema_check_rejects_a_broken_config():
    config = load(CONFIGS / "aws.yaml")
    broken = copy.deepcopy(config)
    broken["available_node_types"]["gpu_worker"]["min_workers"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCHEMA)
    broken = copy.deepcopy(config)
    broken["max_worker"] = 8  # a typo of max_workers: unknown top-level keys are refused
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCHEMA)


@pytest.mark.parametrize("path", CLOUD_YAMLS, ids=lambda p: p.name)
def test_cloud_config_has_a_cpu_head_and_an_autoscaling_gpu_worker_type(path):
    config = load(path)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and head["resources"].get("CPU") == 0
    workers = {name: t for name, t in types.items() if name != config["head_node_type"]}
    gpu = [t for t in workers.values() if t["resources"].get("GPU", 0) >= 1]
    assert gpu, "no GPU worker type"
    assert all(t["min_workers"] < t["max_workers"] for t in gpu)
    # One raydist worker per GPU plus Ray Data reads: at least one CPU per GPU.
    assert all(t["resources"]["CPU"] >= t["resources"]["GPU"] for t in gpu)


@pytest.mark.parametrize("path", CLOUD_YAMLS, ids=lambda p: p.name)
def test_cloud_config_installs_raydist_and_keeps_token_auth_on(path):
    config = load(path)
    setup = "\n".join(config["setup_commands"])
    assert "pip install" in setup and "~/raydist" in setup and "torch==" in setup
    assert config["file_mounts"]["~/raydist"] == "."
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert "export RAY_AUTH_MODE=token" in setup
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in config[key] if "ray start" in c]
        assert starts and all("RAY_AUTH_MODE=token ray start" in c for c in starts), key
    assert "--autoscaling-config" in " ".join(config["head_start_ray_commands"])


@pytest.mark.parametrize("path", LAUNCHER_YAMLS, ids=lambda p: p.name)
def test_each_config_is_documented_at_its_top(path):
    head = path.read_text().split("\n\n")[0]
    assert head.startswith("#")
    assert "cost" in head.lower() and "What to change" in path.read_text()


def test_local_fake_config_starts_with_no_workers_and_a_head_without_cpus():
    config = load(CONFIGS / "local_fake.yaml")
    assert config["provider"]["type"] == "fake_multinode"
    types = config["available_node_types"]
    assert config["head_node_type"] == "ray.head.default"  # the name the fake provider gives the head
    assert types["ray.head.default"]["resources"]["CPU"] == 0
    workers = [t for name, t in types.items() if name != "ray.head.default"]
    assert all(t["min_workers"] == 0 for t in workers)
    # Room for the elastic workload's maximum: 4 workers of 1 CPU.
    elastic = Config.load(ROOT / "workloads" / "elastic_tiny.toml")
    capacity = sum(t["max_workers"] * int(t["resources"]["CPU"] // elastic.ray.cpus_per_worker) for t in workers)
    assert capacity >= elastic.elastic.max_workers


def test_kuberay_rayjob_manifest():
    docs = list(yaml.safe_load_all((CONFIGS / "kubernetes" / "rayjob.yaml").read_text()))
    assert len(docs) == 1
    job = docs[0]
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    entrypoint = spec["entrypoint"].split()
    assert entrypoint[:2] == ["raydist", "train"]
    workload = entrypoint[2].replace("/home/ray/raydist/", "")
    Config.load(ROOT / workload, [a for a in entrypoint[3:] if a != "--set"])  # a valid config
    assert spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    assert cluster["authOptions"]["mode"] == "token"
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    head_limits = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "nvidia.com/gpu" not in head_limits
    (group,) = cluster["workerGroupSpecs"]
    assert group["minReplicas"] < group["maxReplicas"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1"


@pytest.mark.parametrize("path", LAUNCHER_YAMLS, ids=lambda p: p.name)
def test_ray_prepares_and_accepts_the_config(path):
    """What `ray up` does before it contacts a cloud: merge with the provider's defaults, validate. (The
    fake provider's defaults file is not in Ray's wheel; local_fake.yaml is complete without it.)"""
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load(path)
    validate_config(config if path.stem == "local_fake" else prepare_config(config))
