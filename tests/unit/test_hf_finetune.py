"""Fine-tuning real models: `model.init_from = "hf:DIR"` loads into every layout's shards, `raydist eval`
equals transformers' loss, and exports from FSDP / TP / PP runs load in transformers with equal logits."""

from __future__ import annotations

import json
import os

import pytest
import torch

from raydist.config import Config, ConfigError
from raydist.runtime import spawn
from raydist.testing import save_tiny_llama, tiny_config

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    """Two transformers Llama directories of the tiny shape: tied, and untied saved in several shards."""
    tied = tmp_path_factory.mktemp("llama-tied")
    untied = tmp_path_factory.mktemp("llama-untied")
    save_tiny_llama(tied, tied=True, seed=1)
    model = save_tiny_llama(untied, tied=False, seed=2)
    model.save_pretrained(str(untied), max_shard_size="100KB")  # several files with an index
    assert (untied / "model.safetensors.index.json").is_file()
    return {"tied": str(tied), "untied": str(untied)}


def _full_parameters(raw: dict) -> dict[str, torch.Tensor]:
    from raydist.runtime import pick_device
    from raydist.trainer import Trainer

    trainer = Trainer(Config.from_dict(raw), pick_device())
    try:
        return trainer.full_parameters()
    finally:
        trainer.close()


@pytest.mark.parametrize("parallel, world", [({}, 1), ({"dp_shard": 2}, 2), ({"tp": 2}, 2), ({"pp": 2}, 2)],
                         ids=["single", "fsdp2", "tp2", "pp2"])
@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_init_from_loads_every_layout_exactly(tiny_data, llama_dirs, parallel, world, kind):
    from raydist.models.hf import iter_hf_tensors

    raw = tiny_config(tiny_data, model={"init_from": f"hf:{llama_dirs[kind]}"}, parallel=parallel)
    expected = dict(iter_hf_tensors(llama_dirs[kind]))
    for rank_params in spawn(_full_parameters, world, raw):
        assert rank_params
        for name, tensor in rank_params.items():
            source = "tok_embeddings.weight" if kind == "tied" and name == "output.weight" else name
            assert torch.equal(tensor, expected[source]), name
