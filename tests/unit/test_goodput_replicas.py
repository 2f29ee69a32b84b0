"""Live recovery's goodput accounting: a lost replica's time out counts until it rejoins, or until the end
of the run when it never comes back."""

import time

from raydist.metrics.goodput import Goodput


def test_a_replica_that_never_rejoins_counts_until_the_end(tmp_path):
    goodput = Goodput(str(tmp_path), driver_start=time.time())
    goodput.on_replica_lost(1)
    goodput.on_replica_joined(1, 2.5)  # back after 2.5 s
    goodput.on_replica_lost(0)
    lost_at = goodput.state["replicas_out"]["0"]
    time.sleep(0.05)
    summary = goodput.summary(final_step=10, tokens_per_step=8)
    still_out = time.time() - lost_at
    assert summary["replicas_lost"] == 2 and summary["replicas_out_at_end"] == 1
    assert 2.5 + 0.05 <= summary["replica_time_out_s"] <= 2.5 + still_out + 1e-3


def test_a_rejoined_replica_is_no_longer_out(tmp_path):
    goodput = Goodput(str(tmp_path), driver_start=time.time())
    goodput.on_replica_lost(3)
    goodput.on_replica_joined(3, 1.25)
    summary = goodput.summary(final_step=10, tokens_per_step=8)
    assert summary["replicas_out_at_end"] == 0 and summary["replica_time_out_s"] == 1.25


def test_a_whole_group_restart_brings_every_replica_back(tmp_path):
    goodput = Goodput(str(tmp_path), driver_start=time.time())
    goodput.on_start(0)
    goodput.on_replica_lost(1)
    goodput.state["replicas_out"]["1"] -= 4.0  # lost 4 s before the last progress
    goodput.on_progress(5, logged=True)
    restarted = Goodput(str(tmp_path), driver_start=goodput.run_start)  # the next attempt reads progress.json
    restarted.on_start(5)
    summary = restarted.summary(final_step=10, tokens_per_step=8)
    assert summary["restarts"] == 1 and summary["replicas_out_at_end"] == 0
    assert 4.0 <= summary["replica_time_out_s"] < 5.0
