"""The one batch plan (raydist/schedule/batch.py): global_batch = dp x micro_batch x num_microbatches."""

import pytest

from raydist.errors import ConfigError
from raydist.schedule.batch import (BatchPlan, auto_micro_batch, divisors, largest_divisor, microbatch_count,
                                    per_rank_rows, plan_batch)


def test_a_set_micro_batch_is_used_as_given_and_must_divide_the_rank_rows():
    plan = plan_batch(16, 2, micro_batch=4)
    assert (plan.per_rank, plan.micro_batch, plan.num_microbatches) == (8, 4, 2)
    with pytest.raises(ConfigError, match=r"global_batch=12 must be divisible by dp \(2\) x train.micro_batch \(4\)"):
        plan_batch(12, 2, micro_batch=4)
    with pytest.raises(ConfigError, match=r"train.global_batch=9 must be divisible by dp \(2\)"):
        plan_batch(9, 2, micro_batch=1)


def test_under_a_limit_the_micro_batch_is_the_largest_divisor_not_above_it():
    # an elastic range: global 12 on one rank with micro_batch 8 runs micro-batches of 6 (Config.validate
    # agrees: tests/unit/test_elastic_policy.py)
    assert plan_batch(12, 1, micro_batch=8, limit=8).micro_batch == 6
    assert plan_batch(12, 1).micro_batch == 6  # unset: the default limit (8)
    assert plan_batch(7, 1, limit=4).micro_batch == 1


def test_a_pipeline_gets_the_micro_batch_count_its_schedule_needs():
    assert plan_batch(16, 1, pp=2, num_microbatches=8).micro_batch == 2
    with pytest.raises(ConfigError, match=r"parallel.num_microbatches=3 does not divide the per-rank batch 16"):
        plan_batch(16, 1, pp=2, num_microbatches=3)
    # unset: at least pp micro-batches, a multiple of pp when interleaved
    assert auto_micro_batch(8, 8, pp=4, schedule="1f1b") == 2
    assert auto_micro_batch(12, 8, pp=4, schedule="interleaved") == 3
    assert plan_batch(12, 1, pp=4, schedule="interleaved").num_microbatches % 4 == 0


def test_the_plan_refuses_rows_that_do_not_split():
    assert divisors(12) == [1, 2, 3, 4, 6, 12] and largest_divisor(12, 5) == 4 and largest_divisor(5, 0) == 1
    assert per_rank_rows(12, 3) == 4 and microbatch_count(12, 4) == 3
    with pytest.raises(ValueError, match="not divisible by the data-parallel size 5"):
        per_rank_rows(12, 5)
    with pytest.raises(ValueError, match="no whole number of 5-row micro-batches"):
        microbatch_count(12, 5)
    with pytest.raises(ValueError):
        BatchPlan(12, 2, 4)  # 6 rows per rank are no whole number of 4-row micro-batches
