"""Deterministic failures end a run; transient ones restart it. The watchdog bounds every phase."""

import errno
import pickle
import time

from raydist.elastic import failures
from raydist.elastic.control import Watchdog
from raydist.errors import ConfigError
from workers import patience


def test_classification():
    deterministic = [ConfigError("train.steps=0 must be positive"), FileNotFoundError("shard-00001.parquet"),
                     pickle.UnpicklingError("metadata refers to os.system"),
                     OSError(errno.ENOSPC, "No space left on device"),
                     RuntimeError("Error(s) in loading state_dict: size mismatch for layers.0.attention.wq")]
    transient = [RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"),
                 TimeoutError("checkpoint save did not finish"), RuntimeError("NCCL communicator was aborted")]
    for exc in deterministic:
        assert failures.is_deterministic(exc), exc
    for exc in transient:
        assert not failures.is_deterministic(exc), exc
    wrapped = RuntimeError("checkpoint save failed: ...")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert failures.is_deterministic(wrapped)  # the chain is searched


def test_fatal_record_belongs_to_one_driver_run(tmp_path):
    run_dir = str(tmp_path)
    before = time.time()
    failures.record(run_dir, ConfigError("model.vocab_size=10 is smaller than the data's ids"), rank=1)
    fatal = failures.recorded(run_dir, since=before)
    assert fatal["error"].startswith("model.vocab_size=10") and fatal["rank"] == 1
    assert failures.recorded(run_dir, since=time.time() + 1) is None  # a later run of the name: not its failure


def test_watchdog_names_the_phase_that_hung():
    hung = []
    dog = Watchdog(10.0, on_hang=lambda: hung.append(dog.name)).start()
    dog.phase("save", 0.2)
    deadline = time.monotonic() + patience(10)
    while not hung and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hung == ["save"]
    quiet = []
    dog2 = Watchdog(0.3, on_hang=lambda: quiet.append(1)).start()
    for _ in range(10):  # beating keeps it quiet
        time.sleep(0.05)
        dog2.beat()
    dog2.stop()
    assert quiet == []
