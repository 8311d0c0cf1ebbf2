"""Run configuration of each stage: one ``dg.Config`` per stage, defaults that are safe.

Each class converts to the library's own config object, so a notebook and the
Dagster UI accept the same settings.
"""

import os
from typing import Optional

import dagster as dg
from pydantic import Field


class IngestConfig(dg.Config):
    source_uri: Optional[str] = Field(
        default=None,
        description="Prompt source: a local path or s3:// URI (ShareGPT JSON, JSONL, Parquet; .gz/.zst ok). "
        "Default: $DFLASH_PROMPT_SOURCE, else the embedded ShareGPT file.",
    )
    max_prompts_per_shard: int = Field(default=1024, description="At most this many prompts per prompt_shards partition.")
    max_record_chars: int = Field(default=65_536, description="Records longer than this are quarantined as oversize.")
    leading_assistant: str = Field(
        default="drop",
        description="Conversations that start with an assistant turn: 'drop' the leading assistant turns "
        "(counted) or 'quarantine' the record.",
    )
    limit: Optional[int] = Field(
        default=None, description="Keep only the first N valid prompts (for demos). Counts still cover the whole source."
    )

    def resolved_source(self) -> str:
        from dflash_assets.prompt_sources import embedded_sharegpt_path

        return self.source_uri or os.environ.get("DFLASH_PROMPT_SOURCE") or str(embedded_sharegpt_path())

    def to_library(self):
        from dflash_assets.raw_prompts import IngestConfig as LibIngestConfig

        return LibIngestConfig(
            max_prompts_per_shard=self.max_prompts_per_shard, max_record_chars=self.max_record_chars,
            leading_assistant=self.leading_assistant,
            limit=self.limit,
        )
