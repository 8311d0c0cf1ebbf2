"""The byte streams under the source readers: bytes, paths and ``file://`` URIs opened alike, a missing file or an
S3 URI without a key refused clearly, peeked bytes put back, and gzip and zstd decoded as streams whose cut or
corrupt end is reported (what was decoded before it handed out first), never raised."""

from __future__ import annotations

import gzip
import io

import pytest
import zstandard

from dflash_assets.prompts.source_streams import (GzipReader, SourceFormatError, ZstdReader, open_raw, put_back,
                                                  read_upto)

TEXT = b"".join(b'{"messages": [{"role": "user", "content": "prompt %d"}]}\n' % i for i in range(2000))


def test_bytes_paths_and_file_uris_open_alike(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(TEXT)
    for src, local in ((TEXT, None), (path, path), (str(path), path), (f"file://{path}", path)):
        f, found = open_raw(src, None, None)
        assert read_upto(f, 10) == TEXT[:10] and found == local
    with pytest.raises(FileNotFoundError):
        open_raw(tmp_path / "missing.jsonl", None, None)
    with pytest.raises(SourceFormatError, match="bucket and a key"):
        open_raw("s3://bucket-only", object(), None)
    with pytest.raises(SourceFormatError):
        open_raw(3, None, None)


def test_peeked_bytes_are_put_back_on_streams_that_cannot_seek():
    class OneWay(io.RawIOBase):
        def __init__(self):
            self._f = io.BytesIO(TEXT)

        def readable(self):
            return True

        def readinto(self, b):
            return self._f.readinto(b)

    for f in (io.BytesIO(TEXT), OneWay()):
        head = read_upto(f, 5)
        assert put_back(head, f).read() == TEXT


@pytest.mark.parametrize("codec", ["gzip", "zstd"])
def test_whole_cut_and_corrupt_streams(codec):
    packed = gzip.compress(TEXT) if codec == "gzip" else zstandard.ZstdCompressor(write_checksum=True).compress(TEXT)
    reader = GzipReader if codec == "gzip" else ZstdReader
    whole = reader(io.BytesIO(packed))
    assert whole.read() == TEXT and whole.damage is None
    cut = reader(io.BytesIO(packed[: len(packed) // 2]))
    out = cut.read()
    assert TEXT.startswith(out) and cut.damage == "cut" and cut.stopped_at == len(packed) // 2
    assert cut.error.startswith(f"{codec} stream cut at compressed byte")
    broken = bytearray(packed)
    broken[-6] ^= 0xFF  # inside the checksum or the last block
    corrupt = reader(io.BytesIO(bytes(broken)))
    assert TEXT.startswith(corrupt.read()) and corrupt.damage == "corrupt"
