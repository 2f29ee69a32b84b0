"""Imported by a spawned rank (run_fit's `imports`): every rank's step takes $RAYDIST_TEST_STEP_S longer (a
slower device: steps long enough that a loaded machine's scheduling jitter is small beside them), and rank 1
stops itself (SIGSTOP: alive, its sockets open,
answering nothing) when it is about to run the step after $RAYDIST_TEST_STOP_AFTER, having written the time
to $RAYDIST_TEST_STOP_FILE; the parent ends it. Every other rank writes the time its wait for it ended to
$RAYDIST_TEST_STOP_FILE.rank<r>: a collective that raised (gloo), or the strict mode's abort (NCCL's rules:
the timeout ends the process). Importable by name from the test's directory."""

import os
import signal
import time

import torch.distributed as dist

from raydist.strict import runtime
from raydist.training.trainer import Trainer

STOP_AFTER = int(os.environ.get("RAYDIST_TEST_STOP_AFTER", "0"))
STEP_S = float(os.environ.get("RAYDIST_TEST_STEP_S", "0"))
FILE = os.environ.get("RAYDIST_TEST_STOP_FILE", "")

_train_step = Trainer.train_step
_abort = runtime.abort_process


def _ended(why: str) -> None:
    with open(f"{FILE}.rank{dist.get_rank()}", "w") as f:
        f.write(f"{time.time()} {why}")


def train_step(self, batch=None):
    if dist.get_rank() == 1 and self.step == STOP_AFTER:
        with open(FILE, "w") as f:
            f.write(str(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(STEP_S)
    try:
        return _train_step(self, batch)
    except Exception as exc:
        _ended(f"raised: {type(exc).__name__}: {str(exc)[:200]}")
        raise


def abort_process(message: str) -> None:
    _ended(f"aborted: {message.splitlines()[0][:400]}")
    _abort(message)


Trainer.train_step = train_step
runtime.abort_process = abort_process
