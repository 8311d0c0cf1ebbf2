"""One way to write a file atomically: a temporary file beside the target, fsynced, renamed over it, the directory
fsynced.

A reader sees the old file or the whole new one, never a part; a killed writer leaves only a temporary named
`.<name>.tmp-<pid>-<random>` (what `drafter.model.clean_stale_temps` recognizes) or the prefix its caller chose,
and a failed write removes its temporary. One fsync policy for every writer: the data reaches the disk before the
rename publishes it, and the directory entry after (where the platform allows a directory fsync).

Reads nothing; writes the file named (and its temporary beside it).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so a rename inside it is durable (a no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike, *, prefix: str | None = None, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside `dest` for the caller (or a library: `save_file(..., tmp)`) to write; on a
    normal exit fsync it, rename it over `dest` and fsync the directory; on an exception remove it.
    `prefix`/`suffix` name the temporary (default `.<name>.tmp-<pid>-`), for directories that sweep their own."""
    dest = Path(dest)
    fd, name = tempfile.mkstemp(dir=dest.parent, prefix=prefix or f".{dest.name}.tmp-{os.getpid()}-", suffix=suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(dest.parent)


def write_atomic(dest: str | os.PathLike, data: bytes | str) -> Path:
    """Write `data` (str as UTF-8) to `dest` atomically; returns `dest` as a Path."""
    dest = Path(dest)
    with atomic_path(dest) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    return dest
