"""The store's key layout, through a real local store: each shard asset's listing sees only its direct
`<shard>.parquet` objects (not `_failed/`, `_journal/` or quality reports), corpus keys name their generation,
and a hidden-state cache lists its parts in part order."""

from __future__ import annotations

import pytest

from dflash_assets.store import layout


def test_shard_listings_see_only_the_direct_shard_objects(local_store):
    for shard in ("s1", "s0"):
        local_store.write_bytes(layout.completions(shard), b"x")
        local_store.write_bytes(layout.tokenized_samples(shard), b"x")
        local_store.write_bytes(layout.raw_prompts(shard), b"x")
    local_store.write_bytes(layout.completions_failed("s2"), b"x")
    local_store.write_bytes(f"{layout.completions_journal('s3')}/run-000001.jsonl", b"x")
    local_store.write_bytes(layout.quality_gate("s4"), b"{}")
    assert layout.list_completion_shards(local_store) == ["s0", "s1"]
    assert layout.list_sample_shards(local_store) == ["s0", "s1"]
    assert layout.list_raw_prompt_shards(local_store) == ["s0", "s1"]


@pytest.mark.parametrize("key,generation", [
    (layout.corpus_staged_shard(12, "shard-0", "a1b2"), 12),
    (layout.corpus_manifest(7, "run9"), 7),
    (layout.corpus_commit(3), 3),
    (layout.corpus_index(), None),
    (layout.corpus_report("sharegpt"), None),
])
def test_corpus_keys_name_their_generation(key, generation):
    assert layout.corpus_key_generation(key) == generation


def test_a_cache_without_manifest_lists_its_parts_in_part_order(local_store):
    for part in (2, 1, 3):
        local_store.write_bytes(layout.hidden_state_part("s0", part, 3), b"x")
    local_store.write_bytes(layout.hidden_state_part("s1"), b"x")
    local_store.write_bytes(f"{layout.hidden_state_versions('s2')}/v1/part.safetensors", b"x")  # unpublished
    parts = layout.list_hidden_state_parts(local_store)
    assert parts == {"s0": [layout.hidden_state_part("s0", i, 3) for i in (1, 2, 3)],
                     "s1": [layout.hidden_state_part("s1")]}
    assert layout.hidden_state_parts(local_store, "s0")[0].endswith("s0-00001-of-00003.safetensors")
    assert layout.hidden_state_parts(local_store, "missing") == []
