"""No checkpoint is lost: a committed checkpoint is deleted or overwritten only after a newer verified one
has committed, a corrupt one never holds a keep-k slot, and a crash at any point of a save leaves a
loadable checkpoint."""

import os
import shutil

import pytest
import torch
import torch.distributed as dist

from fault_runs import files_under, small_config
from raydist.checkpoint import CheckpointManager, manager as manager_module, storage
from raydist.parallel.runtime import spawn
from raydist.testing import run_fit


def steps_on_disk(run_dir) -> list[int]:
    return [s for s, _ in storage.list_step_dirs(os.path.join(run_dir, "checkpoints"))]


def ckpt(run_dir, step) -> str:
    return os.path.join(run_dir, "checkpoints", storage.step_dir_name(step))


def intact(uri) -> bool:
    commit = storage.read_commit(uri)
    return commit is not None and storage.check_sizes(uri, commit) is None and \
        storage.check_hashes(uri, commit, sorted(commit["files"])) is None


def plant_corrupt(run_dir, source_step, step):
    """A newer checkpoint that committed and was damaged afterwards (one shard truncated)."""
    shutil.copytree(ckpt(run_dir, source_step), ckpt(run_dir, step))
    shard = next(f for f in sorted(os.listdir(ckpt(run_dir, step))) if f.endswith(".raw"))
    with open(os.path.join(ckpt(run_dir, step), shard), "r+b") as f:
        f.truncate(100)


# ---- (a) a corrupt newest checkpoint with keep=1, crashes around it, end to end -------------------------


def test_corrupt_newest_never_holds_the_slot(tiny_data, tmp_path, reference):
    run_dir = str(tmp_path / "run")
    raw = small_config(tiny_data, every_steps=2)  # keep 1
    assert run_fit(raw, 1, run_dir, crash_after_step=5) is None  # committed 2, then 4 (2 pruned)
    assert steps_on_disk(run_dir) == [4]
    plant_corrupt(run_dir, 4, 7)

    # Resumes from 4 (7 is skipped), commits 6, dies after step 7. Counting the corrupt 7 as one of the
    # `keep` would have deleted 6 (and 4) and left nothing loadable.
    assert run_fit(raw, 1, run_dir, crash_after_step=7) is None
    assert steps_on_disk(run_dir) == [6, 7] and intact(ckpt(run_dir, 6))

    # Dies while step 8 is written: 6 is still there and intact.
    assert run_fit(raw, 1, run_dir, crash_before_commit_of=8) is None
    assert steps_on_disk(run_dir) == [6, 7, 8] and intact(ckpt(run_dir, 6))

    # Finishes from 6: once 8 commits, 6 (beyond keep) and the corrupt 7 (older than 8) go.
    [done] = run_fit(raw, 1, run_dir)
    assert done.losses == pytest.approx(reference[6:], rel=1e-6)
    assert steps_on_disk(run_dir) == [10] and intact(ckpt(run_dir, 10))


# ---- a crash at any point of a save (manager level) ------------------------------------------------------


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Value:
    """A stateful checkpoint part: a tensor and the number it is filled with (JSON)."""

    def __init__(self, value: float):
        self.w, self.value = torch.full((4096,), float(value)), value

    def state_dict(self) -> dict:
        return {"w": self.w, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.w, self.value = state["w"], state["value"]


def save(run_dir, step, value, keep=1):
    CheckpointManager(run_dir, keep=keep, log=lambda *_: None).save(step, {"part": Value(value)}, blocking=True)


def load_latest(run_dir):
    manager = CheckpointManager(run_dir, keep=1, log=lambda *_: None)
    found = manager.latest()
    if found is None:
        return None
    part = Value(0.0)
    manager.load(found, {"part": part})
    assert float(part.w[0]) == part.value
    return found.step


def _save_and_crash(run_dir: str, step: int, crash_at: str) -> None:
    """In a spawned rank: save `step`, dying (no cleanup) at `crash_at`."""
    def die(*_):
        os._exit(19)

    if crash_at == "before_commit":  # shards and extra.json written, no COMMIT.json
        CheckpointManager.before_commit = staticmethod(die)
    elif crash_at == "after_commit":  # committed, nothing pruned yet
        write_commit = storage.write_commit
        storage.write_commit = lambda *a, **k: (write_commit(*a, **k), die())
    elif crash_at == "mid_prune":  # the first deletion got as far as the commit marker
        def remove_dir(uri):
            os.remove(os.path.join(uri, storage.COMMIT))
            die()
        storage.remove_dir = remove_dir
    save(run_dir, step, float(step))


@pytest.mark.parametrize("crash_at, loaded", [("before_commit", 2), ("after_commit", 4), ("mid_prune", 4)])
def test_a_crash_at_any_point_of_a_save_leaves_a_loadable_checkpoint(tmp_path, group, crash_at, loaded):
    run_dir = str(tmp_path / "run")
    save(run_dir, 2, 2.0)
    plant_corrupt(run_dir, 2, 3)
    with pytest.raises(RuntimeError, match="exited with status 19"):
        spawn(_save_and_crash, 1, run_dir, 4, crash_at)
    assert load_latest(run_dir) == loaded
    if loaded == 2:
        assert intact(ckpt(run_dir, 2))
    save(run_dir, 6, 6.0)  # the next save tidies up: only the newest verified one is left
    assert steps_on_disk(run_dir) == [6] and load_latest(run_dir) == 6


def test_partial_directories_go_only_when_older_than_the_newest_commit(tmp_path, group):
    run_dir = str(tmp_path / "run")
    for step in (1, 9):  # a crashed write before and one after the checkpoint about to be written
        os.makedirs(ckpt(run_dir, step))
        open(os.path.join(ckpt(run_dir, step), "__0_0.raw"), "wb").write(b"x")
    save(run_dir, 4, 4.0)
    assert steps_on_disk(run_dir) == [4, 9]
    save(run_dir, 12, 12.0)
    assert steps_on_disk(run_dir) == [12]


# ---- (b) re-saving a step that is already committed ------------------------------------------------------


def test_resaving_a_committed_step_keeps_it_untouched(tmp_path, group, monkeypatch):
    run_dir = str(tmp_path / "run")
    save(run_dir, 4, 4.0)
    before = files_under(ckpt(run_dir, 4))

    def forbidden(*args, **kwargs):
        raise AssertionError("a committed checkpoint was removed or rewritten")

    monkeypatch.setattr(storage, "remove_dir", forbidden)
    monkeypatch.setattr(manager_module.dcp, "save", forbidden)
    save(run_dir, 4, 4.0)  # nothing removed, nothing written: no window without a committed step 4
    assert files_under(ckpt(run_dir, 4)) == before
    assert load_latest(run_dir) == 4


def test_resaving_a_corrupt_step_replaces_it(tmp_path, group):
    run_dir = str(tmp_path / "run")
    save(run_dir, 2, 2.0, keep=2)
    save(run_dir, 4, 4.0, keep=2)
    plant_corrupt(run_dir, 2, 6)  # step 6's files are step 2's, one truncated
    save(run_dir, 6, 6.0, keep=2)
    assert intact(ckpt(run_dir, 6)) and load_latest(run_dir) == 6
    assert steps_on_disk(run_dir) == [4, 6]


def test_resumed_final_save_at_a_committed_step_is_skipped(tiny_data, tmp_path):
    """End to end: a run killed after its final checkpoint but before summary.json, run again."""
    run_dir = str(tmp_path / "run")
    raw = small_config(tiny_data, steps=5)
    run_fit(raw, 1, run_dir)
    os.remove(os.path.join(run_dir, "summary.json"))
    before = files_under(ckpt(run_dir, 5))
    [again] = run_fit(raw, 1, run_dir)
    assert again.losses == [] and again.summary["steps"] == 5
    assert files_under(ckpt(run_dir, 5)) == before
