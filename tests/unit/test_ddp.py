"""2-worker DDP equals 1 worker on the same global batch (gloo, fp32, 10 steps)."""

from raydist.testing import assert_equivalent, run_layout, tiny_config


def test_ddp2_equals_single_process(tiny_data):
    raw = tiny_config(tiny_data)
    [single] = run_layout(raw, 1)
    ddp = run_layout(tiny_config(tiny_data, parallel={"dp_replicate": 2}), 2)
    assert single.losses[-1] < single.losses[0]  # it learns
    for rank in ddp:
        assert_equivalent(single, rank)
