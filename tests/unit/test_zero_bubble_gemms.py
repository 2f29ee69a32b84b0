"""A zero-bubble schedule with the Triton matmul launches as many GEMMs per step as 1F1B (Qi et al.'s split
backward: B computes dX, W computes dW, neither the other's). The custom op's backward decides what to
compute from what the autograd engine will run (`raydist.schedule.split_backward.wanted`), not from
`needs_input_grad`, which is fixed at forward time and made B and W each launch both. Triton runs under
TRITON_INTERPRET=1."""

import os

import pytest
import torch

from raydist.kernels import runtime
from raydist.parallel.runtime import spawn
from raydist.testing import tiny_config

pytestmark = pytest.mark.skipif(runtime.triton_import_error() is not None,
                                reason=f"triton not importable: {runtime.triton_import_error()}")


def _gemms_per_step(raw):
    os.environ["TRITON_INTERPRET"] = "1"
    from raydist.config import Config
    from raydist.kernels.matmul import GEMMS
    from raydist.training.trainer import Trainer

    trainer = Trainer(Config.from_dict(raw), torch.device("cpu"))
    trainer.train_step()  # (the first step also runs step 0's loss)
    batch = trainer.next_batch()
    before = sum(GEMMS.values())
    loss = trainer.train_step(batch).loss
    trainer.close()
    return sum(GEMMS.values()) - before, loss


def _raw(tiny_data, schedule):
    return tiny_config(tiny_data, model={"d_model": 32, "num_heads": 2, "num_kv_heads": 1, "ffn_hidden": 64},
                       kernels={"attention": "sdpa", "matmul": "triton"},
                       train={"global_batch": 4, "micro_batch": 1},
                       parallel={"pp": 2, "dp_replicate": 1, "pp_schedule": schedule})


def test_zbh1_launches_the_gemms_of_1f1b(tiny_data):
    one_f_one_b = spawn(_gemms_per_step, 2, _raw(tiny_data, "1f1b"))
    zbh1 = spawn(_gemms_per_step, 2, _raw(tiny_data, "zbh1"))
    for (gemms, loss), (split_gemms, split_loss) in zip(one_f_one_b, zbh1, strict=True):
        # 4 micro-batches, each linear: 1 forward GEMM + dX + dW (the first stage's dX of its first linear
        # only where its input needs one)
        assert gemms > 0 and split_gemms == gemms, (gemms, split_gemms)
        assert split_loss == pytest.approx(loss, rel=1e-5)
