"""Measurements on the store: a pilot's tokens per sample scaled by the corpus's own prompt lengths, read from its
raw_prompts shards."""

from __future__ import annotations

import pytest


def test_tokens_per_sample_take_the_prompt_lengths_of_the_whole_corpus(tmp_path):
    """A pilot of a few prompts measures what generation adds; the corpus's own prompt text (all of it, column by
    column) gives the rest: a corpus of longer prompts than the pilot's gets longer samples."""
    import pyarrow as pa

    from dflash_assets.planning.measurements import PilotMeasure, measure_prompts
    from dflash_assets.store import layout
    from dflash_assets.store.backends import LocalStore

    pilot = PilotMeasure(prompts=4, done=4, failed=0, turns=8, completion_tokens=800, prompt_tokens=400,
                         wall_s=1.0, dispatch_s=1.0, concurrency=2, sample_tokens=1_200, user_chars=400,
                         user_tokens=100)
    assert pilot.tokens_per_sample == 300
    assert pilot.scaled_tokens_per_sample(100.0) == pytest.approx(300)  # the same prompt lengths as the pilot's
    assert pilot.scaled_tokens_per_sample(1_000.0) == pytest.approx((1_200 - 100) / 4 + 1_000 * 100 / 400)
    assert pilot.scaled_tokens_per_sample(None) == 300
    store = LocalStore(tmp_path / "store")
    store.write_parquet(layout.raw_prompts("s0"), pa.Table.from_pylist([
        {"system": "ab", "user_turns": ["abc", "defg", "hij"], "num_user_turns": 3},
        {"system": None, "user_turns": ["x" * 10], "num_user_turns": 1}]))
    seen = measure_prompts(store, max_turns=2)
    assert seen.user_chars == 2 + 3 + 4 + 10 and seen.user_chars_per_prompt == 9.5  # the first 2 user turns
