"""Mixing a partition's sources by weight: the corpus whole, another source's first rows by weight, no repeat."""

from __future__ import annotations

import pyarrow as pa
import pytest

from dflash_assets.prompts.prompt_mix import CORPUS, check_weights, mix_by_weight
from dflash_assets.prompts.shards import AGENTIC_PROMPT_SCHEMA, PROMPT_SCHEMA


def _table(ids, source, shard="shard-00000", schema=PROMPT_SCHEMA, extra=False):
    n = len(ids)
    cols = {"prompt_id": ids, "shard": [shard] * n, "system": [None] * n, "user_turns": [[f"q {i}"] for i in ids],
            "num_user_turns": [1] * n, "prompt_chars": [3] * n, "source": [source] * n,
            "source_id": [f"#{i}" for i in range(n)], "source_index": list(range(n)), "category": ["c"] * n,
            "starts_mid_conversation": [False] * n, "ingest_generation": [1] * n}
    if schema is AGENTIC_PROMPT_SCHEMA:
        cols |= {"tools": [None] * n, "agentic_turns": [None] * n}
    table = pa.table(cols, schema=schema)
    return table.append_column("sample_index", pa.array(range(n), pa.int64())) if extra else table


@pytest.mark.parametrize(("weight", "taken"), [(0.0, 0), (0.25, 2), (0.5, 4), (1.0, 6)])
def test_weight_adds_a_share_of_the_corpus_size(weight, taken):
    corpus = _table([f"c{i}" for i in range(8)], "sharegpt")
    other = _table([f"s{i}" for i in range(6)], "self_generated", shard="x", extra=True)
    mixed, [share] = mix_by_weight(corpus, "shard-00000", [("self_generated", other, weight)])
    assert mixed.schema == corpus.schema
    assert mixed.num_rows == 8 + taken
    assert mixed.column("prompt_id").to_pylist()[8:] == [f"s{i}" for i in range(taken)]  # its first rows
    assert set(mixed.column("shard").to_pylist()) == {"shard-00000"}
    assert share.taken == taken and share.wanted == round(weight * 8)


def test_a_prompt_the_corpus_holds_is_not_added_twice_and_agentic_columns_are_null():
    corpus = _table(["a", "b"], "sharegpt", schema=AGENTIC_PROMPT_SCHEMA)
    other = _table(["a", "z"], "self_generated")
    mixed, [share] = mix_by_weight(corpus, "shard-00000", [("self_generated", other, 1.0)])
    assert mixed.column("prompt_id").to_pylist() == ["a", "b", "z"]
    assert mixed.column("agentic_turns").null_count == 3
    assert share.taken == 1


def test_weights_are_checked():
    assert check_weights({CORPUS: 1.0, "self_generated": 0.5}, ["self_generated"]) == {"self_generated": 0.5}
    with pytest.raises(ValueError, match="unknown"):
        check_weights({"web": 1.0}, ["self_generated"])
    with pytest.raises(ValueError, match=">= 0"):
        check_weights({"self_generated": -1.0}, ["self_generated"])
    with pytest.raises(ValueError, match="unit"):
        check_weights({CORPUS: 2.0}, ["self_generated"])
