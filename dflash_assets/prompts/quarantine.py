"""The ingest's quarantine: reason codes (:data:`QUARANTINE_REASONS`), the table's schema and its writer.

:class:`QuarantineWriter` streams rejected records (the source reader's
unreadable ones, and the rejections of :mod:`dflash_assets.prompts.normalization`)
to a local Parquet file, a row group at a time, and uploads it once. Reads
nothing; writes a temporary local file and, on ``publish``, the store key it is
given (``prompt_corpus/quarantine/<source>.parquet``, atomically through the store).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_assets.prompts.normalization import record_id_text

__all__ = ["QUARANTINE_REASONS", "QUARANTINE_SCHEMA", "QuarantineWriter"]


QUARANTINE_REASONS = {
    "malformed_json": "not valid JSON (a JSONL line, or an array element: reading the array stops there)",
    "trailing_data": "data after a JSON array's closing ']' that is not another array (kept as one row; not read)",
    "nested_too_deep": "a record nested deeper than the JSON parser's recursion limit; an agentic record nested "
                       "deeper than max_json_depth, or holding JSON text (tools, call arguments) that is; a tool's "
                       "parameters schema nested deeper than max_tool_schema_depth",
    "invalid_utf8": "invalid UTF-8 bytes in the record, or lone surrogates in its system/user text",
    "oversize": "raw record over max_raw_record_chars, or system+user text over max_record_chars",
    "not_an_object": "the record is not a JSON object",
    "missing_conversation": "no 'conversations' or 'messages' list",
    "empty_conversation": "the conversation has no turns",
    "bad_turn": "a turn that is not an object, or has no role or no content",
    "unknown_role": "a role outside human/user/gpt/chatgpt/bing/bard/assistant/system",
    "non_string_content": "a turn's content, or the record's 'system' field, is not a string (or a list of text parts)",
    "late_system_turn": "a system turn after the conversation started",
    "unkept_content": "content a prompt has no place for, so the record cannot be kept whole: both 'conversations' "
                      "and 'messages', both 'tools' and 'functions', a turn with two roles (from/role) or two "
                      "contents (value/content) that differ, a user or system turn carrying 'name', tool calls or "
                      "a tool call id (a tool result carrying tool calls)",
    "no_user_turn": "no non-empty user turn (assistant-only, system-only, blank user turns)",
    "assistant_first": "starts with an assistant turn (only with leading_assistant='quarantine')",
    "bad_tools": "tool definitions that are not a list of named function objects (or its JSON text), "
                 "parameters that are not a valid JSON Schema (Draft 2020-12, as SGLang checks them), "
                 "or tool calls recorded without any tool definitions",
    "bad_tool_call": "a recorded tool call without a name, with arguments that are not a JSON object, "
                     "or naming a tool the record does not define",
    "orphan_tool_result": "a tool result with no tool call before it (or more results than calls)",
    "missing_tool_result": "a tool call step followed by another turn before all its results",
    "duplicate_tool_call_id": "two tool calls of one assistant turn with the same id (results could not be "
                              "matched to calls; quarantined, not renamed)",
}

QUARANTINE_SCHEMA = pa.schema([
    pa.field("source", pa.string(), nullable=False),
    pa.field("source_index", pa.int64(), nullable=False),
    pa.field("source_id", pa.string()),
    pa.field("reason", pa.string(), nullable=False),
    pa.field("detail", pa.string(), nullable=False),
    pa.field("byte_offset", pa.int64()),
    pa.field("raw_chars", pa.int64(), nullable=False),
    pa.field("raw", pa.string(), nullable=False),  # JSON text of the record, truncated
])

_NO_RECORD = object()  # QuarantineWriter.add: no parsed record, only its raw text


class QuarantineWriter:
    """Rejected records, streamed to a local Parquet file a row group at a time; ``publish`` uploads it.

    Memory holds at most ``rows_per_group`` rows (each raw text truncated to
    ``raw_chars``), whatever the number of rejected records.
    """

    def __init__(self, source: str, raw_chars: int, rows_per_group: int = 4096):
        self.source = source
        self.raw_chars = raw_chars
        self.rows_per_group = rows_per_group
        self.cols: dict[str, list[Any]] = {f.name: [] for f in QUARANTINE_SCHEMA}
        self.counts: Counter[str] = Counter()
        self._dir = tempfile.mkdtemp(prefix="dflash-quarantine-")
        self.path = Path(self._dir) / "quarantine.parquet"
        self._writer = pq.ParquetWriter(self.path, QUARANTINE_SCHEMA, compression="zstd")

    def add(self, index: int, reason: str, detail: str, *, record: Any = _NO_RECORD, raw: str | None = None,
            raw_chars: int = 0, byte_offset: int | None = None) -> None:
        if record is not _NO_RECORD:
            try:
                text = json.dumps(record, ensure_ascii=False, default=str)
            except RecursionError:  # parsed, but too deep to print again from here
                text = f"<record nested too deeply to print: {type(record).__name__}>"
            raw, raw_chars = text[: self.raw_chars], len(text)
        raw = (raw or "").encode("utf-8", "backslashreplace").decode("utf-8")
        c = self.cols
        c["source"].append(self.source)
        c["source_index"].append(index)
        c["source_id"].append(record_id_text(record.get("id")) if isinstance(record, dict) else None)
        c["reason"].append(reason)
        c["detail"].append(detail.encode("utf-8", "backslashreplace").decode("utf-8"))
        c["byte_offset"].append(byte_offset)
        c["raw_chars"].append(raw_chars)
        c["raw"].append(raw)
        self.counts[reason] += 1
        if len(c["reason"]) >= self.rows_per_group:
            self._flush()

    def _flush(self) -> None:
        if self.cols["reason"]:
            self._writer.write_table(pa.table(self.cols, schema=QUARANTINE_SCHEMA))
            self.cols = {f.name: [] for f in QUARANTINE_SCHEMA}

    def publish(self, store: Any, key: str) -> None:
        """Close the file and upload it to ``key`` (atomic through the store)."""
        self._flush()
        self._writer.close()
        store.upload_file(key, self.path)

    def close(self) -> None:
        """Remove the local file (after ``publish``, or when the ingest fails)."""
        with contextlib.suppress(Exception):
            self._writer.close()
        shutil.rmtree(self._dir, ignore_errors=True)
