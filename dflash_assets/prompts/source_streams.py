"""The byte streams under the prompt-source readers: a local path, ``file://`` or ``s3://`` URI, bytes or an open
binary stream opened as one raw stream (``open_raw``), with what was peeked put back, and gzip or zstd decompressed
as a stream whose cut or corrupt end is reported, not raised, once something was decoded (``Decompressor``).

Reads the source it is given (S3 through a client); writes nothing.
"""

from __future__ import annotations

import io
import os
import zlib
from pathlib import Path
from typing import Any

from dflash_assets.store.backends import s3_client as new_s3_client

_COMPRESSED_READ = 16 * 1024  # compressed bytes handed to a decoder at a time (bounds how far past a fault it reads)


class SourceFormatError(ValueError):
    """The source as a whole cannot be read (unknown format, unreadable URI)."""


class _Prefixed(io.RawIOBase):
    """``head`` bytes, then the rest of ``f``: puts back what format sniffing read."""

    def __init__(self, head: bytes, f: Any):
        self._head = memoryview(head)
        self._f = f

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if len(self._head):
            n = min(len(b), len(self._head))
            b[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        data = self._f.read(len(b))
        n = len(data)
        b[:n] = data
        return n


class _DecodeError(Exception):
    """A decoder refused its input; ``partial`` is what it decoded from that input before it did."""

    def __init__(self, message: str, partial: bytes = b""):
        super().__init__(message)
        self.partial = partial


class Decompressor(io.RawIOBase):
    """A compressed stream, decoded; a cut or a fault ends it with ``damage`` set instead of raising.

    ``damage`` is ``"cut"`` (the input ends inside a frame or member) or ``"corrupt"`` (the decoder refused a
    byte, a checksum or a length); ``error`` says which, and ``stopped_at`` is how far into the compressed
    input the decoder had read: its whole length for a cut; for a fault, the byte after the one the decoder
    refused (gzip), or the end of the ``_COMPRESSED_READ``-byte piece it refused (zstd, which checks a block,
    or a frame's checksum, once it has all of it). What it decoded before the fault is handed out first.
    """

    codec = ""

    def __init__(self, f: Any):
        self._f = f
        self._out = memoryview(b"")
        self._done = False
        self.consumed = 0  # compressed bytes handed to the decoder
        self.damage: str | None = None
        self.stopped_at: int | None = None
        self.error: str | None = None

    def readable(self) -> bool:
        return True

    def _decode(self, data: bytes) -> bytes:
        """Decode the next piece of input; raises :class:`_DecodeError` on a fault."""
        raise NotImplementedError

    def _cut(self) -> str | None:
        """Why the input ending here is a cut (it stops inside a frame or member), or None."""
        raise NotImplementedError

    def _stop(self, damage: str, why: str) -> None:
        self._done = True
        self.damage, self.stopped_at = damage, self.consumed
        self.error = f"{self.codec} stream {damage} at compressed byte {self.consumed}: {why}"

    def readinto(self, b: Any) -> int:
        while not len(self._out):
            if self._done:
                return 0
            data = self._f.read(_COMPRESSED_READ)
            if not data:
                self._done = True
                why = self._cut()
                if why is not None:
                    self._stop("cut", why)
                return 0
            self.consumed += len(data)
            try:
                out = self._decode(data)
            except _DecodeError as e:
                self._stop("corrupt", str(e))
                out = e.partial
            self._out = memoryview(out)
        n = min(len(b), len(self._out))
        b[:n] = self._out[:n]
        self._out = self._out[n:]
        return n


class ZstdReader(Decompressor):
    """zstd frames, one after another (``ZstdDecompressor.stream_reader`` hands out a cut stream as if whole)."""

    codec = "zstd"

    def __init__(self, f: Any):
        import zstandard

        super().__init__(f)
        self._error_type = zstandard.ZstdError
        self._dctx = zstandard.ZstdDecompressor()
        self._obj = self._dctx.decompressobj()
        self._frame_start = 0  # compressed offset where the current frame starts
        self._in_frame = False  # the current frame has begun and not ended

    def _decode(self, data: bytes) -> bytes:
        out = []
        start = self.consumed - len(data)  # offset of data[0]
        try:
            while data:
                if not self._in_frame:
                    self._in_frame, self._frame_start = True, start
                out.append(self._obj.decompress(data))
                data = b""
                if self._obj.eof:  # frame done: the rest starts the next one
                    data = self._obj.unused_data
                    start = self.consumed - len(data)
                    self._obj = self._dctx.decompressobj()
                    self._in_frame = False
        except self._error_type as e:
            raise _DecodeError(f"{e} (in the frame that starts at compressed byte {self._frame_start})",
                               b"".join(out)) from None
        return b"".join(out)

    def _cut(self) -> str | None:
        if not self._in_frame:
            return None
        return (f"the input ends {self.consumed - self._frame_start} bytes into the frame that starts at "
                f"compressed byte {self._frame_start}")


class GzipReader(Decompressor):
    """gzip members, one after another, with zero padding between or after them skipped (as ``gzip`` does);
    each member's CRC-32 and length are checked. A fault is found to the byte: the piece of input it is in is
    decoded again, a byte at a time, from a copy of the decoder taken before it."""

    codec = "gzip"

    def __init__(self, f: Any):
        super().__init__(f)
        self._obj: Any = None  # the current member's decoder; None between members
        self._member_start = 0

    def _decode(self, data: bytes) -> bytes:
        base = self.consumed - len(data)  # offset of data[0]
        saved = (self._obj.copy() if self._obj is not None else None, self._member_start)
        try:
            return self._feed(data, base)
        except zlib.error:
            pass
        self._obj, self._member_start = saved
        out = []
        for i in range(len(data)):
            try:
                out.append(self._feed(data[i : i + 1], base + i))
            except zlib.error as e:
                self.consumed = base + i + 1  # the decoder read up to and including this byte
                why = str(e)
                if "incorrect data check" in why:
                    why += " (the member's CRC-32 does not match its data)"
                raise _DecodeError(f"{why} (in the member that starts at compressed byte {self._member_start})",
                                   b"".join(out)) from None
        raise AssertionError("gzip: a piece failed as a whole but not byte by byte")  # zlib is deterministic

    def _feed(self, data: bytes, start: int) -> bytes:
        """Decode ``data`` (which starts at compressed byte ``start``); raises ``zlib.error``."""
        out = []
        while data:
            if self._obj is None:
                rest = data.lstrip(b"\0")
                start += len(data) - len(rest)
                data = rest
                if not data:
                    break
                self._obj, self._member_start = zlib.decompressobj(16 + zlib.MAX_WBITS), start
            out.append(self._obj.decompress(data))
            if self._obj.eof:
                start += len(data) - len(self._obj.unused_data)
                data = self._obj.unused_data
                self._obj = None
            else:
                data = b""
        return b"".join(out)

    def _cut(self) -> str | None:
        if self._obj is None:
            return None
        return (f"the input ends {self.consumed - self._member_start} bytes into the member that starts at "
                f"compressed byte {self._member_start}")


def read_upto(f: Any, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        data = f.read(n - got)
        if not data:
            break
        parts.append(data)
        got += len(data)
    return b"".join(parts)


def _chain(head: bytes, f: Any) -> io.BufferedReader:
    return io.BufferedReader(_Prefixed(head, f), buffer_size=1 << 20)


def put_back(head: bytes, f: Any) -> Any:
    """``f`` positioned before ``head`` again: seek back where possible (no extra copy), else chain."""
    try:
        if f.seekable():
            f.seek(-len(head), io.SEEK_CUR)
            return f
    except (AttributeError, OSError, ValueError):
        pass
    return _chain(head, f)


def _parse_s3_uri(uri: str) -> tuple[str, str]:
    bucket, _, key = uri[len("s3://") :].partition("/")
    if not bucket or not key:
        raise SourceFormatError(f"s3 URI needs a bucket and a key: {uri!r}")
    return bucket, key


def open_raw(src: Any, s3_client: Any, store: Any) -> tuple[Any, Path | None]:
    """(binary stream, local path if the source is a plain local file)."""
    if isinstance(src, (bytes, bytearray, memoryview)):
        return io.BytesIO(bytes(src)), None
    if isinstance(src, os.PathLike) or isinstance(src, str):
        s = str(src)
        if s.startswith("s3://"):
            client = s3_client or getattr(store, "client", None) or new_s3_client()
            bucket, key = _parse_s3_uri(s)
            try:
                return client.get_object(Bucket=bucket, Key=key)["Body"], None
            except client.exceptions.NoSuchKey as e:
                raise FileNotFoundError(f"no source object {s}") from e
        if s.startswith("file://"):
            s = s[len("file://") :]
        path = Path(s).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"no source file {path}")
        return open(path, "rb"), path
    if hasattr(src, "read"):
        return src, None
    raise SourceFormatError(f"cannot read a source of type {type(src).__name__}")
