"""Run configuration: one frozen dataclass per TOML section, `--set section.key=value` overrides, validation.

- `sections.py`: the sections, each field with its docstring, the choices a string key allows;
- `io.py`: TOML read and written, `--set` parsed and type-checked, the field docs and the README's reference;
- `hf.py`: `model.init_from = "hf:DIR"`, [model] read from a Hugging Face config.json;
- `run.py`: `Config`, the whole run's configuration, loaded and validated.

Callers import from here; `python -m raydist.config` prints the README's reference.
"""

from raydist.config.hf import hf_dir_of
from raydist.config.io import dump_toml, field_docs, parse_override, read_toml, reference_markdown
from raydist.config.run import DEFAULT_WORKLOAD, Config, divisors
from raydist.config.sections import (CHOICES, SECTIONS, CheckpointConfig, DataConfig, ElasticConfig, KernelsConfig,
                                     ModelConfig, MonitorConfig, ParallelConfig, PeftConfig, RayConfig, TrackingConfig,
                                     TrainConfig)
from raydist.errors import ConfigError

__all__ = ["CHOICES", "DEFAULT_WORKLOAD", "SECTIONS", "CheckpointConfig", "Config", "ConfigError", "DataConfig",
           "ElasticConfig", "KernelsConfig", "ModelConfig", "MonitorConfig", "ParallelConfig", "PeftConfig",
           "RayConfig", "TrackingConfig", "TrainConfig", "divisors", "dump_toml", "field_docs", "hf_dir_of",
           "parse_override", "read_toml", "reference_markdown"]
