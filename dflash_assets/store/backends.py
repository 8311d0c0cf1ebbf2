"""One store for all asset data, addressed by a root URI.

Every stage reads and writes its data only through a :class:`Store`, so no
stage depends on another host's filesystem (a prompt file at one path on the
data-prep host and at another on the GPU host is the failure this prevents).

Two backends behind one interface:

- ``LocalStore``: a directory (``/path/to/root`` or ``file:///path``).
  Writes go to a temporary file in the same directory, are fsynced, then
  renamed over the target: a killed write leaves the old object or the new
  one, never a partial file. Temp files are named
  ``.dflash-tmp@<host>-<pid>-<name>.<random>.tmp``; the first write into a
  directory by a store object removes those of this host whose process is
  gone (a SIGKILLed writer's), so leftovers live until the next start.
- ``S3Store``: ``s3://bucket/prefix`` through a boto3 client (in Dagster,
  dagster-aws's ``S3Resource`` builds it). A PUT, single or multipart, only
  becomes visible once complete, so S3 writes are atomic by nature.

Keys are relative POSIX paths such as ``raw_prompts/shard-00000.parquet``;
a key or listing prefix that is absolute or has a ``..`` segment is refused
with ``ValueError`` (and a local key that resolves outside the root through a
symlink), so no caller reaches outside the store root.
Reads: ``read_bytes``, ``read_parquet``, ``read_json``, ``local_path`` (for
memory-mapping; S3 objects are downloaded to a cache once).

``create(key, data)`` writes only if no object ``key`` exists, atomically
(locally a hard link of a complete temp file, which fails if the name exists;
on S3 a PUT with ``If-None-Match: *``): of two writers exactly one gets True.
Commit points that must never be overwritten use it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_assets import settings
from dflash_assets.atomic_write import atomic_path, fsync_dir
from dflash_assets.store.manifest import remove_stale_scratch, scratch_prefix

__all__ = ["Store", "LocalStore", "S3Store", "open_store", "default_store_uri", "s3_client"]


def default_store_uri() -> str:
    """``$DFLASH_STORE``, else ``$DAGSTER_HOME/dflash-store``, else ``./.dflash/store`` (:mod:`dflash_assets.settings`)."""
    return settings.store_uri()


class Store(Protocol):
    uri: str

    def write_bytes(self, key: str, data: bytes) -> None: ...
    def create(self, key: str, data: bytes) -> bool: ...
    def read_bytes(self, key: str) -> bytes: ...
    def exists(self, key: str) -> bool: ...
    def size(self, key: str) -> int: ...
    def list(self, prefix: str) -> list[str]: ...
    def delete(self, key: str) -> None: ...
    def upload_file(self, key: str, path: str | os.PathLike) -> None: ...
    def local_path(self, key: str) -> Path: ...
    def url(self, key: str) -> str: ...


# Temp files in a store directory carry this host's tag as well as the pid: on a directory mounted by several
# hosts, a pid is only checked (and a dead one's file removed) on the host that wrote it.
_TMP_TAG = "tmp@" + hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


class _StoreHelpers:
    """Format helpers shared by both backends (Parquet, JSON, staged files)."""

    uri: str

    def _sweep(self, directory: Path, tag: str, *, hidden: bool = False) -> None:
        """Remove what killed processes left in ``directory`` (:func:`remove_stale_scratch`), once per store object."""
        swept = self.__dict__.setdefault("_swept", set())
        if (directory, tag) not in swept:
            remove_stale_scratch(directory, tag, hidden=hidden)
            swept.add((directory, tag))

    def write_parquet(self, key: str, table: pa.Table, **kwargs: Any) -> str:
        """Publish ``table`` as Parquet at ``key``; returns the sha256 (hex) of the bytes written: its data version."""
        buf = io.BytesIO()
        pq.write_table(table, buf, compression=kwargs.pop("compression", "zstd"), **kwargs)
        data = buf.getvalue()
        self.write_bytes(key, data)  # type: ignore[attr-defined]
        return hashlib.sha256(data).hexdigest()

    def read_parquet(self, key: str, columns: list[str] | None = None) -> pa.Table:
        return pq.read_table(pa.BufferReader(self.read_bytes(key)), columns=columns)  # type: ignore[attr-defined]

    def write_json(self, key: str, obj: Any) -> None:
        self.write_bytes(key, json.dumps(obj, indent=2, sort_keys=True, default=str).encode())  # type: ignore[attr-defined]

    def read_json(self, key: str) -> Any:
        return json.loads(self.read_bytes(key))  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def staged_file(self, key: str, suffix: str = "") -> Iterator[Path]:
        """Yield a local scratch path; on clean exit its content becomes ``key`` atomically.

        For writers that need a real file (safetensors, large Parquet). On an
        exception nothing is published and the scratch file is removed; a
        killed writer's ``dflash-stage-<pid>-*`` dir goes at the next call.
        """
        self._sweep(Path(tempfile.gettempdir()), "stage")
        tmpdir = Path(tempfile.mkdtemp(prefix=scratch_prefix("stage")))
        path = tmpdir / ("object" + suffix)
        try:
            yield path
            self.upload_file(key, path)  # type: ignore[attr-defined]
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)


def _clean_key(key: str) -> str:
    """``key`` without a trailing ``/``; ValueError for keys that could name something outside the store root.

    Refused: empty keys, absolute keys (a leading ``/``), ``.``/``..``/empty
    path segments, backslashes and NUL bytes.
    """
    if not isinstance(key, str):
        raise TypeError(f"store key must be a str, not {type(key).__name__}")
    if key.startswith("/"):
        raise ValueError(f"invalid store key {key!r}: absolute (keys are relative to the store root)")
    if "\\" in key or "\x00" in key:
        raise ValueError(f"invalid store key {key!r}: backslash or NUL byte")
    key = key.rstrip("/")
    if not key or any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"invalid store key {key!r}: empty, '.' or '..' path segment")
    return key


def _clean_prefix(prefix: str) -> str:
    """A listing prefix: ``""`` (the whole store) or a key checked as :func:`_clean_key` checks it."""
    return "" if prefix == "" else _clean_key(prefix)


class LocalStore(_StoreHelpers):
    def __init__(self, root: str | os.PathLike):
        root = str(root)
        if root.startswith("file://"):
            root = root[len("file://") :]
        self.root = Path(root).expanduser().resolve()
        self.uri = str(self.root)

    def _path(self, key: str) -> Path:
        path = self.root / _clean_key(key)
        self._check_inside(path, key)
        return path

    def _check_inside(self, path: Path, key: str) -> None:
        """ValueError when ``path`` resolves outside the root (a symlink inside the store pointing out)."""
        if not path.resolve().is_relative_to(self.root):
            raise ValueError(f"invalid store key {key!r}: resolves outside the store root {self.uri}")

    def _sweep_beside(self, dest: Path) -> None:
        """Make ``dest``'s directory and remove the temp files killed writers of this host left there."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        self._sweep(dest.parent, _TMP_TAG, hidden=True)

    @staticmethod
    def _temp_prefix(dest: Path) -> str:
        return f"{scratch_prefix(_TMP_TAG, hidden=True)}{dest.name}."

    def _temp_beside(self, dest: Path) -> tuple[int, str]:
        """A new temp file in ``dest``'s directory, after removing the ones killed writers of this host left there."""
        self._sweep_beside(dest)
        return tempfile.mkstemp(dir=dest.parent, prefix=self._temp_prefix(dest), suffix=".tmp")

    def _publish(self, key: str, fill: Callable[[BinaryIO], object]) -> None:
        """Write through ``fill`` into a temp file beside the target, fsync, then rename over it."""
        dest = self._path(key)
        self._sweep_beside(dest)
        with atomic_path(dest, prefix=self._temp_prefix(dest), suffix=".tmp") as tmp, open(tmp, "wb") as f:
            fill(f)

    def write_bytes(self, key: str, data: bytes) -> None:
        self._publish(key, lambda f: f.write(data))

    def create(self, key: str, data: bytes) -> bool:
        """Publish ``data`` at ``key`` only if nothing is there; False (nothing written) if an object exists."""
        dest = self._path(key)
        fd, tmp = self._temp_beside(dest)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, dest)  # fails if dest exists; readers never see a partial object
            except FileExistsError:
                return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        fsync_dir(dest.parent)
        return True

    def upload_file(self, key: str, path: str | os.PathLike) -> None:
        def copy(f: BinaryIO) -> None:
            with open(path, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 20)

        self._publish(key, copy)

    def read_bytes(self, key: str) -> bytes:
        path = self._path(key)
        if not path.exists():
            raise FileNotFoundError(f"no object {key!r} in store {self.uri}")
        return path.read_bytes()

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        return self.local_path(key).stat().st_size

    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (``""``: all), sorted; hidden temp files and symlinks are not objects."""
        clean = _clean_prefix(prefix)
        base = self.root / clean if clean else self.root
        if clean:
            self._check_inside(base, prefix)
        if not base.exists():
            return []
        out = []
        for p in base.rglob("*"):
            if not p.name.startswith(".") and not p.is_symlink() and p.is_file():
                out.append(p.relative_to(self.root).as_posix())
        return sorted(out)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def local_path(self, key: str) -> Path:
        path = self._path(key)
        if not path.exists():
            raise FileNotFoundError(f"no object {key!r} in store {self.uri}")
        return path

    def url(self, key: str) -> str:
        return self._path(key).as_uri()


def s3_client(endpoint_url: str | None = None) -> Any:
    """The one way this project builds a boto3 S3 client: `endpoint_url`, else `$AWS_ENDPOINT_URL`, else AWS.

    Credentials and region come from boto3's own chain (environment, ~/.aws, instance profile).
    """
    import boto3

    return boto3.client("s3", endpoint_url=endpoint_url or settings.s3_endpoint_url())


class S3Store(_StoreHelpers):
    """``s3://bucket/prefix`` through a boto3 S3 client (credentials from the environment)."""

    def __init__(self, uri: str, client: Any = None, *, endpoint_url: str | None = None,
                 cache_dir: str | os.PathLike | None = None):
        if not uri.startswith("s3://"):
            raise ValueError(f"not an s3:// URI: {uri!r}")
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        if not bucket:
            raise ValueError(f"s3 URI has no bucket: {uri!r}")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.client = client if client is not None else s3_client(endpoint_url)
        self.cache_dir = Path(cache_dir or Path(tempfile.gettempdir()) / "dflash-s3-cache")

    def _key(self, key: str) -> str:
        key = _clean_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def write_bytes(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def create(self, key: str, data: bytes) -> bool:
        """PUT with ``If-None-Match: *``: False (nothing written) if the object exists."""
        import time

        from botocore.exceptions import ClientError

        for attempt in range(5):
            try:
                self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
                return True
            except ClientError as e:
                code = e.response.get("Error", {}).get("Code")
                if code in ("PreconditionFailed", "412"):
                    return False
                if code == "ConditionalRequestConflict" and attempt < 4:  # a racing conditional PUT: ask again
                    time.sleep(0.05 * 2**attempt)
                    continue
                raise
        raise AssertionError("unreachable")

    def upload_file(self, key: str, path: str | os.PathLike) -> None:
        # Multipart uploads only become visible on CompleteMultipartUpload: atomic.
        self.client.upload_file(str(path), self.bucket, self._key(key))

    def read_bytes(self, key: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except self.client.exceptions.NoSuchKey as e:
            raise FileNotFoundError(f"no object {key!r} in store {self.uri}") from e

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def size(self, key: str) -> int:
        return int(self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"])

    def list(self, prefix: str) -> list[str]:
        full = self._key(prefix) if _clean_prefix(prefix) else self.prefix
        full = full.rstrip("/") + "/" if full else ""
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
            for obj in page.get("Contents", []):
                k = obj["Key"]
                out.append(k[len(self.prefix) + 1 :] if self.prefix else k)
        return sorted(out)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def local_path(self, key: str) -> Path:
        """Download once into a content-addressed cache, for memory-mapping.

        The download goes to ``.dflash-part-<pid>-<name>.*.part`` beside the target, then is renamed onto it; a
        killed download's part file is removed the next time a store object reads into that directory.
        """
        head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        tag = hashlib.sha256(f"{self.uri}/{key}:{head['ETag']}".encode()).hexdigest()[:24]
        dest = self.cache_dir / tag / Path(key).name
        if dest.parent.is_dir():
            self._sweep(dest.parent, "part", hidden=True)
        if not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(dest, prefix=f"{scratch_prefix('part', hidden=True)}{dest.name}.", suffix=".part") as tmp:
                self.client.download_file(self.bucket, self._key(key), str(tmp))
        return dest

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"


def open_store(uri: str | None = None, *, s3_client: Any = None, endpoint_url: str | None = None) -> LocalStore | S3Store:
    """Open the store at ``uri`` (default: :func:`default_store_uri`)."""
    uri = uri or default_store_uri()
    if uri.startswith("s3://"):
        return S3Store(uri, s3_client, endpoint_url=endpoint_url)
    return LocalStore(uri)
