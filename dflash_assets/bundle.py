"""Ship a model or a directory to a host with no network as checksummed parts: ``dflash bundle`` and ``unbundle``.

A GPU host without internet access still needs the target's weights, a drafter checkpoint or a study's store, and
the way there (a transfer tool with a file-size cap, removable media, a jump host) often carries only files of a
bounded size. ``bundle_path`` writes a file or a directory as an uncompressed tar stream cut into parts of at most
``part_bytes``, then ``manifest.json``: every part's name, size and SHA-256, and every file's relative path, size
and SHA-256. ``unbundle`` checks each part before it reads any, names the part that is missing or damaged,
extracts into a temporary directory beside the destination (no link, device or path outside it is accepted),
checks every file against the manifest, and only then renames the result into place.

Writes are atomic: each part and the manifest go to a temporary name and are renamed, the manifest last, so a
bundle killed while it is written has no manifest and is refused as incomplete. Standard library only; reads the
source, writes the bundle directory (``bundle_path``) or the destination (``unbundle``).
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import tarfile
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Literal

from dflash_assets.atomic_write import write_atomic

__all__ = ["MANIFEST", "BundleError", "bundle_path", "unbundle", "parse_size"]

MANIFEST = "manifest.json"
FORMAT = "dflash-bundle/1"
CHUNK = 1 << 20


class BundleError(ValueError):
    """A bundle that cannot be trusted: incomplete, a part missing or damaged, a file that does not match."""


def parse_size(text: str) -> int:
    """Bytes in `text`: ``1048576``, ``512K``, ``40M``, ``1.5G`` (binary units; ``MiB``/``MB`` read alike)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in units else ""
    try:
        value = float(t[: len(t) - len(unit)])
    except ValueError:
        raise ValueError(f"{text!r} is not a size (e.g. 40M, 1G, 1048576)") from None
    if value <= 0:
        raise ValueError(f"{text!r}: a size must be positive")
    return int(value * units[unit])


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


class _PartWriter(io.RawIOBase):
    """A write-only stream cut into files ``<stem>.part-NNNN`` of at most `part_bytes`, each hashed as written,
    written under a temporary name and renamed when full."""

    def __init__(self, out: Path, stem: str, part_bytes: int):
        self.out, self.stem, self.part_bytes = out, stem, part_bytes
        self.parts: list[dict[str, Any]] = []
        self._file: BinaryIO | None = None

    def writable(self) -> bool:
        return True

    def _open(self) -> None:
        name = f"{self.stem}.part-{len(self.parts):04d}"
        self._tmp = self.out / f".{name}.tmp-{os.getpid()}"
        self._file = open(self._tmp, "wb")
        self._hash, self._size = hashlib.sha256(), 0
        self.parts.append({"name": name})

    def _close_part(self) -> None:
        assert self._file is not None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.out / self.parts[-1]["name"])
        self.parts[-1].update(bytes=self._size, sha256=self._hash.hexdigest())
        self._file = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            if self._file is None:
                self._open()
            room = self.part_bytes - self._size
            piece = view[done: done + room]
            self._file.write(piece)
            self._hash.update(piece)
            self._size += len(piece)
            done += len(piece)
            if self._size == self.part_bytes:
                self._close_part()
        return done

    def finish(self) -> list[dict[str, Any]]:
        if self._file is not None:
            self._close_part()
        return self.parts


def _files_of(src: Path) -> Iterator[tuple[Path, str]]:
    """(path, name in the bundle) of every regular file under `src` (or `src` itself), sorted; links are refused."""
    if src.is_symlink() and src.is_file():
        src = src.resolve()
    if src.is_file():
        yield src, src.name
        return
    for path in sorted(src.rglob("*")):
        if path.is_symlink():
            raise BundleError(f"{path}: a symbolic link; bundle the file it points to instead")
        if path.is_file():
            yield path, str(Path(src.name) / path.relative_to(src))


def bundle_path(src: str | os.PathLike, out: str | os.PathLike, part_bytes: int = 1 << 30,
                log=None) -> dict[str, Any]:
    """`src` (a file or a directory) written into the directory `out` as tar parts of at most `part_bytes` and
    ``manifest.json``; returns the manifest. `out` must be empty or absent."""
    src, out = Path(src).absolute(), Path(out)  # absolute: "." bundles as the directory's own name
    if not src.exists():
        raise FileNotFoundError(f"{src}: nothing to bundle")
    if part_bytes < 1024:
        raise ValueError(f"part size {part_bytes} bytes: at least 1 KiB")
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise BundleError(f"{out} is not empty: a bundle is written into an empty directory")
    files = []
    writer = _PartWriter(out, src.name or "bundle", part_bytes)
    with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for path, name in _files_of(src):
            info = tar.gettarinfo(str(path), arcname=name)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            h = hashlib.sha256()
            with open(path, "rb") as f:
                tar.addfile(info, _HashingReader(f, h))
            files.append({"path": name, "bytes": info.size, "sha256": h.hexdigest()})
            if log:
                log(f"bundled {name} ({info.size:,} bytes)")
    if not files:
        raise BundleError(f"{src}: no file to bundle")
    parts = writer.finish()
    manifest = {"format": FORMAT, "source": src.name, "part_bytes": part_bytes, "parts": parts, "files": files,
                "bytes": sum(p["bytes"] for p in parts)}
    write_atomic(out / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest


class _HashingReader:
    """A file read through, its bytes hashed on the way (tarfile reads the member's data from it)."""

    def __init__(self, f: BinaryIO, h):
        self.f, self.h = f, h

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.h.update(data)
        return data


class _JoinedParts(io.RawIOBase):
    """The parts of a bundle read as one stream, in order."""

    def __init__(self, paths: list[Path]):
        self.paths, self.i, self.f = paths, 0, None

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while self.i < len(self.paths):
            if self.f is None:
                self.f = open(self.paths[self.i], "rb")
            n = self.f.readinto(buf)
            if n:
                return n
            self.f.close()
            self.f, self.i = None, self.i + 1
        return 0

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
        super().close()


_PLAIN_NAME = r"^(?:[^./\\][^/\\]*|\.[^./\\][^/\\]*|\.\.[^/\\]+)$"  # a plain file name: no path, not . or ..


@functools.cache
def _manifest_model() -> type:
    """``manifest.json`` of a bundle as `unbundle` trusts it: the format, the source's plain name (the directory it
    extracts to), each part's name, size and SHA-256, each file's. Built on first use: the bundle module imports
    only the standard library (it runs on hosts that hold little else)."""
    from pydantic import BaseModel, ConfigDict, Field

    class _Part(BaseModel):
        model_config = ConfigDict(strict=True)

        name: str = Field(pattern=_PLAIN_NAME)
        bytes: int = Field(ge=0)
        sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    class _File(BaseModel):
        model_config = ConfigDict(strict=True)

        path: str = Field(min_length=1)
        bytes: int = Field(ge=0)
        sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    class BundleManifest(BaseModel):
        model_config = ConfigDict(extra="allow", strict=True)

        format: Literal[FORMAT]
        source: str = Field(pattern=_PLAIN_NAME)
        part_bytes: int = Field(gt=0)
        parts: list[_Part] = Field(min_length=1)
        files: list[_File] = Field(min_length=1)

    return BundleManifest


def read_manifest(bundle: Path) -> dict[str, Any]:
    path = bundle / MANIFEST
    if not path.exists():
        raise BundleError(f"{bundle}: no {MANIFEST}, so the bundle is incomplete (its writer was stopped, or the "
                          f"manifest was not copied)")
    manifest = json.loads(path.read_text())
    from pydantic import ValidationError

    try:
        _manifest_model().model_validate(manifest)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "the document"
        raise BundleError(f"{path}: {where}: {err['msg'].lower()}, got {err.get('input')!r}") from None
    return manifest


def unbundle(bundle: str | os.PathLike, dest: str | os.PathLike, log=None) -> Path:
    """The bundle in the directory `bundle` checked and extracted; its content (the bundled file or directory)
    ends up as ``dest/<source name>``, which must not exist yet. Returns that path."""
    bundle, dest = Path(bundle), Path(dest)
    manifest = read_manifest(bundle)
    problems = []
    for part in manifest["parts"]:
        path = bundle / part["name"]
        if not path.exists():
            problems.append(f"{part['name']} is missing")
        elif path.stat().st_size != part["bytes"]:
            problems.append(f"{part['name']} has {path.stat().st_size:,} bytes, the manifest says {part['bytes']:,}")
        elif _sha256_file(path) != part["sha256"]:
            problems.append(f"{part['name']} is damaged: its SHA-256 is not the manifest's")
    if problems:
        raise BundleError(f"{bundle}: {'; '.join(problems)}. Copy those parts again; nothing was extracted")
    final = dest / manifest["source"]
    if final.exists():
        raise FileExistsError(f"{final} exists: unbundle into another directory or remove it first")
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".unbundle-", dir=dest) as tmp:
        with _JoinedParts([bundle / p["name"] for p in manifest["parts"]]) as stream, \
                tarfile.open(fileobj=io.BufferedReader(stream, CHUNK), mode="r|") as tar:
            tar.extractall(tmp, filter="data")  # no links out, no devices, no absolute or parent paths
        for f in manifest["files"]:
            path = Path(tmp) / f["path"]
            if not path.is_file() or _sha256_file(path) != f["sha256"]:
                raise BundleError(f"{f['path']}: not as the manifest says after extraction")
            if log:
                log(f"checked {f['path']} ({f['bytes']:,} bytes)")
        os.replace(Path(tmp) / manifest["source"], final)
    return final
