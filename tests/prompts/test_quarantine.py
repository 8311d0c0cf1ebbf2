"""The ingest's quarantine (dflash_assets.prompts.quarantine): a rejected record becomes one row of the quarantine
table (reason, detail, its id, its raw JSON text truncated), streamed to Parquet a row group at a time and published
to the store; every reason code a normalizer gives has a description."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from dflash_assets.prompts.config import IngestConfig
from dflash_assets.prompts.ingest import ingest_prompt_source
from dflash_assets.prompts.quarantine import QUARANTINE_REASONS, QUARANTINE_SCHEMA, QuarantineWriter
from tests.prompts.test_ingest import GOOD, _jsonl, conv, store  # noqa: F401


def test_rows_keep_reason_id_offset_and_truncated_raw_text(store, tmp_path):
    writer = QuarantineWriter("src", raw_chars=20, rows_per_group=2)
    try:
        record = conv(("robot", "beep " * 10), id=7)
        writer.add(3, "unknown_role", "turn 0: role 'robot'", record=record, byte_offset=120)
        writer.add(4, "malformed_json", "Expecting value at byte 200", raw='{"a": \udcff', raw_chars=9, byte_offset=200)
        writer.add(5, "not_an_object", "record is a JSON list", record=["x"])
        assert dict(writer.counts) == {"unknown_role": 1, "malformed_json": 1, "not_an_object": 1}
        writer.publish(store, "prompt_corpus/quarantine/src.parquet")
    finally:
        writer.close()
    assert not writer.path.exists()  # the local file goes once published
    table = store.read_parquet("prompt_corpus/quarantine/src.parquet")
    assert table.schema.equals(QUARANTINE_SCHEMA)
    assert pq.ParquetFile(store.local_path("prompt_corpus/quarantine/src.parquet")).metadata.num_row_groups == 2
    first, second, third = table.to_pylist()
    text = json.dumps(record, ensure_ascii=False)
    assert first == {"source": "src", "source_index": 3, "source_id": "7", "reason": "unknown_role",
                     "detail": "turn 0: role 'robot'", "byte_offset": 120, "raw_chars": len(text), "raw": text[:20]}
    assert second["raw"] == '{"a": \\udcff' and second["source_id"] is None and second["raw_chars"] == 9
    assert third["raw"] == '["x"]' and third["byte_offset"] is None


def test_every_reason_has_a_description():
    assert all(isinstance(v, str) and v for v in QUARANTINE_REASONS.values())
    assert {"malformed_json", "unknown_role", "oversize", "bad_tool_call", "nested_too_deep"} <= set(QUARANTINE_REASONS)


def test_quarantine_is_streamed_not_held_in_memory(tmp_path, store):
    """The quarantine goes to its Parquet file a row group at a time; memory does not grow with it."""
    import tracemalloc

    bad = [conv(("robot", f"{k} " + "z" * 6000), id=f"r{k}") for k in range(3000)]
    (tmp_path / "bad.jsonl").write_bytes(_jsonl(GOOD[:1] + bad))
    config = IngestConfig(quarantine_rows_per_group=200, max_record_chars=10_000)
    tracemalloc.start()
    try:
        report = ingest_prompt_source(tmp_path / "bad.jsonl", store, config)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert report.quarantined == {"unknown_role": 3000} and report.valid == 1
    # 3000 rows x 4 KiB of raw text is 12 MiB (13.3 MiB peak if it were all kept); 200 rows of it is 0.8 MiB
    assert peak < 6 * 2**20, f"peak traced memory {peak / 2**20:.1f} MiB"
    q = pq.ParquetFile(store.local_path(report.quarantine_key))
    assert q.metadata.num_row_groups == 15 and q.metadata.num_rows == 3000
    assert q.read().column("source_id").to_pylist() == [f"r{k}" for k in range(3000)]


