"""Prompt/response data: `data prepare` of JSONL writes a loss mask over response tokens; the loss is the mean
over counted tokens of the global batch, equal to a hand computation and the same under DDP 2, FSDP 2, CP 2,
TP 2 with SP, PP 2 under every schedule (GPipe, 1F1B, interleaved, ZB-H1, ZB-V), DP 2 x TP 2, FSDP 2 x PP 2
and TP 2 (SP) x CP 2."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from raydist.config import DataConfig
from raydist.data import sft
from raydist.data.prepare import prepare
from raydist.parallel.runtime import spawn
from raydist.testing import assert_equivalent, run_layout, tiny_config


def _examples(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):  # prompts and responses of varied lengths: ranks see different counted-token numbers
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        prompt = f"Q{i}: " + " ".join(["what is"] * rng.randint(1, 4)) + f" {a} + {b}?\n"
        out.append({"prompt": prompt, "response": f"A: {a + b}" + "!" * rng.randint(0, 12)})
    return out


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> tuple[str, list[dict]]:
    root = tmp_path_factory.mktemp("sft")
    examples = _examples(700)
    (root / "train.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples))
    out = str(root / "prepared")
    prepare(DataConfig(corpus=str(root / "train.jsonl"), seq_len=32, val_fraction=0.0, shard_rows=256), out,
            log=lambda *_: None)
    return out, examples


def test_prepare_writes_the_response_mask(sft_data):
    import pyarrow.parquet as pq

    from raydist.data.prepare import read_manifest
    from raydist.data.stream import Split, read_shard

    path, examples = sft_data
    manifest = read_manifest(path)
    assert manifest["loss_mask"] is True
    tokens, mask = [], []
    for e in examples:  # the byte tokenizer: prompt bytes (mask 0), response bytes and end-of-sequence (mask 1)
        p, r = e["prompt"].encode(), e["response"].encode()
        tokens += [*p, *r, 256]
        mask += [0] * len(p) + [1] * (len(r) + 1)
    split = Split.open(path, "train", manifest)
    table = pq.read_table(split.uri(0))
    n = 256 * 33
    assert np.concatenate(table.column("tokens").to_numpy(zero_copy_only=False)).tolist() == tokens[:n]
    assert np.concatenate(table.column("loss_mask").to_numpy(zero_copy_only=False)).tolist() == mask[:n]
    rows = torch.from_numpy(read_shard(split, 0).tokens)  # in memory: the mask rides on the ids
    inputs, targets = sft.split_rows(rows, masked=True)
    assert inputs.flatten().tolist() == [t for k, t in enumerate(tokens[:n]) if k % 33 != 32]
    want = [t if m else sft.IGNORE for k, (t, m) in enumerate(zip(tokens[:n], mask[:n])) if k % 33 != 0]
    assert targets.flatten().tolist() == want
    assert 0.2 < (targets != sft.IGNORE).float().mean() < 0.8  # both kinds present


def test_missing_fields_are_one_error_line(tmp_path, capsys):
    from raydist.cli import main

    for line, match in [('{"prompt": "x"}', "line 2: field 'response' is missing"),
                        ('{"prompt": 3, "response": "y"}', "line 2: field 'prompt' is a int"),
                        ('not json', "line 2: not valid JSON")]:
        corpus = tmp_path / "bad.jsonl"
        corpus.write_text('{"prompt": "a", "response": "b"}\n' + line + "\n")
        out = tmp_path / f"out-{abs(hash(line))}"
        capsys.readouterr()
        assert main(["data", "prepare", "--corpus", str(corpus), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and match in err[0], err


def _losses_by_hand(raw: dict) -> tuple[float, float, float, float]:
    """On one process: the Trainer's loss on the first global batch (micro_batch from raw), the same batch by
    hand (log-softmax of each counted target, averaged in float64), and the plain mean over all targets."""
    from raydist.config import Config
    from raydist.parallel.runtime import pick_device
    from raydist.training.trainer import Trainer

    trainer = Trainer(Config.from_dict(raw), pick_device())
    try:
        rows, _ = trainer.next_batch()
        got = trainer.loss_on(rows)
        model = trainer.pm.model
        total, count, plain = 0.0, 0, 0.0
        with torch.no_grad():
            for row in rows:
                clean = row & sft.TOKEN_BITS
                logp = torch.log_softmax(model(clean[None, :-1])[0].double(), dim=-1)  # (T, V)
                for j in range(1, len(row)):
                    plain -= float(logp[j - 1, clean[j]])
                    if row[j] < sft.NOT_TARGET:
                        total -= float(logp[j - 1, clean[j]])
                        count += 1
        return got, total / count, plain / (rows.shape[0] * (rows.shape[1] - 1)), count / rows[:, 1:].numel()
    finally:
        trainer.close()


@pytest.mark.parametrize("micro_batch", [8, 2])
def test_masked_loss_equals_hand_computation(sft_data, micro_batch):
    raw = tiny_config(sft_data[0], train={"micro_batch": micro_batch})
    got, by_hand, plain, share = spawn(_losses_by_hand, 1, raw)[0]
    print(f"micro_batch {micro_batch}: trainer {got:.6f}, by hand {by_hand:.6f}, unmasked mean {plain:.6f}, "
          f"{share:.0%} of targets counted")
    assert math.isclose(got, by_hand, rel_tol=1e-5)
    assert abs(got - plain) / plain > 1e-3 and share < 0.9  # the mask changes the number


@pytest.fixture(scope="module")
def sft_single(sft_data):
    return run_layout(tiny_config(sft_data[0]), 1)[0]


@pytest.mark.parametrize("parallel", [{"dp_replicate": 2}, {"dp_shard": 2}, {"cp": 2}], ids=["ddp2", "fsdp2", "cp2"])
def test_masked_loss_same_under_ddp_fsdp_and_cp(sft_data, sft_single, parallel):
    raw = tiny_config(sft_data[0], parallel={"dp_replicate": 1, "dp_shard": 1, **parallel})
    for result in run_layout(raw, 2):
        assert_equivalent(sft_single, result)


@pytest.mark.parametrize("parallel", [
    {"tp": 2, "sequence_parallel": True},
    {"pp": 2, "pp_schedule": "1f1b"},
    {"pp": 2, "pp_schedule": "zbh1"},
], ids=["tp2-sp", "pp2-1f1b", "pp2-zbh1"])
def test_masked_loss_same_under_tp_and_pp(sft_data, sft_single, parallel):
    """The vocabulary-parallel cross-entropy honours IGNORE targets; the pipeline's last stage scales each
    micro-batch's loss (the zero-bubble schedule splits its backward into B and W)."""
    raw = tiny_config(sft_data[0], parallel={"dp_replicate": 1, "dp_shard": 1, **parallel})
    for result in run_layout(raw, 2):
        assert_equivalent(sft_single, result)


@pytest.fixture(scope="module")
def sft_single_4_layers(sft_data):
    return run_layout(tiny_config(sft_data[0], model={"num_layers": 4}), 1)[0]


@pytest.mark.parametrize("parallel", [
    {"pp": 2, "pp_schedule": "gpipe"},
    {"pp": 2, "pp_schedule": "interleaved", "virtual_stages": 2},
    {"pp": 2, "pp_schedule": "zbv"},
], ids=["pp2-gpipe", "pp2-interleaved", "pp2-zbv"])
def test_masked_loss_same_under_every_pipeline_schedule(sft_data, sft_single_4_layers, parallel):
    """Two chunks per rank (interleaved, and ZB-V's V placement where rank 0 holds both the embedding and the
    head): 4 blocks, so every chunk holds one."""
    raw = tiny_config(sft_data[0], model={"num_layers": 4}, parallel={"dp_replicate": 1, "dp_shard": 1, **parallel})
    for result in run_layout(raw, 2):
        assert_equivalent(sft_single_4_layers, result)


@pytest.mark.parametrize("parallel", [{"dp_replicate": 2, "tp": 2}, {"dp_shard": 2, "pp": 2},
                                      {"tp": 2, "sequence_parallel": True, "cp": 2}],
                         ids=["ddp2xtp2", "fsdp2xpp2", "tp2-spxcp2"])
def test_masked_loss_same_under_combined_layouts(sft_data, sft_single, parallel):
    """The counted-token scale is all-reduced over the dp ranks only; tp, cp and pp peers hold the same rows
    (under cp each loss is over its sequence shard's targets, IGNORE ones included, which are equal in number)."""
    raw = tiny_config(sft_data[0], parallel={"dp_replicate": 1, "dp_shard": 1, **parallel})
    for result in run_layout(raw, 4):
        assert_equivalent(sft_single, result)


def test_live_recovery_with_masks_is_refused(sft_data):
    from raydist.config import Config, ConfigError
    from raydist.driver.launcher import ensure_data

    raw = tiny_config(sft_data[0], elastic={"live_recovery": True}, parallel={"dp_replicate": 2},
                      ray={"num_workers": 2})
    with pytest.raises(ConfigError, match="set elastic.live_recovery=false"):  # on the driver, before any worker
        ensure_data(Config.from_dict(raw))
