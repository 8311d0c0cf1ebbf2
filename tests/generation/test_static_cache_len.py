"""``TransformersEngine(static_cache_len="per_call")``: each static-cache call gets a cache sized to itself.

Transformers sizes a new static cache to the largest call the model has run, and every decode step attends over the
whole cache. These tests run a wide prompt then a narrow one through the in-process engine (static cache, CPU, the
tiny dense target) and read the length transformers sized the narrow call's cache to, and check that the answers
are the same either way. Reads the tiny target and its tokenizer; writes nothing.
"""

from __future__ import annotations

import asyncio

import pytest

from dflash_assets.generation.engines import (STATIC_WIDTH_BUCKETS, GenerationConfig, TransformersEngine,
                                              release_idle_models)
from dflash_assets.generation.fleet import EndpointConfig, EngineFleetConfig, build_engine

NEW_TOKENS = 6


def run_wide_then_narrow(target, tok, static_cache_len: str) -> tuple[list[tuple], list[int], list[tuple[int, int]]]:
    """(answers, the cache length transformers sized after each call, each call's (rows, width))."""
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, temperature=0.0, enable_thinking=False)
    wide = [{"role": "user", "content": "Tell me about rivers. " * 60}]  # over the first width bucket
    narrow = [{"role": "user", "content": "Name a colour."}]

    async def go():
        async with TransformersEngine(target, tokenizer=tok, max_concurrency=4, cache="static",
                                      static_cache_len=static_cache_len) as eng:
            answers, lengths = [], []
            for chat in (wide, narrow):  # one at a time: two generate calls
                r = await eng.chat(chat, gen)
                answers.append((r.content, r.completion_tokens, r.finish_reason))
                lengths.append(eng.model._previous_max_cache_length)
            return answers, lengths, list(eng.batch_shapes)

    try:
        return asyncio.run(go())
    finally:
        release_idle_models()  # the next run loads the model afresh: no cache length carried over


def test_per_call_sizes_the_narrow_calls_cache_to_itself(tiny_dense_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dense_target))
    largest, largest_lengths, shapes = run_wide_then_narrow(tiny_dense_target, tok, "largest")
    per_call, per_call_lengths, per_call_shapes = run_wide_then_narrow(tiny_dense_target, tok, "per_call")
    (_, wide_width), (_, narrow_width) = shapes
    assert wide_width > narrow_width == STATIC_WIDTH_BUCKETS[0] and per_call_shapes == shapes
    # transformers' default keeps the wide call's length; per_call sizes the narrow call to its width + new tokens
    assert largest_lengths == [wide_width + NEW_TOKENS - 1] * 2
    assert per_call_lengths == [wide_width + NEW_TOKENS - 1, narrow_width + NEW_TOKENS - 1]
    assert per_call == largest  # padding is masked: the same tokens


def test_the_endpoint_setting_reaches_the_engine(tiny_dense_target):
    fleet = EngineFleetConfig(target_model=str(tiny_dense_target), endpoints=[EndpointConfig(
        url="inprocess://tiny", kind="transformers", cache="static", static_cache_len="per_call")])
    engine = build_engine(fleet.endpoints[0], fleet, tokenizer=None)
    assert isinstance(engine, TransformersEngine) and engine.static_cache_len == "per_call"
    assert EndpointConfig(url="inprocess://tiny", kind="transformers").static_cache_len == "largest"
    with pytest.raises(ValueError, match="'largest' or 'per_call'"):
        TransformersEngine(tiny_dense_target, static_cache_len="smallest")
