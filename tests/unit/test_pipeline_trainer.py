"""Pipeline parallelism through the Trainer (the path `raydist train` takes): losses and gradients equal
the single-process run, composed with data parallelism, and checkpoints move between pp sizes."""

import pytest

from raydist.testing import assert_equivalent, run_fit, run_layout, tiny_config

MODEL = {"num_layers": 4}


@pytest.mark.parametrize("parallel, world", [
    ({"pp": 2, "pp_schedule": "1f1b"}, 2),
    ({"pp": 2, "pp_schedule": "interleaved", "virtual_stages": 2}, 2),
    ({"pp": 2, "pp_schedule": "gpipe", "dp_replicate": 2}, 4),
    ({"pp": 2, "pp_schedule": "1f1b", "dp_replicate": 1, "dp_shard": 2}, 4),
    ({"pp": 2, "pp_schedule": "1f1b", "tp": 2}, 4),
], ids=["pp2-1f1b", "pp2-interleaved", "pp2xdp2-gpipe", "pp2xfsdp2", "pp2xtp2"])
def test_pipeline_equals_single_process(tiny_data, single_4_layers, parallel, world):
    raw = tiny_config(tiny_data, model=MODEL, parallel={"dp_replicate": 1, **parallel})
    results = run_layout(raw, world)
    held = set()
    for rank in results:
        assert_equivalent(single_4_layers, rank)
        held |= set(rank.grads)
    assert held == set(single_4_layers.grads)  # every parameter lives on some stage


def test_pipeline_checkpoint_loads_at_pp1(tiny_data, tmp_path):
    """Save at pp 2 (tied embedding split across stages), resume at pp 1: same continuation."""
    train = {"steps": 6, "global_batch": 8}
    ckpt = {"every_steps": 3, "async_save": False}
    reference = run_fit(tiny_config(tiny_data, model=MODEL, train=train, checkpoint=ckpt), 1,
                        str(tmp_path / "ref"))
    run_dir = str(tmp_path / "pp")
    pp2 = tiny_config(tiny_data, model=MODEL, train=train, checkpoint=ckpt, parallel={"dp_replicate": 1, "pp": 2})
    assert run_fit(pp2, 2, run_dir, crash_after_step=4) is None
    resumed = run_fit(tiny_config(tiny_data, model=MODEL, train=train, checkpoint=ckpt), 1, run_dir)
    assert resumed[0].losses == pytest.approx(reference[0].losses[3:], rel=1e-5)
