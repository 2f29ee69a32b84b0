"""Save, commit, find and load checkpoints; every rank calls every method (they are collectives).

Save (optionally in a background thread, overlapping training):
    stage   copy the state to CPU (the only part that stalls training)
    write   torch.distributed.checkpoint.save -> step_N/ (each rank writes its shards), rank 0 writes extra.json
    commit  every rank hashes a share of the files, rank 0 gathers the digests and writes COMMIT.json last
    prune   rank 0 deletes committed checkpoints beyond the newest `keep` and partial leftovers
The background work runs on a process group of its own (gloo), so its collectives never interleave with
training's.

Find: the newest directory with a COMMIT.json whose files all match their sizes and hashes; a partial or
corrupt one is skipped with a warning naming what is wrong, and the previous one is used.
"""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from raydist.checkpoint import storage
from raydist.checkpoint.storage import COMMIT, EXTRA, join, step_dir_name


@dataclass
class Found:
    step: int
    uri: str
    skipped: list[str]  # warnings about newer checkpoints that could not be used


def _stage(tree: Any) -> Any:
    """A CPU copy of a nested state dict (DTensors stay DTensors, with CPU local shards)."""
    if isinstance(tree, dict):
        return {k: _stage(v) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    return tree


class CheckpointManager:
    # Test hook: called in the writer thread after the shards are written and before the commit.
    before_commit: Callable[[int], None] | None = None

    def __init__(self, run_dir: str, keep: int, group: dist.ProcessGroup | None = None,
                 log: Callable[[str], None] = print):
        self.root = join(run_dir, "checkpoints")
        self.keep = keep
        self.group = group
        self.log = log
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.committed_step: int | None = None  # newest step this manager committed
        self.last_write_s = 0.0

    # ---- save ----------------------------------------------------------------------------------
    def save(self, step: int, tensors: dict, extra: dict, blocking: bool) -> float:
        """Starts saving `tensors` (DCP) and `extra` (JSON) as step `step`; returns the seconds training
        was stalled (waiting for the previous save + staging)."""
        start = time.perf_counter()
        self.wait()
        staged = _stage(tensors)
        self._thread = threading.Thread(target=self._write_guarded, args=(step, staged, dict(extra)),
                                        name=f"raydist-checkpoint-{step}", daemon=True)
        self._thread.start()
        if blocking:
            self.wait()
        return time.perf_counter() - start

    def poll(self) -> int | None:
        """The newest committed step without blocking (a finished save's failure is raised here)."""
        if self._thread is not None and not self._thread.is_alive():
            return self.wait()
        return self.committed_step

    def wait(self) -> int | None:
        """Blocks until the save in flight (if any) committed; re-raises its failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"checkpoint save failed: {error}") from error
        return self.committed_step

    def _write_guarded(self, step: int, tensors: dict, extra: dict) -> None:
        try:
            self._write(step, tensors, extra)
        except BaseException as exc:  # surfaced by wait() in the training thread
            self._error = exc

    def _write(self, step: int, tensors: dict, extra: dict) -> None:
        start = time.perf_counter()
        uri = join(self.root, step_dir_name(step))
        fs, path = fsspec.core.url_to_fs(uri)
        if self.rank == 0 and fs.exists(path):  # a partial write of an earlier attempt
            fs.rm(path, recursive=True)
        dist.barrier(group=self.group)
        dcp.save(tensors, storage_writer=storage.writer(uri), process_group=self.group)
        if self.rank == 0:
            storage.write_json(join(uri, EXTRA), extra)
        dist.barrier(group=self.group)
        if CheckpointManager.before_commit is not None:
            CheckpointManager.before_commit(step)
        names = [n for n in storage.list_files(uri) if n != COMMIT]
        mine = storage.file_digests(uri, names[self.rank::self.world])
        gathered: list[dict | None] = [None] * self.world
        dist.all_gather_object(gathered, mine, group=self.group)
        if self.rank == 0:
            files = {k: v for part in gathered for k, v in part.items()}
            storage.write_commit(uri, step, files)  # last: from here on the checkpoint counts
            self._prune(step)
        dist.barrier(group=self.group)
        self.committed_step = step
        self.last_write_s = time.perf_counter() - start

    def _prune(self, newest: int) -> None:
        """Rank 0: keep the newest `keep` committed checkpoints; drop partial directories."""
        dirs = storage.list_step_dirs(self.root)
        committed = [(s, u) for s, u in dirs if storage.read_commit(u) is not None]
        doomed = committed[:-self.keep] + [(s, u) for s, u in dirs if s != newest and storage.read_commit(u) is None]
        for _, uri in doomed:
            fs, path = fsspec.core.url_to_fs(uri)
            fs.rm(path, recursive=True)

    # ---- find and load -------------------------------------------------------------------------
    def latest(self) -> Found | None:
        """The newest valid committed checkpoint (same answer on every rank), or None."""
        skipped: list[str] = []
        candidates = storage.list_step_dirs(self.root) if self.rank == 0 else []
        box = [candidates]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
        for step, uri in reversed(box[0]):
            problem = self._verify(uri)
            if problem is None:
                for message in skipped:
                    warnings.warn(message, stacklevel=2)
                    if self.rank == 0:
                        self.log(f"warning: {message}")
                return Found(step, uri, skipped)
            skipped.append(f"checkpoint {uri} is unusable ({problem}); trying the previous one")
        for message in skipped:
            warnings.warn(message, stacklevel=2)
            if self.rank == 0:
                self.log(f"warning: {message}")
        return None

    def _verify(self, uri: str) -> str | None:
        """None if `uri` is committed and intact (sizes everywhere, hashes split across ranks)."""
        commit = storage.read_commit(uri)
        if commit is None:
            problem = "no commit marker: the write did not finish"
        else:
            problem = storage.check_sizes(uri, commit)
            if problem is None:
                names = sorted(commit["files"])
                problem = storage.check_hashes(uri, commit, names[self.rank::self.world])
        problems: list[str | None] = [None] * self.world
        dist.all_gather_object(problems, problem, group=self.group)
        return next((p for p in problems if p is not None), None)

    def load(self, found: Found, tensors: dict) -> dict:
        """Loads `found` into `tensors` in place (resharding to their layout); returns extra.json."""
        dcp.load(tensors, storage_reader=storage.SafeReader(found.uri), process_group=self.group)
        return storage.read_json(join(found.uri, EXTRA))
