"""fsspec file systems for the fault tests, registered as protocols when this module is imported.

All keep their files on the local disk (so spawned gloo processes share them: `run_fit(...,
imports=("faults_fs",))` registers the protocols in each process) but are not fsspec's "file"
protocol, so raydist treats them as object storage (whole-file PUTs, per-writer JSON-lines parts):

    objfile://host/abs/path             plain, object-store semantics
    credfile://KEY:SECRET@host/abs/path  refuses every operation unless the URI carries KEY:SECRET
    fullfile://host/abs/path            raises OSError(ENOSPC) once the files under $FULLFILE_ROOT
                                        would exceed $FULLFILE_QUOTA bytes (a full disk)
    rofile://host/abs/path              reads work; every write raises PermissionError(EROFS) (tests run
                                        as root, whom chmod does not stop: this is the read-only mount)
"""

from __future__ import annotations

import errno
import os

import fsspec
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

KEY, SECRET = "AKIAFAULTKEY", "s3cr3t/VALUE+xyz"


class ObjFileSystem(LocalFileSystem):
    protocol = ("objfile",)

    @classmethod
    def _strip_protocol(cls, path):
        path = fsspec.utils.stringify_path(path)
        for proto in cls.protocol:
            if path.startswith(proto + "://"):
                rest = path[len(proto) + 3:]
                host, _, tail = rest.partition("/")
                return "/" + tail.rstrip("/") if tail else "/"
        return LocalFileSystem._strip_protocol(path)

    def unstrip_protocol(self, name):
        return f"{self.protocol[0]}://host{name}"

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        """A PUT is atomic on an object store: readers see the old object or the new one, never a mix
        (the local file system's open-truncate-write would let concurrent writers interleave bytes)."""
        path = self._strip_protocol(path)
        tmp = f"{path}.put-{os.getpid()}-{id(value):x}-{os.urandom(4).hex()}"
        with open(tmp, "wb") as f:
            f.write(value)
        os.replace(tmp, path)


class CredFileSystem(ObjFileSystem):
    protocol = ("credfile",)

    def __init__(self, key=None, secret=None, **kwargs):
        if (key, secret) != (KEY, SECRET):
            raise PermissionError(errno.EACCES, "credfile: missing or wrong credentials in the URI")
        super().__init__(**kwargs)

    @staticmethod
    def _get_kwargs_from_urls(path):
        rest = path.split("://", 1)[-1]
        if "@" not in rest:
            return {}
        key, _, secret = rest.rsplit("@", 1)[0].partition(":")
        return {"key": key, "secret": secret}

    @classmethod
    def _strip_protocol(cls, path):
        path = fsspec.utils.stringify_path(path)
        if path.startswith("credfile://") and "@" in path:
            path = "credfile://" + path.rsplit("@", 1)[1]
        return super()._strip_protocol(path)


def disk_used(root: str) -> int:
    total = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:
                pass
    return total


class _QuotaFile(LocalFileOpener):
    def write(self, data):
        quota = int(os.environ.get("FULLFILE_QUOTA", "0") or 0)
        if quota:
            self.f.flush()
            if disk_used(os.environ["FULLFILE_ROOT"]) + len(data) > quota:
                raise OSError(errno.ENOSPC, "No space left on device", self.path)
        return self.f.write(data)


class FullFileSystem(ObjFileSystem):
    protocol = ("fullfile",)

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        path = self._strip_protocol(path)
        if self.auto_mkdir and "w" in mode:
            self.makedirs(self._parent(path), exist_ok=True)
        return _QuotaFile(path, mode, fs=self, **kwargs)


class ReadOnlyFileSystem(ObjFileSystem):
    protocol = ("rofile",)

    def _refuse(self, *args, **kwargs):
        raise PermissionError(errno.EROFS, "Read-only file system")

    def _open(self, path, mode="rb", **kwargs):
        if any(c in mode for c in "wax+"):
            self._refuse()
        return super()._open(path, mode, **kwargs)

    makedirs = mkdir = rm = rm_file = rmdir = mv = cp_file = touch = pipe_file = _refuse


for _cls in (ObjFileSystem, CredFileSystem, FullFileSystem, ReadOnlyFileSystem):
    fsspec.register_implementation(_cls.protocol[0], _cls, clobber=True)
