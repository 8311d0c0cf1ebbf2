"""Tests for dflash_assets.prompts.sources: formats, compression, truncation, bad bytes.

Every source here is a real file (or bytes) in JSON, JSONL or Parquet, written
plainly, gzip- or zstd-compressed; S3 sources are tested in test_ingest.py.
"""

from __future__ import annotations

import gzip
import io
import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from dflash_assets.prompts import sources as prompt_sources
from dflash_assets.prompts.sources import (
    SourceFormatError,
    embedded_sharegpt_path,
    read_source,
    sharegpt_records,
)

RECORDS = [
    {"id": "a_0", "conversations": [{"from": "human", "value": "héllo 日本 🎉"}, {"from": "gpt", "value": "hi"}]},
    {"id": "b_0", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                               {"role": "assistant", "content": "4"}]},
    {"id": "c_1", "conversations": [{"from": "gpt", "value": "…continued"}, {"from": "human", "value": "more"}]},
]


def _json_array(records: list, indent: int | None = 2) -> bytes:
    return json.dumps(records, indent=indent, ensure_ascii=False).encode()


def _jsonl(records: list) -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in records)


def _parquet(records: list) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(records), buf)
    return buf.getvalue()


COMPRESS = {
    "none": lambda b: b,
    "gzip": gzip.compress,
    "zstd": lambda b: zstandard.ZstdCompressor().compress(b),
}


def _read_all(src, **kw):
    reader = read_source(src, **kw)
    items = list(reader)
    return items, reader.summary


def test_embedded_path_is_the_package_file():
    path = embedded_sharegpt_path()
    assert path.name == "ShareGPT_V3_unfiltered_cleaned_split.json"
    assert path.stat().st_size > 100_000_000
    with open(path, "rb") as f:
        assert f.read(1) == b"["


def test_sharegpt_records_are_the_ingest_readers_records():
    """One ShareGPT reader: the tokenization package has none of its own."""
    import dflash_assets.tokenization.samples as samples

    assert not hasattr(samples, "sharegpt_records") and not hasattr(samples, "sharegpt_completions")
    head = sharegpt_records(40)
    with read_source(embedded_sharegpt_path()) as reader:
        first = [item.record for _, item in zip(range(40), reader)]
    assert head == first and len(head) == 40
    assert all(isinstance(r, dict) and "conversations" in r for r in head)
    assert sharegpt_records(0) == [] and sharegpt_records(3) == head[:3]


@pytest.mark.parametrize("compression", sorted(COMPRESS))
@pytest.mark.parametrize("fmt", ["json_array", "jsonl"])
def test_formats_and_compression_by_magic_bytes(tmp_path, fmt, compression):
    data = _json_array(RECORDS) if fmt == "json_array" else _jsonl(RECORDS)
    # a misleading name: detection must use the bytes, not the extension
    path = tmp_path / "prompts.txt"
    path.write_bytes(COMPRESS[compression](data))
    items, summary = _read_all(path)
    assert [i.record for i in items] == RECORDS
    assert [i.index for i in items] == [0, 1, 2]
    assert (summary.format, summary.compression) == (fmt, compression)
    assert summary.finished and not summary.truncated and summary.items == 3


@pytest.mark.parametrize("compression", sorted(COMPRESS))
def test_parquet_sources_both_shapes(tmp_path, compression):
    sharegpt = [r for r in RECORDS if "conversations" in r]
    openai = [r for r in RECORDS if "messages" in r]
    for records in (sharegpt, openai):
        path = tmp_path / f"p-{compression}.parquet"
        path.write_bytes(COMPRESS[compression](_parquet(records)))
        items, summary = _read_all(f"file://{path}")
        assert summary.format == "parquet" and summary.compression == compression
        assert [i.record for i in items] == records


def test_bytes_and_streams_are_sources():
    data = gzip.compress(_jsonl(RECORDS))
    assert [i.record for i in _read_all(data)[0]] == RECORDS
    assert [i.record for i in _read_all(io.BytesIO(data))[0]] == RECORDS


def test_utf8_bom_and_leading_blank_space(tmp_path):
    for body in (_json_array(RECORDS), _jsonl(RECORDS)):
        items, _ = _read_all(b"\xef\xbb\xbf" + b"\n \n" + body)
        assert [i.record for i in items] == RECORDS


@pytest.mark.parametrize("compression", ["none", "gzip"])
@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_megabytes_of_leading_blank_space_are_read_past(tmp_path, fmt, compression):
    """~2 MB of blank space before a valid array is read past, not reported as an empty file."""
    blank = b" \n\t\r" * (512 * 1024)  # 2 MiB
    body = (_json_array(RECORDS, indent=None)[:-1] + b', {"broken": }]' if fmt == "json"
            else _jsonl(RECORDS) + b'{"broken": }\n')
    path = tmp_path / f"blank.{fmt}"
    path.write_bytes(COMPRESS[compression](b"\xef\xbb\xbf" + blank + body))
    for src in (path, path.read_bytes()):  # a seekable local file, and bytes
        items, summary = _read_all(src)
        assert [i.record for i in items[:3]] == RECORDS and summary.format == ("json_array" if fmt == "json"
                                                                              else "jsonl")
        # offsets still count the BOM and the blank space: the bad record's points into the file as written
        (bad,) = items[3:]
        assert bad.problem == "malformed_json" and bad.byte_offset == 3 + len(blank) + body.index(b'{"broken"')
    with pytest.raises(SourceFormatError, match=r"empty \(or only blank space: 2097152 bytes\)"):
        read_source(COMPRESS[compression](blank))


def _element_spans(text: bytes) -> list[tuple[int, int]]:
    """Byte spans of the top-level elements of a JSON array, found independently."""
    s = text.decode()
    dec = json.JSONDecoder()
    spans, i = [], s.index("[") + 1
    while True:
        while s[i] in " \n\t,":
            i += 1
        if s[i] == "]":
            return spans
        _, j = dec.raw_decode(s, i)
        spans.append((len(s[:i].encode()), len(s[:j].encode())))
        i = j


@pytest.mark.parametrize("chunk", [5, 64, 4 * 1024 * 1024])
def test_json_array_cut_anywhere_yields_complete_records(monkeypatch, chunk):
    """Cut the array at every byte: every complete record comes out; the cut is reported, never raised."""
    monkeypatch.setattr(prompt_sources, "_CHUNK", chunk)
    data = _json_array(RECORDS)
    spans = _element_spans(data)
    for cut in range(data.index(b"[") + 1, len(data) + 1):
        items, summary = _read_all(data[:cut])
        complete = [k for k, (_, end) in enumerate(spans) if end <= cut]
        assert [i.record for i in items] == [RECORDS[k] for k in complete], cut
        assert all(i.problem is None for i in items)
        if cut == len(data):
            assert not summary.truncated
            continue
        assert summary.truncated, cut
        partial = [start for start, end in spans if end > cut and start < cut]
        if partial:  # cut inside a record: the offset is where that record starts
            assert summary.truncated_at_byte == partial[0], cut
            assert summary.truncated_tail_bytes == cut - partial[0]
        else:  # between records or before ']': the source simply ends
            assert summary.truncated_at_byte == cut and summary.truncated_tail_bytes == 0


def test_json_array_syntax_error_stops_with_a_problem_item():
    good = _json_array(RECORDS[:2], indent=None)
    data = good[:-1] + b', {"id": "x", "conversations": [oops]}, ' + _json_array(RECORDS[2:], indent=None)[1:]
    items, summary = _read_all(data)
    assert [i.record for i in items[:2]] == RECORDS[:2]
    assert items[2].problem == "malformed_json" and "oops" in items[2].raw
    assert items[2].byte_offset == len(good[:-1]) + 2
    assert len(items) == 3 and summary.parse_error and not summary.truncated


def test_json_array_invalid_utf8_marks_only_that_record(monkeypatch):
    monkeypatch.setattr(prompt_sources, "_CHUNK", 16)
    records = [{"id": str(k), "conversations": [{"from": "human", "value": f"q{k} é"}]} for k in range(4)]
    data = _json_array(records, indent=None).replace("q2 é".encode(), b"q2 \xff\xfe")
    items, summary = _read_all(data)
    assert [i.problem for i in items] == [None, None, "invalid_utf8", None]
    assert "\\xff" in items[2].raw  # raw text stays printable
    assert items[2].byte_offset == data.index(b'{"id": "2"')
    assert [i.record for i in items if i.problem is None] == [records[k] for k in (0, 1, 3)]
    assert summary.finished and not summary.truncated


def test_json_array_oversize_element():
    big = {"id": "big", "conversations": [{"from": "human", "value": "x" * 5000}]}
    items, _ = _read_all(_json_array([RECORDS[0], big, RECORDS[1]]), max_raw_record_chars=2000)
    assert [i.problem for i in items] == [None, "oversize", None]
    assert items[1].raw_chars > 5000 and len(items[1].raw) <= 4096


def test_json_array_record_longer_than_the_window_cap_stops(monkeypatch):
    """A record that never ends within max_raw_record_chars must not pull the whole file into memory."""
    monkeypatch.setattr(prompt_sources, "_CHUNK", 1000)
    big = {"id": "big", "conversations": [{"from": "human", "value": "x" * 50_000}]}
    data = _json_array([RECORDS[0], big, RECORDS[1]])
    items, summary = _read_all(data, max_raw_record_chars=8000)
    assert [i.problem for i in items] == [None, "oversize"]
    assert "reading stopped" in summary.parse_error


@pytest.mark.parametrize("chunk", [13, 64, 4096])
def test_json_array_deep_record_and_trailing_data_across_windows(monkeypatch, chunk):
    """A record too deep for the parser is skipped by bracket counting, wherever the window cuts it."""
    monkeypatch.setattr(prompt_sources, "_CHUNK", chunk)
    deep = '{"id": "d", "x": "a ] } [ \\" {", "c": ' + "[" * 2000 + "]" * 2000 + "}"
    text = "[" + ", ".join([json.dumps(RECORDS[0]), deep, json.dumps(RECORDS[1])]) + "]\n[" + json.dumps(RECORDS[2])
    data = (text + "] trailing").encode()
    items, summary = _read_all(data)
    assert [i.problem for i in items] == [None, "nested_too_deep", None, None, "trailing_data"]
    assert [i.record for i in items if i.problem is None] == RECORDS
    assert items[1].raw_chars == len(deep) and items[1].byte_offset == data.index(b'{"id": "d"')
    assert items[4].byte_offset == len(data) - len(b"trailing") and items[4].raw_chars == len(b"trailing")
    assert summary.json_arrays == 2 and "trailing data" in summary.parse_error and not summary.truncated
    # a deep record cut off by the end of the file is a truncated source, not a crash
    items, summary = _read_all(("[" + json.dumps(RECORDS[0]) + ", " + deep[:-100]).encode())
    assert [i.record for i in items] == RECORDS[:1] and summary.truncated


def test_jsonl_bad_lines_do_not_stop_the_read():
    lines = [
        json.dumps(RECORDS[0]).encode(),
        b"",  # blank lines are not records
        b'{"id": "m", "conversations": [}',  # malformed
        b'{"id": "u", "conversations": [{"from": "human", "value": "\xc3\x28"}]}',  # invalid UTF-8
        b'{"id": "big", "conversations": [{"from": "human", "value": "' + b"y" * 3000 + b'"}]}',
        json.dumps(RECORDS[1]).encode(),
        b'{"id": "t", "conversations": [{"from": "hum',  # truncated last line, no newline
    ]
    data = b"\n".join(lines)
    items, summary = _read_all(data, max_raw_record_chars=1000)
    assert [i.problem for i in items] == [None, "malformed_json", "invalid_utf8", "oversize", None]
    assert [i.index for i in items] == [0, 1, 2, 3, 4]
    assert items[0].record == RECORDS[0] and items[4].record == RECORDS[1]
    assert items[1].byte_offset == data.index(b'{"id": "m"')
    assert items[2].byte_offset == data.index(b'{"id": "u"')
    assert summary.truncated and summary.truncated_at_byte == data.index(b'{"id": "t"')


def test_jsonl_last_line_without_newline_is_a_record():
    data = _jsonl(RECORDS).rstrip(b"\n")
    items, summary = _read_all(data)
    assert [i.record for i in items] == RECORDS and not summary.truncated
    # a complete but malformed last line is malformed, not truncated
    items, summary = _read_all(data + b"\n{bad}")
    assert items[-1].problem == "malformed_json" and not summary.truncated


def test_parquet_invalid_utf8_row():
    good = pa.array([b"ok", b"bad \xff", b"fine"], pa.binary())
    ids = pa.Array.from_buffers(pa.string(), 3, good.buffers())  # unvalidated string column
    conv = pa.array([[{"from": "human", "value": v}] for v in ("a", "b", "c")])
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": ids, "conversations": conv}), buf)
    items, _ = _read_all(buf.getvalue())
    assert [i.problem for i in items] == [None, "invalid_utf8", None]
    assert items[0].record["id"] == "ok" and items[2].record["id"] == "fine"
    assert "bad" in items[1].raw and '"b"' in items[1].raw


@pytest.mark.parametrize("data, message", [
    (b"", "empty"),
    (b"   \n", "empty"),
    (b"hello world", "unknown format"),
    (gzip.compress(b"<xml/>", mtime=0), "unknown format"),
])
def test_unreadable_sources_raise_a_clear_error(data, message):
    with pytest.raises(SourceFormatError, match=message):
        read_source(data)


def test_missing_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_source(tmp_path / "nope.json")


def _flushed_parts(kind: str, lines: list[bytes]) -> list[bytes]:
    """A compressed stream flushed after every line: cutting it between parts ends output at a line end."""
    if kind == "zstd":
        cobj = zstandard.ZstdCompressor(write_checksum=True).compressobj()
        return [cobj.compress(line) + cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK) for line in lines]
    buf = io.BytesIO()
    g = gzip.GzipFile(fileobj=buf, mode="wb")
    parts, last = [], 0
    for line in lines:
        g.write(line)
        g.flush()  # Z_SYNC_FLUSH
        parts.append(buf.getvalue()[last:])
        last = len(buf.getvalue())
    return parts


@pytest.mark.parametrize("kind", ["gzip", "zstd"])
def test_cut_compressed_stream_is_a_truncated_source(kind):
    lines = [json.dumps({"id": str(k), "conversations": [{"from": "human", "value": f"q{k} " * 40}]}).encode() + b"\n"
             for k in range(50)]
    parts = _flushed_parts(kind, lines)
    # cut at a line boundary: the JSONL layer sees a clean end, the decompressor does not
    items, summary = _read_all(b"".join(parts[:20]))
    assert [i.record["id"] for i in items] == [str(k) for k in range(20)]
    assert summary.truncated and summary.truncated_at_byte == sum(map(len, lines[:20]))
    assert kind in summary.parse_error
    # cut inside a record of a JSON array
    text = _json_array([json.loads(line) for line in lines])
    pieces = _flushed_parts(kind, [text[i : i + 100] for i in range(0, len(text), 100)])
    items, summary = _read_all(b"".join(pieces[: len(pieces) // 2]))
    assert 0 < len(items) < 50 and all(i.problem is None for i in items)
    assert summary.truncated and kind in summary.parse_error


def test_corrupt_gzip_stops_without_raising():
    data = bytearray(gzip.compress(_jsonl(RECORDS * 50)))
    data[-6] ^= 0xFF  # the CRC trailer
    items, summary = _read_all(bytes(data))
    assert len(items) == 150 and summary.truncated and "CRC" in summary.parse_error


# --- cut and corrupt compressed files: named as such, with the file and the compressed offset ---------------


def _varied_jsonl(n: int = 3000) -> tuple[list[dict], bytes]:
    """Records of seeded random words: text that compresses ~3x, so a file spans many decoder reads."""
    rng = random.Random(7)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(4000)]
    records = [{"id": str(k), "conversations": [{"from": "human", "value": " ".join(rng.choices(words, k=20))}]}
               for k in range(n)]
    return records, _jsonl(records)


def _zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(write_checksum=True).compress(data)  # a checksum, as the zstd CLI writes


def _flip(data: bytes, pos: int) -> bytes:
    out = bytearray(data)
    out[pos] ^= 0xFF
    return bytes(out)


def test_zstd_cut_inside_the_frame_header_is_a_cut_not_an_empty_source(tmp_path):
    _, data = _varied_jsonl(50)
    z = _zstd(data)
    header = zstandard.frame_header_size(z)
    assert header >= 6
    path = tmp_path / "prompts.jsonl.zst"
    for cut in range(1, header + 1):  # inside the magic number, then inside the rest of the header
        path.write_bytes(z[:cut])
        with pytest.raises(SourceFormatError) as e:
            read_source(path)
        message = str(e.value)
        assert f"zstd stream cut at compressed byte {cut}" in message and str(path) in message
        assert "nothing could be read" in message and "empty" not in message


def test_zstd_cut_mid_frame_keeps_the_records_before_the_cut(tmp_path):
    records, data = _varied_jsonl()
    z = _zstd(data)
    cut = len(z) // 2
    path = tmp_path / "prompts.jsonl.zst"
    path.write_bytes(z[:cut])
    items, summary = _read_all(path)
    assert 0 < len(items) < len(records)
    assert [i.record for i in items] == records[: len(items)]  # a prefix, none of it garbled
    assert summary.truncated and summary.damage == "cut" and summary.stopped_at_compressed_byte == cut
    assert summary.parse_error.startswith(f"{path}: zstd stream cut at compressed byte {cut}")


def test_zstd_flipped_byte_is_corrupt_and_reading_stops_after_it(tmp_path):
    records, data = _varied_jsonl()
    z = _zstd(data)
    path = tmp_path / "prompts.jsonl.zst"
    for flip in (len(z) // 3, len(z) - 2):  # inside a block; inside the frame's checksum
        path.write_bytes(_flip(z, flip))
        items, summary = _read_all(path)
        assert summary.truncated and summary.damage == "corrupt"
        assert flip < summary.stopped_at_compressed_byte <= len(z)
        assert "zstd stream corrupt at compressed byte" in summary.parse_error and str(path) in summary.parse_error
        assert len(items) < len(records) and items[0].record == records[0]


def test_gzip_cut_in_the_header_and_mid_member(tmp_path):
    records, data = _varied_jsonl()
    g = gzip.compress(data)
    path = tmp_path / "prompts.jsonl.gz"
    for cut in (1, 2, 5, 10):  # inside the magic number, then inside the 10-byte header
        path.write_bytes(g[:cut])
        with pytest.raises(SourceFormatError, match=f"gzip stream cut at compressed byte {cut}\\b") as e:
            read_source(path)
        assert str(path) in str(e.value) and "empty" not in str(e.value)
    cut = len(g) // 2
    path.write_bytes(g[:cut])
    items, summary = _read_all(path)
    assert 0 < len(items) < len(records) and [i.record for i in items] == records[: len(items)]
    assert summary.damage == "cut" and summary.stopped_at_compressed_byte == cut and summary.truncated
    assert f"{path}: gzip stream cut at compressed byte {cut}" in summary.parse_error


def test_gzip_flipped_byte_is_corrupt_at_the_byte_the_decoder_refused(tmp_path):
    records, data = _varied_jsonl()
    g = gzip.compress(data)
    path = tmp_path / "prompts.jsonl.gz"
    path.write_bytes(_flip(g, 2))  # the compression method: refused in the header, before any data
    with pytest.raises(SourceFormatError, match="gzip stream corrupt at compressed byte [0-9]\\b.*unknown compression"):
        read_source(path)
    path.write_bytes(_flip(g, len(g) - 6))  # the CRC-32 trailer: every record decodes, then the check fails
    items, summary = _read_all(path)
    assert [i.record for i in items] == records
    assert summary.damage == "corrupt" and summary.stopped_at_compressed_byte == len(g) - 4
    assert "CRC-32" in summary.parse_error and str(path) in summary.parse_error
    flip = len(g) // 2  # inside the deflate data
    path.write_bytes(_flip(g, flip))
    items, summary = _read_all(path)
    assert summary.damage == "corrupt" and flip < summary.stopped_at_compressed_byte <= len(g)
    assert len(items) > 0 and items[0].record == records[0]


@pytest.mark.parametrize("kind", ["gzip", "zstd"])
def test_empty_compressed_file_is_empty_and_padding_or_more_members_are_whole(kind):
    compress = gzip.compress if kind == "gzip" else _zstd
    with pytest.raises(SourceFormatError, match="empty") as e:
        read_source(compress(b""))  # a valid frame or member of zero bytes
    assert "cut" not in str(e.value) and "corrupt" not in str(e.value)
    one = compress(_jsonl(RECORDS))
    whole = [(one + one, 2), (one + compress(b"") + one, 2)]
    if kind == "gzip":  # zero padding between and after members, as gzip reads it
        whole += [(one + b"\0" * 7 + one, 2), (one + b"\0" * 3, 1)]
    for data, copies in whole:
        items, summary = _read_all(data)
        assert [i.record for i in items] == RECORDS * copies and summary.damage is None and not summary.truncated


def test_cut_compressed_parquet_is_named_cut(tmp_path):
    z = _zstd(_parquet(_varied_jsonl()[0]))
    path = tmp_path / "prompts.parquet.zst"
    path.write_bytes(z[: len(z) // 2])  # blocks before the cut decode: the Parquet head is found, its end is not
    with pytest.raises(SourceFormatError, match=f"zstd stream cut at compressed byte {len(z) // 2}:.*footer") as e:
        read_source(path)
    assert str(path) in str(e.value)


def test_parquet_cut_or_with_a_corrupt_page(tmp_path):
    rows = _varied_jsonl(3000)[0]
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf, row_group_size=1000, compression="snappy")
    data = buf.getvalue()
    path = tmp_path / "prompts.parquet"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(SourceFormatError, match="unreadable Parquet, cut or corrupt") as e:
        _read_all(path)  # Parquet is opened when reading starts
    assert str(path) in str(e.value) and f"its {len(data) // 2} bytes" in str(e.value)

    group = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(1)
    text = group.column(1)  # conversations' text, snappy-compressed pages
    start = min(group.column(c).dictionary_page_offset or group.column(c).data_page_offset
                for c in range(group.num_columns))
    path.write_bytes(_flip(data, text.data_page_offset + text.total_compressed_size // 2))
    items, summary = _read_all(path)
    assert [i.record for i in items] == rows[:1000]  # row group 0, whole; nothing after the bad page
    assert summary.damage == "corrupt" and summary.truncated and summary.stopped_at_compressed_byte == start
    assert "row group 1 of 3" in summary.parse_error and str(path) in summary.parse_error
