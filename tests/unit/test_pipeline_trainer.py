"""Pipeline parallelism through the Trainer (the path `raydist train` takes): losses and gradients equal
the single-process run with every schedule (the zero-bubble zbh1 and zbv included), composed with data
(DDP, FSDP), tensor (+ sequence) and context (ring, Ulysses) parallelism up to 4-D meshes, and checkpoints
move between pp sizes."""

import pytest

from raydist.testing import TWO_MICROBATCHES, assert_equivalent, run_fit, run_layout, run_layouts, tiny_config

MODEL = {"num_layers": 4}


def _config(tiny_data, parallel: dict, train: dict | None = None) -> dict:
    return tiny_config(tiny_data, model=MODEL, parallel={"dp_replicate": 1, **parallel}, train=train or {})


@pytest.fixture(scope="module")
def layout_runs(tiny_data):
    """`runs(table, world)`: every layout of `table` ((parallel, world) or (parallel, world, train) entries) at
    that world size, trained in one spawn (the first case of a world size pays it; a rank's start and warm-up
    cost more than most of these runs), per-rank results by index in `table`. A layout that raises fails every
    case of its world size, with its traceback."""
    from workers import patience

    done: dict[tuple[int, int], dict[int, list]] = {}

    def runs(table: list[tuple], world: int) -> dict[int, list]:
        if (id(table), world) not in done:
            indices = [i for i, entry in enumerate(table) if entry[1] == world]
            raws = [_config(tiny_data, table[i][0], *table[i][2:]) for i in indices]
            done[(id(table), world)] = dict(zip(indices, run_layouts(raws, world, timeout_s=patience(300))))
        return done[(id(table), world)]

    return runs


def _check_layout(reference, results, world: int) -> None:
    assert len(results) == world
    held = set()
    for rank in results:
        assert_equivalent(reference, rank)
        held |= set(rank.grads)
    assert held == set(reference.grads)  # every parameter lives on some stage


# (the tp and cp compositions, with no data parallelism, run two micro-batches a step: TWO_MICROBATCHES)
LAYOUTS = [
    ({"pp": 2, "pp_schedule": "1f1b"}, 2),
    ({"pp": 2, "pp_schedule": "interleaved", "virtual_stages": 2}, 2),
    ({"pp": 2, "pp_schedule": "gpipe", "dp_replicate": 2}, 4),
    ({"pp": 2, "pp_schedule": "1f1b", "dp_replicate": 1, "dp_shard": 2}, 4),
    ({"pp": 2, "pp_schedule": "1f1b", "tp": 2}, 4, TWO_MICROBATCHES),
    ({"pp": 2, "pp_schedule": "1f1b", "tp": 2, "sequence_parallel": True}, 4, TWO_MICROBATCHES),
    ({"pp": 2, "pp_schedule": "zbh1"}, 2),
    ({"pp": 2, "pp_schedule": "zbv"}, 2),
    ({"pp": 4, "pp_schedule": "zbh1"}, 4),
    ({"pp": 2, "pp_schedule": "zbv", "num_microbatches": 2}, 2),
    ({"pp": 2, "pp_schedule": "zbh1", "dp_shard": 2}, 4),
    ({"pp": 2, "pp_schedule": "zbv", "dp_shard": 2}, 4),
    ({"pp": 2, "pp_schedule": "zbh1", "dp_replicate": 2}, 4),
    ({"pp": 2, "pp_schedule": "zbv", "tp": 2, "sequence_parallel": True}, 4, TWO_MICROBATCHES),
    ({"pp": 2, "cp": 2, "cp_impl": "ring"}, 4, TWO_MICROBATCHES),
    ({"pp": 2, "cp": 2, "cp_impl": "ulysses"}, 4, TWO_MICROBATCHES),
    ({"pp": 2, "pp_schedule": "zbv", "cp": 2, "cp_impl": "ring"}, 4, TWO_MICROBATCHES),
]


@pytest.mark.slow  # every case reads one spawn per world size (`layout_runs`): not for the inner loop
@pytest.mark.timeout(400)  # the first case of a world size trains all of its layouts (spawn's own bound: 300 s)
@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[
    "pp2-1f1b", "pp2-interleaved", "pp2xdp2-gpipe", "pp2xfsdp2", "pp2xtp2", "pp2xtp2-sp", "pp2-zbh1", "pp2-zbv",
    "pp4-zbh1", "pp2-zbv-m2", "pp2xfsdp2-zbh1", "pp2xfsdp2-zbv", "pp2xddp2-zbh1", "pp2xtp2-sp-zbv", "pp2xcp2-ring",
    "pp2xcp2-ulysses", "pp2xcp2-ring-zbv"])
def test_pipeline_equals_single_process(single_4_layers, layout_runs, index):
    world = LAYOUTS[index][1]
    _check_layout(single_4_layers, layout_runs(LAYOUTS, world)[index], world)


TRAIN = {"steps": 6, "global_batch": 8}
CKPT = {"every_steps": 3, "async_save": False}


@pytest.fixture(scope="module")
def uninterrupted(tiny_data, tmp_path_factory) -> list[float]:
    """The losses of the uninterrupted single-process run (6 steps, a checkpoint every 3) that the
    checkpoint tests below continue; one run for all of them."""
    [reference] = run_fit(tiny_config(tiny_data, model=MODEL, train=TRAIN, checkpoint=CKPT), 1,
                          str(tmp_path_factory.mktemp("uninterrupted")))
    assert len(reference.losses) == TRAIN["steps"]
    return reference.losses


def test_pipeline_checkpoint_loads_at_pp1(tiny_data, tmp_path, uninterrupted):
    """Save at pp 2 (tied embedding split across stages), resume at pp 1: same continuation."""
    run_dir = str(tmp_path / "pp")
    pp2 = tiny_config(tiny_data, model=MODEL, train=TRAIN, checkpoint=CKPT, parallel={"dp_replicate": 1, "pp": 2})
    assert run_fit(pp2, 2, run_dir, crash_after_step=4) is None
    resumed = run_fit(tiny_config(tiny_data, model=MODEL, train=TRAIN, checkpoint=CKPT), 1, run_dir)
    assert resumed[0].losses == pytest.approx(uninterrupted[3:], rel=1e-5)


MESHES_4D = [
    ({"pp": 2, "pp_schedule": "zbh1", "dp_shard": 2, "cp": 2, "cp_impl": "ring"}, 8),
    ({"pp": 2, "pp_schedule": "1f1b", "tp": 2, "cp": 2, "cp_impl": "ring", "sequence_parallel": True}, 8,
     TWO_MICROBATCHES),
]


@pytest.mark.slow  # about 2 minutes each on 2 cores (8 processes); kept in the default run
@pytest.mark.timeout(400)  # the first case trains both meshes in one spawn (its own bound: 300 s)
@pytest.mark.parametrize("index", range(len(MESHES_4D)), ids=["pp2xfsdp2xcp2-zbh1", "pp2xtp2xcp2-sp"])
def test_pipeline_in_4d_meshes_equals_single_process(single_4_layers, layout_runs, index):
    """8 workers: the pipeline inside a 4-D mesh; activations between stages are (B, T / cp, D), and
    (B, T / (cp tp), D) with sequence parallelism; RoPE positions come from the context-parallel shard."""
    _check_layout(single_4_layers, layout_runs(MESHES_4D, 8)[index], 8)


@pytest.mark.slow  # about 95 s on 2 cores (its own 8-layer reference)
def test_zbv_at_pp4_equals_single_process(tiny_data):
    """ZB-V at pp 4 needs 8 virtual stages, so 8 blocks; rank 0 holds the first and the last stage."""
    raw = tiny_config(tiny_data, model={"num_layers": 8}, train={"steps": 6})
    [reference] = run_layout(raw, 1, steps=6)
    results = run_layout(tiny_config(tiny_data, model={"num_layers": 8}, train={"steps": 6},
                                     parallel={"dp_replicate": 1, "pp": 4, "pp_schedule": "zbv"}), 4, steps=6)
    for rank in results:
        assert_equivalent(reference, rank)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_pipeline_checkpoint_resumes_at_pp2(tiny_data, tmp_path, uninterrupted, schedule):
    """Save and resume at pp 2: the continuation equals the uninterrupted run. Each stage's optimizer
    hyper-parameters are keyed by its own parameters, so every rank's JSON joins the checkpoint; ZB-V puts
    the embedding and its tied output copy on one rank (two names, one optimizer entry in the checkpoint)."""
    parallel = {"dp_replicate": 1, "pp": 2, "pp_schedule": schedule}
    run_dir = str(tmp_path / "zbv")
    raw = tiny_config(tiny_data, model=MODEL, train=TRAIN, checkpoint=CKPT, parallel=parallel)
    assert run_fit(raw, 2, run_dir, crash_after_step=4) is None
    resumed = run_fit(raw, 2, run_dir)
    assert resumed[0].losses == pytest.approx(uninterrupted[3:], rel=1e-4)


RECOMPUTE = [({"pp": 2, "pp_schedule": "zbv"}, 2, {"activation_checkpoint": policy, "activation_checkpoint_k": 1})
             for policy in ("full", "every_k")]


@pytest.mark.slow  # every case reads one spawn per world size (`layout_runs`): not for the inner loop
@pytest.mark.parametrize("index", range(len(RECOMPUTE)), ids=["full", "every_k"])
def test_zero_bubble_with_recompute_equals_single_process(single_4_layers, layout_runs, index):
    """Recompute regions are re-run in B and their saved tensors still serve W (selective recompute, whose
    cache serves one backward pass, is refused by the layout validator)."""
    _check_layout(single_4_layers, layout_runs(RECOMPUTE, 2)[index], 2)
