"""Construction on the meta device: every layout starts from the same weights as the single-process model,
each rank allocates only its own shards, and a resumed run loads its weights instead of drawing them."""

import json
import os

import pytest
import torch

from raydist.config import ModelConfig
from raydist.models.gpt import build_model, param_counts
from raydist.models.init import BLOCK_ELEMENTS, full_rows, full_value, rows_per_block, write_rows
from raydist.testing import constructed, run_fit, tiny_config

MODEL = {"num_layers": 4}


@pytest.fixture(scope="module")
def reference(tiny_data):
    """The single-process model's initial weights, by name (tied: the head is the embedding)."""
    cfg = tiny_config(tiny_data, model=MODEL)
    model = build_model(ModelConfig(**cfg["model"]), 32, seed=cfg["train"]["seed"])
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("parallel, world", [
    ({"dp_replicate": 2}, 2),
    ({"dp_shard": 2}, 2),
    ({"tp": 2}, 2),
    ({"pp": 2}, 2),
    ({"dp_shard": 2, "tp": 2, "sequence_parallel": True}, 4),
    ({"pp": 2, "dp_shard": 2}, 4),
], ids=["ddp2", "fsdp2", "tp2", "pp2", "fsdp2xtp2", "pp2xfsdp2"])
def test_layouts_start_from_the_single_process_weights(tiny_data, reference, parallel, world):
    ranks = constructed(tiny_config(tiny_data, model=MODEL, parallel=parallel), world)
    held = set()
    for rank in ranks:
        assert not rank.meta_tensors and rank.rope_exact and rank.tied
        for name, value in rank.params.items():
            assert torch.equal(value, reference[name]), f"{name} differs from the single-process model"
            held.add(name)
    assert held == set(reference)


def test_untied_and_unevenly_sharded(tiny_data):
    """FSDP 4 over shapes that do not divide by 4 (FSDP2 pads the last shards) and an untied head."""
    model = {**MODEL, "vocab_size": 326, "tie_embeddings": False}
    ref = build_model(ModelConfig(**tiny_config(tiny_data, model=model)["model"]), 32, seed=0)
    ranks = constructed(tiny_config(tiny_data, model=model, parallel={"dp_shard": 4}), 4)
    for rank in ranks:
        assert set(rank.params) == {n for n, _ in ref.named_parameters()}
        for name, param in ref.named_parameters():
            assert torch.equal(rank.params[name], param.detach()), name
    assert not torch.equal(ref.output.weight, ref.tok_embeddings.weight)


def test_fsdp2_ranks_hold_half_of_the_model(tiny_data):
    raw = tiny_config(tiny_data, model=MODEL, parallel={"dp_shard": 2})
    full_bytes = 4 * param_counts(ModelConfig(**raw["model"]))["total"]
    for rank in constructed(raw, 2):
        assert abs(rank.local_param_bytes - full_bytes / 2) <= 0.01 * full_bytes, (rank.local_param_bytes, full_bytes)


def test_rows_are_drawn_independently_of_the_slice():
    """Any row range of a parameter equals those rows of the whole value (blocks keyed by position)."""
    cfg = ModelConfig(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, ffn_hidden=128, vocab_size=320)
    shape = (3 * BLOCK_ELEMENTS // 512 + 7, 512)  # several generator blocks, the last one short
    whole = full_value("layers.0.feed_forward.w2.weight", shape, cfg, seed=3)
    per = rows_per_block(shape)
    for start, stop in [(0, 1), (per - 1, per + 1), (5, shape[0]), (2 * per, 3 * per + 7)]:
        assert torch.equal(full_rows("layers.0.feed_forward.w2.weight", shape, start, stop, cfg, 3),
                           whole[start:stop])
    # a box (rows and columns, as a tensor-parallel shard holds) written in place, block by block
    box = write_rows(torch.empty(per + 3, 100), "layers.0.feed_forward.w2.weight", shape, per - 1, (200,), cfg, 3)
    assert torch.equal(box, whole[per - 1:2 * per + 2, 200:300])
    other = full_value("layers.1.feed_forward.w2.weight", shape, cfg, seed=3)
    assert not torch.equal(whole, other)  # keyed by name
    assert abs(float(whole.std()) - 0.02 / 2) < 1e-3  # residual output: std / sqrt(2 L)


def test_build_model_ties_and_fills_buffers():
    cfg = ModelConfig(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, ffn_hidden=128, vocab_size=320)
    model = build_model(cfg, 16, seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert torch.isfinite(model.rope_cos).all() and float(model.rope_cos[0, 0]) == 1.0
    assert all(float(m.weight.detach().min()) == 1.0 == float(m.weight.detach().max()) for n, m in model.named_modules()
               if n.endswith("norm"))


def test_a_resumed_run_loads_its_weights_instead_of_drawing_them(tiny_data, tmp_path):
    raw = tiny_config(tiny_data, train={"steps": 4}, checkpoint={"every_steps": 2, "keep": 2, "async_save": False})
    run_dir = str(tmp_path / "run")
    assert run_fit(raw, 1, run_dir, crash_after_step=3) is None
    run_fit(raw, 1, run_dir)
    starts = [e for e in map(json.loads, open(os.path.join(run_dir, "events.jsonl")))
              if e["kind"] in ("start", "restart")]
    assert [(e["kind"], e["weights"]) for e in starts] == [("start", "init"), ("restart", "checkpoint")]
