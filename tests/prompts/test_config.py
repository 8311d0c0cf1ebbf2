"""The ingest's settings (dflash_assets.prompts.config): an IngestConfig is checked when it is made, and its defaults
are what the ingest reads."""

from __future__ import annotations

import pytest

from dflash_assets.prompts.config import IngestConfig
from dflash_assets.prompts.sources import DEFAULT_MAX_RAW_RECORD_CHARS


def test_config_validation():
    with pytest.raises(ValueError):
        IngestConfig(max_prompts_per_shard=0)
    with pytest.raises(ValueError):
        IngestConfig(limit=0)
    with pytest.raises(ValueError):
        IngestConfig(leading_assistant="keep")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_json_depth"):
        IngestConfig(max_json_depth=0)
    with pytest.raises(ValueError, match="max_tool_schema_depth"):
        IngestConfig(max_tool_schema_depth=0)




@pytest.mark.parametrize("field", ["max_record_chars", "quarantine_rows_per_group"])
def test_counts_below_one_are_refused_by_name(field):
    with pytest.raises(ValueError, match=field):
        IngestConfig(**{field: 0})


def test_defaults_and_a_frozen_config():
    config = IngestConfig()
    assert (config.max_prompts_per_shard, config.limit, config.leading_assistant, config.fill_last_shard,
            config.category_field) == (1024, None, "drop", True, "category")
    assert config.max_raw_record_chars == DEFAULT_MAX_RAW_RECORD_CHARS
    assert IngestConfig(leading_assistant="quarantine", limit=1).limit == 1
    with pytest.raises(AttributeError):
        config.limit = 5  # type: ignore[misc]
