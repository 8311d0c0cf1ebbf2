"""The store: atomic writes, listing, Parquet/JSON helpers, local and S3 (moto server)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pyarrow as pa
import pytest

from dflash_assets.store.backends import LocalStore, open_store


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStore(tmp_path / "root")
    return request.getfixturevalue("s3_store")


def test_roundtrip_and_listing(store):
    store.write_bytes("a/b/one.bin", b"1")
    store.write_bytes("a/two.bin", b"22")
    store.write_json("meta/x.json", {"k": [1, 2]})
    table = pa.table({"x": pa.array([1, 2, 3], pa.int32()), "s": ["a", "b", "c"]})
    digest = store.write_parquet("t/p.parquet", table)

    assert digest == hashlib.sha256(store.read_bytes("t/p.parquet")).hexdigest()  # the writer's data version
    assert store.read_bytes("a/b/one.bin") == b"1"
    assert store.list("a") == ["a/b/one.bin", "a/two.bin"]
    assert store.read_json("meta/x.json") == {"k": [1, 2]}
    assert store.read_parquet("t/p.parquet").equals(table)
    assert store.exists("a/two.bin") and not store.exists("a/three.bin")
    assert store.size("a/two.bin") == 2
    store.delete("a/two.bin")
    assert not store.exists("a/two.bin")
    with pytest.raises(FileNotFoundError, match="no object"):
        store.read_bytes("a/two.bin")


def test_staged_file_publishes_only_on_success(store):
    with store.staged_file("big/obj.bin") as path:
        path.write_bytes(b"x" * 1000)
    assert store.read_bytes("big/obj.bin") == b"x" * 1000

    with pytest.raises(RuntimeError):
        with store.staged_file("big/obj.bin") as path:
            path.write_bytes(b"partial")
            raise RuntimeError("writer died")
    assert store.read_bytes("big/obj.bin") == b"x" * 1000
    # local_path gives a real file for memory-mapping, on either backend
    assert store.local_path("big/obj.bin").read_bytes() == b"x" * 1000


def test_create_writes_only_once(store):
    """create() is the commit primitive: of many writers of one key exactly one wins; the object is never replaced."""
    from concurrent.futures import ThreadPoolExecutor

    assert store.create("commits/gen-1.json", b"first") is True
    assert store.create("commits/gen-1.json", b"second") is False
    assert store.read_bytes("commits/gen-1.json") == b"first"
    with ThreadPoolExecutor(8) as pool:
        wins = list(pool.map(lambda k: store.create("commits/gen-2.json", b"writer %d" % k), range(8)))
    assert wins.count(True) == 1
    assert store.read_bytes("commits/gen-2.json") == b"writer %d" % wins.index(True)
    assert store.list("commits") == ["commits/gen-1.json", "commits/gen-2.json"]  # no temp file left behind


def test_bad_keys_are_refused(tmp_path):
    store = LocalStore(tmp_path)
    for key in ["", "../escape", "a/../../b", "a//b"]:
        with pytest.raises(ValueError, match="invalid store key"):
            store.write_bytes(key, b"")


@pytest.mark.parametrize("bad", ["..", "../", "a/..", "a/../..", "/", "/etc", "/tmp/x", "a/./b", "a\\..\\b", "a\x00b"])
def test_keys_and_prefixes_cannot_leave_the_root(store, bad):
    """Every method refuses a key or listing prefix that could name something outside the root."""
    store.write_bytes("inside/obj.bin", b"1")
    calls = [
        lambda: store.list(bad), lambda: store.write_bytes(bad, b"x"), lambda: store.read_bytes(bad),
        lambda: store.exists(bad), lambda: store.size(bad), lambda: store.delete(bad),
        lambda: store.local_path(bad), lambda: store.url(bad),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="invalid store key"):
            call()
    assert store.list("") == ["inside/obj.bin"]


def test_local_list_of_parent_does_not_list_outside(tmp_path):
    """LocalStore.list("..") is refused, not a listing of every file beside the root; a symlink out of the root is
    no object."""
    (tmp_path / "outside.txt").write_text("secret")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "secret.txt").write_text("secret")
    store = LocalStore(tmp_path / "root")
    store.write_bytes("k/obj.bin", b"1")
    with pytest.raises(ValueError, match="invalid store key '..'"):
        store.list("..")
    os.symlink(tmp_path / "outside.txt", store.root / "k" / "link.txt")
    os.symlink(tmp_path / "elsewhere", store.root / "k" / "dir")
    assert store.list("") == ["k/obj.bin"] and store.list("k") == ["k/obj.bin"]
    for key in ("k/link.txt", "k/dir/secret.txt"):
        with pytest.raises(ValueError, match="outside the store root"):
            store.read_bytes(key)
        with pytest.raises(ValueError, match="outside the store root"):
            store.write_bytes(key, b"overwrite")
    with pytest.raises(ValueError, match="outside the store root"):
        store.list("k/dir")
    assert (tmp_path / "outside.txt").read_text() == "secret"
    assert (tmp_path / "elsewhere" / "secret.txt").read_text() == "secret"


def test_killed_local_write_leaves_old_object(tmp_path):
    """kill -9 in the middle of a large write: readers see the old object, complete."""
    store = LocalStore(tmp_path)
    store.write_bytes("obj.bin", b"old")
    code = textwrap.dedent(
        f"""
        import sys
        from dflash_assets.store.backends import LocalStore
        store = LocalStore({str(tmp_path)!r})
        print("start", flush=True)
        while True:
            store.write_bytes("obj.bin", b"n" * (128 << 20))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"start"
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    data = store.read_bytes("obj.bin")
    assert data == b"old" or data == b"n" * (128 << 20)
    assert store.list("") == ["obj.bin"]  # temp files are hidden and never listed


def _dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("method", ["write_bytes", "create"])
def test_temp_file_of_a_killed_write_is_removed_at_the_next_start(tmp_path, method):
    """A writer SIGKILLed mid-write leaves its temp file; the next store's write removes it
    (its pid is dead) and leaves a live writer's temp file (this test's own pid) alone."""
    root = tmp_path / "root"
    LocalStore(root).write_bytes("d/obj.bin", b"old")
    code = textwrap.dedent(
        f"""
        import os, time
        from dflash_assets.store.backends import LocalStore
        store = LocalStore({str(root)!r})
        def stall(fd):  # the data is in the temp file; the process dies before the rename
            print("writing", flush=True)
            time.sleep(60)
        os.fsync = stall
        store.{method}("d/{'obj' if method == 'write_bytes' else 'new'}.bin", b"n" * (1 << 20))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"writing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    left = [p for p in os.listdir(root / "d") if p.startswith(".")]
    assert len(left) == 1 and f"-{proc.pid}-" in left[0], left  # the killed writer's temp file, named by its pid

    live = LocalStore(root)
    fd, mine = live._temp_beside(root / "d" / "other.bin")  # a write of this (live) process, in progress
    os.close(fd)
    LocalStore(root).write_bytes("d/obj.bin", b"new")  # the next start: its first write in d/ sweeps it
    assert sorted(os.listdir(root / "d")) == sorted(["obj.bin", os.path.basename(mine)])
    assert LocalStore(root).read_bytes("d/obj.bin") == b"new" and LocalStore(root).list("d") == ["d/obj.bin"]


def test_staged_file_and_s3_download_leftovers_of_dead_pids_are_removed(tmp_path, monkeypatch, s3_store):
    """The same rule for staged_file's scratch dirs and S3Store.local_path's part files."""
    from dflash_assets.store.backends import S3Store

    dead = _dead_pid()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    stale_stage = tmp_path / "tmp" / f"dflash-stage-{dead}-abc123"
    live_stage = tmp_path / "tmp" / f"dflash-stage-{os.getpid()}-def456"
    for d in (stale_stage, live_stage):
        d.mkdir()
        (d / "object").write_bytes(b"x")
    with LocalStore(tmp_path / "root").staged_file("k/obj.bin") as path:
        path.write_bytes(b"staged")
    assert not stale_stage.exists() and live_stage.exists()

    s3_store.cache_dir = tmp_path / "cache"
    s3_store.write_bytes("k/obj.bin", b"remote")
    cached = s3_store.local_path("k/obj.bin")
    assert os.listdir(cached.parent) == ["obj.bin"]  # no part file left after a download
    stale_part = cached.parent / f".dflash-part-{dead}-obj.bin.x1y2z3.part"
    live_part = cached.parent / f".dflash-part-{os.getpid()}-obj.bin.a1b2c3.part"
    stale_part.write_bytes(b"half")
    live_part.write_bytes(b"half")
    again = S3Store(s3_store.uri, s3_store.client, cache_dir=tmp_path / "cache")
    assert again.local_path("k/obj.bin").read_bytes() == b"remote"
    assert not stale_part.exists() and live_part.exists()


def test_open_store_picks_backend(tmp_path, moto_endpoint):
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert open_store(f"file://{tmp_path}").root == tmp_path.resolve()
    s3 = open_store("s3://bucket/pre/fix", endpoint_url=moto_endpoint)
    assert (s3.bucket, s3.prefix) == ("bucket", "pre/fix")
    with pytest.raises(ValueError, match="no bucket"):
        open_store("s3:///x")
