"""The in-process engine's batching: static-cache shapes (row and width buckets), batches of bucket rows, rows
apart from the requests in flight, and the static cache's answers equal to the dynamic one's."""

from __future__ import annotations

import asyncio

import pytest

from dflash_assets.generation.engines import GenerationConfig, TransformersEngine
from tests.generation.engines.support import run


def test_static_batch_shapes_are_few_and_hold_the_batch():
    from dflash_assets.generation.engines import STATIC_WIDTH_BUCKETS, static_batch_shape, static_row_cap

    shapes = {static_batch_shape(n, w, 1024) for n in range(1, 1025) for w in range(1, 2049, 7)}
    assert {r for r, _ in shapes} == {64, 128, 256, 512, 1024}  # 1,024 row counts -> 5 row buckets
    assert {w for _, w in shapes} == {256, 512, 1024, 2048} == set(STATIC_WIDTH_BUCKETS)  # powers of two
    for n, w in [(1, 1), (17, 300), (1000, 256), (1024, 257)]:
        rows, width = static_batch_shape(n, w, 1024)
        assert rows >= n and width >= w
    assert static_batch_shape(100, 10, 96) == (100, 256)  # a batch over max_rows (never formed) is not cut
    assert static_batch_shape(70, 10, 96) == (70, 256)  # 96 rows is no bucket: the cap is the bucket under it, 64
    assert static_batch_shape(40, 10, 96) == (64, 256)
    assert static_batch_shape(3, 10, 8) == (8, 256)  # under the smallest bucket: the cap itself
    # the token cap: 2,048-token prompts fit 256 rows in 524,288 padded tokens
    assert static_row_cap(2048, 1024, 524288) == 256 and static_row_cap(512, 1024, 524288) == 1024
    assert static_row_cap(1024, 1024, 600000) == 512  # 585 rows fit: the bucket under it
    assert static_batch_shape(200, 700, 1024, 524288) == (256, 1024)
    assert static_batch_shape(300, 700, 1024, 524288) == (512, 1024)
    assert static_batch_shape(600, 500, 1024, 524288) == (1024, 512)  # 1,024 x 512 is within it
    # under a token cap every shape a formed batch (rows <= the cap) can take is a bucket pair
    formed = {static_batch_shape(n, w, 1024, 524288) for w in range(1, 2049, 7) for n in range(1, 1025)
              if n <= static_row_cap(static_batch_shape(1, w, 1024)[1], 1024, 524288)}
    assert len(formed) <= 20 and all(r in (64, 128, 256, 512, 1024) for r, _ in formed)


def test_static_engine_forms_batches_of_bucket_rows(tiny_dense_target, tok):
    """The batcher stops a static-cache batch at the row bucket its padded width allows, so 5 waiting requests
    under a 4-row token cap run as 4 + 1 (each padded to 4 rows), not as one batch of 5."""
    gen = GenerationConfig(max_new_tokens=2, temperature=0.0, enable_thinking=False)

    async def go():
        async with TransformersEngine(tiny_dense_target, tokenizer=tok, max_concurrency=6, max_batch_tokens=4 * 256,
                                      cache="static") as eng:
            await asyncio.gather(*(eng.chat([{"role": "user", "content": f"Count to {i}."}], gen) for i in range(5)))
            return eng.batch_sizes, eng.batch_shapes

    sizes, shapes = run(go())
    assert sizes == [4, 1] and shapes == [(4, 256), (4, 256)]


def test_batch_rows_apart_from_requests_in_flight(tiny_dense_target, tok):
    """`max_batch_rows` below `max_concurrency`: 5 requests in flight run as generate calls of at most 2 rows."""
    gen = GenerationConfig(max_new_tokens=2, temperature=0.0, enable_thinking=False)

    async def go(**kwargs):
        async with TransformersEngine(tiny_dense_target, tokenizer=tok, max_concurrency=8, **kwargs) as eng:
            out = await asyncio.gather(*(eng.chat([{"role": "user", "content": f"Count to {i}."}], gen)
                                         for i in range(5)))
            return eng.batch_sizes, [r.content for r in out]

    (rows_2, answers_2), (rows_8, answers_8) = run(go(max_batch_rows=2)), run(go())
    assert max(rows_2) == 2 and sum(rows_2) == 5 and rows_8 == [5]
    assert answers_2 == answers_8
    from dflash_assets.generation.fleet import EndpointConfig, EngineFleetConfig, build_engine

    ep = EndpointConfig(url="inprocess://t", kind="transformers", max_concurrency=64, max_batch_rows=16)
    engine = build_engine(ep, EngineFleetConfig(target_model=str(tiny_dense_target), endpoints=[ep]), tok)
    assert (engine.max_concurrency, engine.max_batch_rows) == (64, 16)


def test_static_cache_engine_answers_as_the_dynamic_one(tiny_dense_target, tok):
    """The static-cache path (padded rows and width) gives each request the dynamic cache's greedy answer."""
    gen = GenerationConfig(max_new_tokens=10, temperature=0.0, enable_thinking=False)
    chats = [[{"role": "user", "content": q}] for q in ("What is 2+2?", "Name a colour.", "Write a long sentence.")]

    async def go(cache):
        async with TransformersEngine(tiny_dense_target, tokenizer=tok, max_concurrency=8, cache=cache) as eng:
            out = await asyncio.gather(*(eng.chat(m, gen) for m in chats))
            return out, eng.batch_shapes

    (static, shapes), (dynamic, dyn_shapes) = run(go("static")), run(go("dynamic"))
    assert shapes == [(8, 256)] and dyn_shapes[0][0] == 3  # 3 rows padded to the 8-row cap, width to 256
    assert [(r.content, r.completion_tokens, r.finish_reason) for r in static] == \
        [(r.content, r.completion_tokens, r.finish_reason) for r in dynamic]
    long_chat = [{"role": "user", "content": "word " * 3000}]  # over STATIC_MAX_WIDTH: the dynamic cache decodes it

    async def long(cache):
        async with TransformersEngine(tiny_dense_target, tokenizer=tok, max_concurrency=8, cache=cache) as eng:
            return await eng.chat(long_chat, gen), eng.batch_shapes

    (long_static, long_shapes), (long_dynamic, _) = run(long("static")), run(long("dynamic"))
    assert long_shapes[0][0] == 1 and long_shapes[0][1] > 2048  # not padded: one row, its own width
    assert long_static.content == long_dynamic.content
    with pytest.raises(ValueError, match="dynamic', 'static', 'continuous' or 'slots'"):
        TransformersEngine(tiny_dense_target, tokenizer=tok, cache="paged")
