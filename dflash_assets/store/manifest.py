"""Multi-file outputs published as one: files under a fresh version prefix, then a manifest naming them.

A partition's cache parts or a drafter checkpoint is several objects. Writing
them over the old ones one at a time lets a kill leave a mix of old and new
files. Here each publication uploads its files under a new version prefix
(``<prefix>/<version>/<name>``), then writes the manifest (one small JSON
object, atomic) last, then removes the files of older versions. Readers take
the file list from the manifest only, so a kill at any point leaves readers the
old complete set or the new complete set; files no manifest names are ignored
and removed by the next publication.

Reads and writes the store (the ``Store`` protocol of ``store.backends``);
also removes scratch directories and temp files a killed process left on a
local disk (:func:`remove_stale_scratch`, by the process id in their names;
``store.backends`` uses it for its own temp files).
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

__all__ = ["MANIFEST_FORMAT", "new_version", "publish_files", "delete_older_versions", "read_manifest", "manifest_files", "pid_alive",
           "scratch_prefix", "remove_stale_scratch"]

MANIFEST_FORMAT = "dflash-manifest/v1"


def new_version() -> str:
    """A version name that sorts by start time (microseconds, UTC) and is unique: ``20261201T034501.123456-1a2b3c4d``.

    A run killed before its manifest started before any later run, so its files sort older and the
    later run's publication removes them.
    """
    ns = time.time_ns()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(ns // 10**9)) + f".{ns // 1000 % 10**6:06d}-{secrets.token_hex(4)}"


def publish_files(store: Any, manifest_key: str, version_prefix: str, files: Mapping[str, str | os.PathLike], *,
                  version: str | None = None, extra: Mapping[str, Any] | None = None,
                  stale: Iterable[str] = ()) -> dict[str, Any]:
    """Upload ``files`` (name -> local path) as ``<version_prefix>/<version>/<name>``, then write the manifest.

    After the manifest, objects under ``version_prefix`` that belong to older
    versions, and the ``stale`` keys (files of an older layout), are deleted.
    Objects of a newer version (a concurrent publication) are left alone.
    Returns the manifest: ``{"format", "version", "files": [{"name", "key", "bytes"}], **extra}``.
    """
    version = version or new_version()
    base = version_prefix.strip("/")
    entries = []
    for name, path in files.items():
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"file name {name!r} must be a plain name")
        key = f"{base}/{version}/{name}"
        store.upload_file(key, path)
        entries.append({"name": name, "key": key, "bytes": os.path.getsize(path)})
    manifest = {**(extra or {}), "format": MANIFEST_FORMAT, "version": version, "files": entries}
    store.write_json(manifest_key, manifest)  # the switch: readers see the new set from here on
    keep = {e["key"] for e in entries}
    delete_older_versions(store, base, version, keep)
    for key in stale:
        if key not in keep:
            store.delete(key)
    return manifest


def delete_older_versions(store: Any, prefix: str, version: str, keep: Iterable[str] = ()) -> None:
    """Delete the objects under ``<prefix>/<v>/`` for every version ``v`` older than ``version`` (names sort by
    start time), except ``keep``. Objects of a newer version (a concurrent publication) are left alone."""
    keep = set(keep)
    for key in store.list(prefix):
        rest = key[len(prefix) + 1:]
        if key not in keep and "/" in rest and rest.split("/", 1)[0] < version:
            store.delete(key)


@functools.cache
def _manifest_model() -> type:
    """A stored manifest as readers trust it: its format, version and files (more fields are the publisher's).
    Built on first use: pydantic stays off the GPU path's module-level imports."""
    from pydantic import BaseModel, ConfigDict, Field

    class ManifestFile(BaseModel):
        model_config = ConfigDict(extra="allow", strict=True)

        name: str = Field(min_length=1)
        key: str = Field(min_length=1)
        bytes: int = Field(ge=0)

    class Manifest(BaseModel):
        model_config = ConfigDict(extra="allow", strict=True)

        format: Literal[MANIFEST_FORMAT]
        version: str
        files: list[ManifestFile]

    return Manifest


def read_manifest(store: Any, manifest_key: str) -> dict[str, Any] | None:
    """The manifest at ``manifest_key``, or None when there is none; a malformed one raises ValueError naming the
    field, its value and what it should be."""
    try:
        doc = store.read_json(manifest_key)
    except FileNotFoundError:
        return None
    from pydantic import ValidationError

    try:
        _manifest_model().model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "the document"
        raise ValueError(f"{manifest_key}: not a {MANIFEST_FORMAT} manifest: {where}: {err['msg'].lower()}, "
                         f"got {err.get('input')!r}") from None
    return doc


def manifest_files(manifest: Mapping[str, Any]) -> dict[str, str]:
    """File name -> store key, in the manifest's order."""
    return {e["name"]: e["key"] for e in manifest["files"]}


# --- scratch space a killed process left behind --------------------------------------

def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this host (a reused id counts as alive: nothing is removed)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def scratch_prefix(tag: str, *, hidden: bool = False) -> str:
    """``dflash-<tag>-<pid>-`` (``.dflash-...`` when ``hidden``): the name prefix of a scratch directory or temp
    file, for ``tempfile.mkdtemp/mkstemp(prefix=...)``; :func:`remove_stale_scratch` removes it once the process
    is gone. Hidden names are for temp files inside a store directory, whose listings skip dot-names."""
    return f"{'.' if hidden else ''}dflash-{tag}-{os.getpid()}-"


def remove_stale_scratch(directory: str | os.PathLike, tag: str, *, hidden: bool = False) -> list[Path]:
    """Remove ``dflash-<tag>-<pid>-*`` entries (``.dflash-...`` when ``hidden``) in ``directory`` whose process
    is gone; returns what was removed."""
    d = Path(directory)
    pattern = re.compile(("\\." if hidden else "") + rf"dflash-{re.escape(tag)}-(\d+)-.*")
    removed = []
    if not d.is_dir():
        return removed
    for p in d.iterdir():
        m = pattern.fullmatch(p.name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed
