"""Save, commit, find and load checkpoints; every rank calls every method (they are collectives).

A checkpoint is a dict of stateful parts (`raydist.checkpoint.state`): their tensors go to DCP, the rest
to extra.json ({"format": 2, "step": N, "parts": {name: JSON state}}).

Save:
    stage   blocking: none, the live tensors are written (training waits anyway); async: a host copy (the
            only part that stalls training), then the rest in a background thread
    write   torch.distributed.checkpoint.save -> step_N/: each rank writes raw chunk files with parallel
            threads, checksummed while written (rawio.py); rank 0 writes extra.json meanwhile
    commit  the ranks' file and chunk checksums reach rank 0 inside DCP's write results (the writer's
            `finish`), and rank 0 writes COMMIT.json last: no listing, no gather, no reading back
    prune   rank 0, in the background: verified checkpoints beyond the newest `keep`, and partial or corrupt
            ones older than the newest verified one (see `_prune`; a committed one is never overwritten)
The background work runs on a process group of its own (gloo), so its collectives never interleave with
training's.

Find (rank 0, broadcast to all): the newest directory with a COMMIT.json whose files all have their
committed sizes. Load: every chunk is checked against its checksum as it is read; a mismatch falls back to
the previous checkpoint (`load_newest`). A partial or corrupt checkpoint is skipped with a warning naming
what is wrong.
"""

from __future__ import annotations

import errno
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import fsspec
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from raydist.checkpoint import storage
from raydist.checkpoint.rawio import ChecksumMismatch, RawSavePlanner
from raydist.checkpoint.staging import cuda_devices, stage, wait_for_copies
from raydist.checkpoint.state import Stateful, merge_state, split_state
from raydist.checkpoint.storage import EXTRA, join, step_dir_name
from raydist.errors import ConfigError
from raydist.store.redact import redact

EXTRA_FORMAT = 2
METADATA = ".metadata"


@dataclass
class Found:
    step: int
    uri: str
    skipped: list[str]  # warnings about newer checkpoints that could not be used
    commit: dict = field(default_factory=dict)  # its COMMIT.json


def _union(trees: list[dict]) -> dict:
    """Nested dicts merged key by key; the first tree holding a leaf wins."""
    out: dict = {}
    for tree in trees:
        for key, value in tree.items():
            if key not in out:
                out[key] = value
            elif isinstance(out[key], dict) and isinstance(value, dict):
                out[key] = _union([out[key], value])
    return out


class CheckpointManager:
    # Test hook: called on every rank after the files are written and before the commit.
    before_commit: Callable[[int], None] | None = None

    def __init__(self, run_dir: str, keep: int, group: dist.ProcessGroup | None = None,
                 log: Callable[[str], None] = print, timeout_s: float | None = None, write_threads: int = 2):
        """`timeout_s`: the longest `wait()` waits for a save in flight (None: no bound); `write_threads`:
        files each rank writes in parallel."""
        self.root = join(run_dir, "checkpoints")
        self.timeout_s = timeout_s
        self.keep = keep
        self.group = group
        self.log = log
        self.write_threads = write_threads
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._thread: threading.Thread | None = None
        self._pruner: threading.Thread | None = None
        self._error: BaseException | None = None
        self.committed_step: int | None = None  # newest step this manager committed
        self._staging: dict = {}  # async saves' host buffers, refilled by the next one (`stage`)
        self.last_write_s = 0.0

    # ---- save ----------------------------------------------------------------------------------
    def save(self, step: int, parts: dict[str, Stateful], blocking: bool) -> float:
        """Saves `parts` as step `step` (in the background unless `blocking`); returns the seconds training
        was stalled (waiting for the previous save, staging, and the whole write when blocking)."""
        start = time.perf_counter()
        self.wait()
        tensors, json_state, _ = split_state(parts)
        if self.world > 1:
            # JSON leaves only some ranks hold (a pipeline stage's optimizer hyper-parameters, keyed by its
            # own parameters' names) join rank 0's, which rank 0 writes: the union over ranks, rank 0's
            # value wherever several hold one key.
            gathered: list = [None] * self.world
            dist.all_gather_object(gathered, json_state, group=self.group)
            json_state = _union(gathered)
        extra = {"format": EXTRA_FORMAT, "step": step, "parts": json_state}
        if blocking:  # no staging copy: the training thread writes the live tensors and waits
            self._write_guarded(step, tensors, extra)
            self.wait()
        else:
            devices = cuda_devices(tensors)  # on CUDA: stage through pinned memory, one wait per device
            kept: dict = {}
            staged = stage(tensors, pinned=bool(devices), previous=self._staging, kept=kept)
            self._staging = kept
            if devices:
                wait_for_copies(devices)
            self._thread = threading.Thread(target=self._write_guarded, args=(step, staged, extra),
                                            name=f"raydist-checkpoint-{step}", daemon=True)
            self._thread.start()
        return time.perf_counter() - start

    def poll(self) -> int | None:
        """The newest committed step without blocking (a finished save's failure is raised here)."""
        if self._thread is not None and not self._thread.is_alive():
            return self.wait()
        return self.committed_step

    def wait(self) -> int | None:
        """Blocks until the save in flight (if any) committed and old checkpoints are pruned; re-raises a
        failure."""
        for attr in ("_thread", "_pruner"):
            thread = getattr(self, attr)
            if thread is not None:
                thread.join(self.timeout_s)
                if thread.is_alive():
                    raise TimeoutError(f"checkpoint thread {thread.name} did not finish within {self.timeout_s:g}s "
                                       "(elastic.checkpoint_timeout_s): a hung storage or a peer that stopped")
                setattr(self, attr, None)
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
        """No-loss rules: a committed checkpoint is never removed or overwritten here. If step_N is
        already committed and intact (a resumed run's final save at the step it resumed from; the step
        fixes the state, since an attempt only reaches N again while a valid step_N exists by loading it)
        it is kept as it is and this save is skipped, so there is no window without it on any storage;
        only a partial or corrupt step_N is replaced. A full disk ends in an ENOSPC error naming the
        checkpoint kept, after removing this attempt's files."""
        start = time.perf_counter()
        uri = join(self.root, step_dir_name(step))

        def problem_cleared() -> str | None:
            """Rank 0: what is wrong with an existing step_N (None: committed and intact), a partial or
            corrupt one removed before the answer goes out (so the broadcast is the barrier too)."""
            problem = self._problem(uri)
            fs, path = fsspec.core.url_to_fs(uri)
            if problem is not None and fs.exists(path):
                storage.remove_dir(uri)  # partial or corrupt, never a usable checkpoint
            return problem

        if self._broadcast(problem_cleared) is None:
            self.committed_step = step  # already committed and intact: nothing to write
            return
        try:
            writer = storage.writer(uri, self.write_threads)
            # rank 0 writes extra.json while the tensors are written (its fsync off the critical path); the
            # pool's exit waits for it whatever happens
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="raydist-extra") as pool:
                extra_record = pool.submit(self._write_extra, uri, extra) if self.rank == 0 else None
                dcp.save(tensors, storage_writer=writer, planner=RawSavePlanner(), process_group=self.group)
            if CheckpointManager.before_commit is not None:
                CheckpointManager.before_commit(step)
            if self.rank == 0:  # the writer's finish() gathered every rank's file and chunk checksums
                files = dict(writer.files)
                files.update(storage.file_digests(uri, [METADATA]))
                files[EXTRA] = extra_record.result()
                storage.write_commit(uri, step, files, writer.chunks)  # last: from here on the checkpoint counts
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            full = _disk_full(exc)
            if full is None:
                raise
            if self.rank == 0:  # free what this attempt took; committed checkpoints stay
                try:
                    storage.remove_dir(uri)
                except Exception:
                    pass
            kept = [s for s, u in storage.list_step_dirs(self.root) if s != step and storage.read_commit(u)]
            raise OSError(errno.ENOSPC, f"no space left on checkpoint.storage while writing checkpoint step "
                          f"{step} to {redact(uri)} ({redact(_first_line(full))}); "
                          + (f"the committed checkpoint step {kept[-1]} is kept and loadable" if kept
                             else "no committed checkpoint exists yet")
                          + "; free space (the storage must hold checkpoint.keep + 1 checkpoints while "
                          "a new one is written)") from exc
        if self.rank == 0:  # off the critical path; wait() joins it before the next save
            self._pruner = threading.Thread(target=self._prune, args=(step,), daemon=True,
                                            name=f"raydist-prune-{step}")
            self._pruner.start()
        self.committed_step = step  # rank 0 only after COMMIT.json: the ranks agree on the minimum
        self.last_write_s = time.perf_counter() - start

    @staticmethod
    def _write_extra(uri: str, extra: dict) -> dict:
        """extra.json in the directory being written (`{size, crc32}` for the commit record)."""
        fs, path = fsspec.core.url_to_fs(uri)
        fs.makedirs(path, exist_ok=True)
        return storage.write_json_recorded(join(uri, EXTRA), extra)

    def _rank0(self) -> int:
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0

    def _broadcast(self, compute: Callable[[], Any]) -> Any:
        """`compute()` on rank 0 (a storage read), its result on every rank."""
        box = [compute() if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=self._rank0(), group=self.group)
        return box[0]

    @staticmethod
    def _problem(uri: str) -> str | None:
        """None if `uri` is committed with every file at its size (and, for commits of earlier versions
        without chunk checksums, every file's hash), else what is wrong. Rank 0 only."""
        commit = storage.read_commit(uri)
        if commit is None:
            return "no commit marker: the write did not finish"
        problem = storage.check_sizes(uri, commit)
        if problem is None and "chunks" not in commit:
            problem = storage.check_hashes(uri, commit, sorted(commit["files"]))
        return problem

    def _prune(self, newest: int) -> None:
        """Rank 0: keep the newest `keep` verified checkpoints (COMMIT.json present, every file at its
        committed size); a corrupt one never holds a slot. Delete older verified ones beyond `keep`, and
        partial or corrupt directories only when they are older than the newest verified checkpoint (a
        newer one may be a write still in flight, and until something newer commits they cost only space).
        Nothing is deleted when no checkpoint verifies. Directories newer than `newest` (left by an
        earlier attempt and skipped on resume) are neither counted nor deleted until training passes them."""
        dirs = [(s, u) for s, u in storage.list_step_dirs(self.root) if s <= newest]
        verified, unusable = [], []
        for step, uri in dirs:
            commit = storage.read_commit(uri)
            ok = commit is not None and storage.check_sizes(uri, commit) is None
            (verified if ok else unusable).append((step, uri))
        if not verified:
            return
        newest_good = verified[-1][0]
        doomed = verified[:-self.keep] + [(s, u) for s, u in unusable if s < newest_good]
        for _, uri in doomed:
            storage.remove_dir(uri)

    # ---- find and load -------------------------------------------------------------------------
    def latest(self, before: int | None = None) -> Found | None:
        """The newest committed checkpoint with every file at its size (older than step `before` when
        given), the same answer on every rank, or None."""

        def search() -> tuple[Found | None, list[str]]:
            skipped = []
            for step, uri in reversed(storage.list_step_dirs(self.root)):
                if before is not None and step >= before:
                    continue
                problem = self._problem(uri)
                if problem is None:
                    return Found(step, uri, [], storage.read_commit(uri)), skipped
                skipped.append(redact(f"checkpoint {uri} is unusable ({problem}); trying the previous one"))
            return None, skipped

        found, skipped = self._broadcast(search)
        self._warn(skipped)
        if found is not None:
            found.skipped = skipped
        return found

    def _warn(self, messages: list[str]) -> None:
        for message in messages:
            warnings.warn(message, stacklevel=3)
            if self.rank == 0:
                self.log(f"warning: {message}")

    def load(self, found: Found, parts: dict[str, Stateful]) -> dict:
        """Loads `found` into `parts` (tensors resharded to their current layout, each chunk checked against
        its checksum as it is read); returns the parts' JSON state as saved ({part name: dict})."""
        json_state = read_extra(found.uri)
        for name, part in parts.items():  # a part whose tensors depend on what was saved is told first
            if hasattr(part, "before_load"):
                part.before_load(json_state.get(name, {}))
        tensors, _, owners = split_state(parts)
        reader = storage.SafeReader(found.uri, chunks=found.commit.get("chunks"))
        dcp.load(tensors, storage_reader=reader, process_group=self.group)
        merge_state(parts, tensors, owners, json_state)
        return json_state

    def load_newest(self, parts: dict[str, Stateful]) -> tuple[Found, dict] | tuple[None, None]:
        """Loads the newest checkpoint that loads intact, falling back past ones whose chunks fail their
        checksums; (found, its JSON state) or (None, None)."""
        found = self.latest()
        skipped: list[str] = []
        while found is not None:
            try:
                state = self.load(found, parts)
                found.skipped = skipped + found.skipped
                return found, state
            except BaseException as exc:
                bad = _corrupt(exc)
                if bad is None:
                    raise
                message = redact(f"checkpoint {found.uri} is unusable ({_first_line(bad)}); trying the previous one")
                self._warn([message])
                skipped += found.skipped + [message]
                found = self.latest(before=found.step)
        if skipped:  # chunks were already loaded: without an older checkpoint nothing restores the init
            raise ConfigError(f"{skipped[0].split(' is unusable')[0]} is corrupt and no older checkpoint loads; "
                              "check it with `raydist verify RUN_DIR`, move it away to start over, or pick another "
                              "train.run_name")
        return None, None


def read_extra(ckpt_uri: str) -> dict:
    """The parts' JSON state of a checkpoint ({part name: dict}); the format before stateful parts (one
    flat dict) is read too."""
    extra = storage.read_json(join(ckpt_uri, EXTRA))
    if "parts" in extra:
        return extra["parts"]
    return {"model_optim": {"optim": extra["optimizer_hyper"]}, "schedule": extra["scheduler"],
            "data": {k: extra[k] for k in ("step", "position", "global_batch")}, "rng": extra["rng"],
            "run": {"world_size": extra["world_size"], "mesh": extra["mesh"], "notes": extra.get("notes", {})}}


def _find(exc: BaseException, match: Callable[[BaseException], bool]) -> BaseException | None:
    """The first error in `exc` or what it wraps (DCP gathers every rank's failure) that `match`es."""
    seen, stack = set(), [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if match(e):
            return e
        if isinstance(e, tuple):  # DCP's (exception, traceback summary) per failed rank
            stack.extend(x for x in e if isinstance(x, BaseException))
            continue
        stack.extend([e.__cause__, e.__context__])
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack.extend(failures.values())
    return None


def _disk_full(exc: BaseException) -> BaseException | None:
    return _find(exc, lambda e: getattr(e, "errno", None) == errno.ENOSPC)


def _corrupt(exc: BaseException) -> BaseException | None:
    return _find(exc, lambda e: isinstance(e, ChecksumMismatch))


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
