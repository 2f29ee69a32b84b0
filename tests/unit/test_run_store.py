"""RunStore: one run directory on local disk or remote fsspec storage (memory://, and S3 through a local moto
server), decided once. Round trips of whole files, atomic replacement (a failure in the middle of a write
keeps the old file whole), JSON-lines appends from several writers and readers that return complete
records only, the tail the driver follows, and the local primitives of the lease."""

from __future__ import annotations

import io
import json
import os
import uuid

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from raydist.parallel.runtime import free_port
from raydist.store import atomic
from raydist.store.run_store import RunStore, join


@pytest.fixture(scope="module")
def s3_root():
    """A bucket on a local moto server (no network), reached through s3fs as any s3:// URI would be."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    import fsspec.config
    import s3fs

    saved_conf = json.loads(json.dumps(fsspec.config.conf))
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_DEFAULT_REGION": "us-east-1",
                           "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"}.items():
            mp.setenv(key, value)
        fsspec.config.set_conf_env(fsspec.config.conf)
        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir("run-store-test")
        yield "s3://run-store-test"
        s3fs.S3FileSystem.clear_instance_cache()
        fsspec.config.conf.clear()
        fsspec.config.conf.update(saved_conf)
    server.stop()


def _memory_uri() -> str:
    return f"memory://run-store-{uuid.uuid4().hex[:8]}/run"


@pytest.fixture(params=["local", "memory", "s3"])
def store(request, tmp_path) -> RunStore:
    if request.param == "local":
        yield RunStore(str(tmp_path / "run"))
    elif request.param == "memory":
        uri = _memory_uri()
        yield RunStore(uri)
        MemoryFileSystem().rm(uri.split("://", 1)[1].split("/", 1)[0], recursive=True)
    else:
        yield RunStore(f"{request.getfixturevalue('s3_root')}/{uuid.uuid4().hex[:8]}/run")


def test_local_or_remote_is_decided_when_the_store_is_made(tmp_path):
    plain, file_uri, memory = RunStore(str(tmp_path)), RunStore(f"file://{tmp_path}/"), RunStore(_memory_uri())
    assert plain.local and file_uri.local and not memory.local
    assert plain.local_path("logs") == file_uri.local_path("logs") == f"{tmp_path}/logs"
    assert memory.local_path("logs") is None
    assert file_uri.join("logs", "driver.log") == f"file://{tmp_path}/logs/driver.log"  # the URI as given
    assert join("s3://bucket/runs/", "r1", "", "metrics.jsonl") == "s3://bucket/runs/r1/metrics.jsonl"


def test_whole_files_round_trip(store):
    assert not store.exists("summary.json") and store.read_json("summary.json") is None
    with pytest.raises(FileNotFoundError):
        store.read_bytes("config.toml")
    store.write_json("summary.json", {"steps": 10, "loss": 2.5, "mesh": {"dp": 2}})
    store.write_text("config.toml", "[train]\nsteps = 10\n")
    store.write_bytes("report/report.png", b"\x89PNG\x00\xff")  # a name in a subdirectory: made on the way
    assert store.read_json("summary.json") == {"steps": 10, "loss": 2.5, "mesh": {"dp": 2}}
    assert store.read_bytes("summary.json") == json.dumps({"steps": 10, "loss": 2.5, "mesh": {"dp": 2}},
                                                          indent=1).encode()  # the one JSON format
    assert store.read_text("config.toml") == "[train]\nsteps = 10\n"
    assert store.read_bytes("report/report.png") == b"\x89PNG\x00\xff"
    assert store.exists("config.toml") and store.isdir() and store.isdir("report")
    assert store.list() == ["config.toml", "report", "summary.json"]
    assert store.list("absent") == []
    store.write_json("summary.json", {"steps": 11})  # replaced, not appended to
    assert store.read_json("summary.json") == {"steps": 11}
    store.remove("config.toml")
    assert not store.exists("config.toml")


@pytest.mark.parametrize("content", [b"", b'{"max_step": 7, "attem'], ids=["empty", "half"])
def test_torn_json_reads_as_absent_with_a_warning(store, content):
    store.write_bytes("progress.json", content)
    with pytest.warns(RuntimeWarning, match=r"/run/progress.json is (empty|not valid JSON).*\(accounting restarts\)"):
        assert store.read_json("progress.json", "accounting restarts") is None


def test_local_write_failing_midway_keeps_the_old_file_whole(tmp_path, monkeypatch):
    store = RunStore(str(tmp_path / "run"))
    store.write_json("summary.json", {"v": 1})

    class HalfWritten(io.FileIO):
        def write(self, data):  # the disk dies half-way through the new content
            super().write(bytes(data)[:len(data) // 2])
            raise OSError("disk died")

    monkeypatch.setattr(atomic, "open", lambda path, mode: HalfWritten(path, mode), raising=False)
    with pytest.raises(OSError, match="disk died"):
        store.write_json("summary.json", {"v": 2, "long": "x" * 10000})
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == {"v": 1}  # the old content, whole
    assert os.listdir(tmp_path / "run") == ["summary.json"]  # no temporary file left behind


def test_local_write_failing_before_the_rename_keeps_the_old_file(tmp_path, monkeypatch):
    store = RunStore(str(tmp_path / "run"))
    store.write_text("config.toml", "old\n")

    def crash(fd):  # every byte written, the process dies before the rename
        raise OSError("killed")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="killed"):
        store.write_text("config.toml", "new\n" * 1000)
    assert store.read_text("config.toml") == "old\n"
    assert store.list() == ["config.toml"]


def test_remote_write_is_one_put_and_a_failed_put_keeps_the_old_object(monkeypatch):
    store = RunStore(_memory_uri())
    store.write_json("progress.json", {"max_step": 1})
    puts = []
    real_put = MemoryFileSystem.pipe_file

    def counted(self, path, value, **kwargs):
        puts.append((path, bytes(value)))
        return real_put(self, path, value, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "pipe_file", counted)
    store.write_json("progress.json", {"max_step": 2})
    assert puts == [(store.path("progress.json"), b'{\n "max_step": 2\n}')]  # the whole body, one request

    def failing(self, path, value, **kwargs):  # the request fails (a dropped connection, a 503)
        raise OSError("PUT failed")

    monkeypatch.setattr(MemoryFileSystem, "pipe_file", failing)
    with pytest.raises(OSError, match="PUT failed"):
        store.write_json("progress.json", {"max_step": 3})
    assert store.read_json("progress.json") == {"max_step": 2}
    assert store.list() == ["progress.json"]  # nothing else left behind


def test_appends_from_several_writers_read_back_in_order(store):
    first, second = store.appender("events.jsonl"), store.appender("events.jsonl")
    first.append({"kind": "start", "step": 0})
    second.append({"kind": "worker_error", "rank": 1})
    first.append_line(json.dumps({"kind": "checkpoint", "step": 5}))
    records = store.read_records("events.jsonl")
    assert store.read_records("metrics.jsonl") is None  # no such file at all
    if store.local:  # one file, lines in the order they were written
        assert [r["kind"] for r in records] == ["start", "worker_error", "checkpoint"]
        assert not store.exists("events.jsonl.d")
    else:  # one part per writer, merged in the writers' creation order
        assert [r["kind"] for r in records] == ["start", "checkpoint", "worker_error"]
        assert len(store.list("events.jsonl.d")) == 2 and not store.exists("events.jsonl")


def test_a_torn_last_line_is_skipped_silently_and_never_swallows_the_next(tmp_path, recwarn):
    store = RunStore(str(tmp_path / "run"))
    store.write_text("metrics.jsonl", '{"step": 1}\n{"step": 2, "lo')  # a crash in the middle of an append
    assert store.read_records("metrics.jsonl") == [{"step": 1}]  # the torn last line: a write in flight
    assert not recwarn.list
    store.appender("metrics.jsonl").append({"step": 3})  # the next attempt appends on a line of its own
    assert store.read_text("metrics.jsonl").splitlines() == ['{"step": 1}', '{"step": 2, "lo', '{"step": 3}']
    problems = []
    assert store.read_records("metrics.jsonl", problems) == [{"step": 1}, {"step": 3}]
    assert problems == ["metrics.jsonl:2: not a JSON record (a torn line?), skipped"]
    with pytest.warns(RuntimeWarning, match="metrics.jsonl:2: not a JSON record"):
        store.read_records("metrics.jsonl")


def test_remote_records_merge_an_older_file_and_skip_a_torn_part_end():
    store = RunStore(_memory_uri())
    store.write_text("metrics.jsonl", '{"step": 0}\n[1, 2]\n')  # written by an older version; not a record
    store.appender("metrics.jsonl").append({"step": 1})
    store.write_text("metrics.jsonl.d/99999999999999999999-h-1-000000-ffffff.jsonl", '{"step": 2}\n{"st')
    store.write_text("metrics.jsonl.d/notes.txt", "not a part")
    problems = []
    assert store.read_records("metrics.jsonl", problems) == [{"step": 0}, {"step": 1}, {"step": 2}]
    assert problems == ["metrics.jsonl:2: not a JSON record (a torn line?), skipped"]


def test_tail_returns_each_complete_record_once(store):
    store.appender("metrics.jsonl").append({"step": 0})
    tail, late = store.tail("metrics.jsonl"), store.tail("metrics.jsonl", from_end=True)
    assert tail.new() == [{"step": 0}] and tail.new() == []
    writer = store.appender("metrics.jsonl")
    writer.append({"step": 1})
    writer.append({"step": 2})
    assert tail.new() == [{"step": 1}, {"step": 2}]
    assert late.new() == [{"step": 1}, {"step": 2}]  # only what came after it was made
    assert store.tail("absent.jsonl").new() == []


def test_local_tail_waits_for_a_line_to_end(tmp_path):
    store = RunStore(str(tmp_path))
    tail = store.tail("metrics.jsonl")
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 1}\n{"step": 2, "lo')  # the second still being written
    assert tail.new() == [{"step": 1}]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('ss": 1.0}\n{torn\n')
    assert tail.new() == [{"step": 2, "loss": 1.0}]


def test_exclusive_create_and_lock_locally_and_refused_remotely(tmp_path):
    store = RunStore(str(tmp_path / "run"))
    with store.lock():
        assert store.create_json_exclusive("lease.json", {"run_id": "a"})
        assert not store.create_json_exclusive("lease.json", {"run_id": "b"})
    assert store.read_json("lease.json") == {"run_id": "a"}
    assert store.list() == ["lease.json"]  # the temporary files are gone
    remote = RunStore(_memory_uri())
    with remote.lock():  # nothing to lock on an object store
        pass
    with pytest.raises(io.UnsupportedOperation, match="no exclusive create"):
        remote.create_json_exclusive("lease.json", {"run_id": "a"})


def test_put_files_copies_a_local_directory_up(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "driver.log").write_text("driver\n")
    (tmp_path / "logs" / "workers.log").write_text("workers\n")
    store = RunStore(_memory_uri())
    store.put_files(str(tmp_path / "logs"), "logs")
    assert store.list("logs") == ["driver.log", "workers.log"]
    assert store.read_text("logs/workers.log") == "workers\n"
    assert fsspec.filesystem("memory").cat_file(store.path("logs", "driver.log")) == b"driver\n"
