"""Prompt shard tables (dflash_assets.prompts.shards): the builder's rows and schemas (plain, or widened for an
agentic prompt), and a staged shard materialized as a ``raw_prompts`` partition (checked against the corpus index,
its stats read from the table written). Real Parquet through a LocalStore."""

from __future__ import annotations

import hashlib
import json

import pytest

from dflash_assets.prompts.normalization import normalize_record
from dflash_assets.prompts.shards import AGENTIC_PROMPT_SCHEMA, PROMPT_SCHEMA, ShardBuilder, materialize_prompt_shard
from dflash_assets.store import layout
from tests.prompts.test_ingest import _ingest, conv, store  # noqa: F401

AGENTIC = {
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}],
}


def test_builder_keeps_a_plain_shard_plain_and_widens_it_for_an_agentic_prompt():
    plain = [normalize_record(conv(("human", f"question {k}"), ("gpt", "a")), index=k) for k in range(2)]
    builder = ShardBuilder("shard-00000", None, capacity=3)
    for k, p in enumerate(plain):
        builder.add(p, "src", k, 1)
    assert builder.added == 2 and builder.free == 1
    table = builder.table()
    assert table.schema.equals(PROMPT_SCHEMA)
    assert table.column("prompt_id").to_pylist() == [p.prompt_id for p in plain]
    assert table.column("user_turns").to_pylist() == [["question 0"], ["question 1"]]
    assert set(table.column("shard").to_pylist()) == {"shard-00000"}
    assert table.column("source_index").to_pylist() == [0, 1]

    agentic = normalize_record(AGENTIC, index=2)
    assert agentic.agentic_turns is not None
    more = ShardBuilder("shard-00000", table, capacity=3)  # the existing rows stay, first
    assert more.free == 1
    more.add(agentic, "src", 2, 2)
    wide = more.table()
    assert wide.schema.equals(AGENTIC_PROMPT_SCHEMA) and wide.num_rows == 3
    assert wide.column("agentic_turns").null_count == 2 and wide.column("ingest_generation").to_pylist() == [1, 1, 2]
    assert json.loads(wide.column("tools")[2].as_py())[0]["function"]["name"] == "get_weather"


def test_materialized_shard_is_the_staged_one_with_its_stats(tmp_path, store):
    _ingest(tmp_path, store, range(4), cap=3)
    table, stats = materialize_prompt_shard(store, "shard-00000")
    data = store.read_bytes(layout.raw_prompts("shard-00000"))
    assert stats.sha256 == hashlib.sha256(data).hexdigest() and stats.key == layout.raw_prompts("shard-00000")
    assert (stats.num_prompts, stats.num_user_turns, stats.max_user_turns, stats.with_system) == (3, 3, 1, 0)
    assert stats.sources == {"corpus": 3} and stats.categories == {"unknown": 3} and stats.generation == 1
    assert table.column("source_id").to_pylist() == ["p0", "p1", "p2"]


def test_materialize_checks_its_input(tmp_path, store):
    _ingest(tmp_path, store, range(4), cap=3)
    with pytest.raises(KeyError, match="shard-00009"):
        materialize_prompt_shard(store, "shard-00009")
    key = store.read_json(layout.corpus_index())["shards"]["shard-00001"]["key"]
    store.write_bytes(key, store.read_bytes(key) + b"x")
    with pytest.raises(ValueError, match="sha256"):
        materialize_prompt_shard(store, "shard-00001")
    assert not store.exists("raw_prompts/shard-00001.parquet")


