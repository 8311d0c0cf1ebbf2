"""The prompt ingest's settings: :class:`IngestConfig`, read by normalization, sharding and the ingest driver.

One frozen dataclass, checked when it is made; reads and writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dflash_assets.prompts.sources import DEFAULT_MAX_RAW_RECORD_CHARS

__all__ = ["IngestConfig"]


@dataclass(frozen=True)
class IngestConfig:
    max_prompts_per_shard: int = 1024
    max_record_chars: int = 65_536  # system + user text after normalization; ~16K tokens
    limit: int | None = None  # keep only the first N valid (unique) prompts of the source
    source_name: str | None = None  # default: the file name without extensions
    leading_assistant: Literal["drop", "quarantine"] = "drop"
    # New prompts first fill the last shard if it has room. False: they always open
    # new shards, so no shard whose completions were generated ever changes.
    fill_last_shard: bool = True
    category_field: str = "category"
    max_raw_record_chars: int = DEFAULT_MAX_RAW_RECORD_CHARS  # a record's raw text, before parsing
    quarantine_raw_chars: int = 4096  # raw JSON kept per quarantined record
    quarantine_rows_per_group: int = 4096  # rejected records held in memory before they go to the Parquet file
    # Nesting (levels of objects and arrays) allowed in an agentic record and in each JSON text it holds
    # (tools, call arguments); deeper is nested_too_deep. What the ingest keeps is JSON-dumped again later,
    # which recursion limits: 100 + 100 levels stay far below Python's ~1000 frames.
    max_json_depth: int = 100
    # Nesting allowed in one tool's parameters before jsonschema's check_schema sees it (it recurses ~8 Python
    # frames per level and overflows at ~120 levels from a shallow stack); deeper is nested_too_deep.
    max_tool_schema_depth: int = 32

    def __post_init__(self) -> None:
        if self.max_prompts_per_shard < 1:
            raise ValueError("max_prompts_per_shard must be >= 1")
        if self.max_record_chars < 1:
            raise ValueError("max_record_chars must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise ValueError("limit must be >= 1 or None")
        if self.quarantine_rows_per_group < 1:
            raise ValueError("quarantine_rows_per_group must be >= 1")
        if self.max_json_depth < 1 or self.max_tool_schema_depth < 1:
            raise ValueError("max_json_depth and max_tool_schema_depth must be >= 1")
        if self.leading_assistant not in ("drop", "quarantine"):
            raise ValueError("leading_assistant must be 'drop' or 'quarantine'")
