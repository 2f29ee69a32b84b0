"""A disk that fills up during a checkpoint save ends the run with a clear error, and the previous
committed checkpoint stays loadable and is not deleted.

The disk is `fullfile://` (faults_fs.py): an fsspec file system over local files that raises
OSError(ENOSPC) once the files under $FULLFILE_ROOT would exceed $FULLFILE_QUOTA bytes, registered in
every gloo process of the run.
"""

import os

import pytest

import faults_fs
from fault_runs import small_config
from raydist.checkpoint import storage
from raydist.testing import run_fit


def test_disk_full_during_a_checkpoint_keeps_the_previous_one(tiny_data, tmp_path, monkeypatch, reference):
    disk = tmp_path / "disk"
    disk.mkdir()
    run_dir = f"fullfile://host{disk}/run"
    monkeypatch.setenv("FULLFILE_ROOT", str(disk))
    raw = small_config(tiny_data)  # a checkpoint every 5 steps, keep 1
    assert run_fit(raw, 1, run_dir, crash_after_step=7, imports=("faults_fs",)) is None  # step 5 committed
    step5 = disk / "run" / "checkpoints" / storage.step_dir_name(5)
    before = {f: (step5 / f).read_bytes() for f in os.listdir(step5)}
    # room for half a checkpoint more: the final save (step 10) runs out of space
    monkeypatch.setenv("FULLFILE_QUOTA", str(faults_fs.disk_used(disk) + faults_fs.disk_used(step5) // 2))
    with pytest.raises(RuntimeError) as failure:
        run_fit(raw, 1, run_dir, imports=("faults_fs",))
    assert (f"checkpoint save failed: [Errno 28] no space left on checkpoint.storage while writing checkpoint "
            f"step 10 to fullfile://host{disk}/run/checkpoints/step_00000010 (") in str(failure.value)
    assert ("the committed checkpoint step 5 is kept and loadable; free space (the storage must hold "
            "checkpoint.keep + 1 checkpoints while a new one is written)") in str(failure.value)
    assert sorted(os.listdir(disk / "run" / "checkpoints")) == ["step_00000005"]  # the partial 10 was removed
    assert {f: (step5 / f).read_bytes() for f in os.listdir(step5)} == before
    monkeypatch.delenv("FULLFILE_QUOTA")  # space freed: the run resumes from step 5 and finishes
    [done] = run_fit(raw, 1, run_dir, imports=("faults_fs",))
    assert done.losses == pytest.approx(reference[5:], rel=1e-6)
