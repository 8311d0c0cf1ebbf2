"""The in-process engine's continuous-batching cache mode: the dynamic cache's answers, one manager per model,
its thread stopped by the last engine to close (the slot cache mode: tests/generation/test_slot_decoding.py)."""

from __future__ import annotations

import asyncio

import pytest

from dflash_assets.generation.engines import EngineError, GenerationConfig, TransformersEngine
from tests.generation.engines.support import run


def test_continuous_engine_answers_as_the_dynamic_one_and_stops_its_thread(tiny_dense_target, tok):
    """cache="continuous" (transformers' continuous batching) gives each request the dynamic cache's greedy answer
    and finish reason, rows of different lengths in one running batch (max_new_tokens is per request); two engines of the model share one manager;
    the last one to close stops the manager's thread, so the process can exit."""

    from dflash_assets.generation.engines import inprocess_models

    gens = [GenerationConfig(max_new_tokens=n, temperature=0.0, enable_thinking=False) for n in (12, 3, 8, 5)]
    chats = [[{"role": "user", "content": q}] for q in
             ("What is 2+2?", "Name a colour.", "Write a long sentence about the sea and the sky.", "Hi")]

    async def go(cache):
        async with TransformersEngine(tiny_dense_target, tokenizer=tok, max_concurrency=4, cache=cache) as a, \
                TransformersEngine(tiny_dense_target, tokenizer=tok, max_concurrency=4, cache=cache) as b:
            out = await asyncio.gather(*(eng.chat(m, g) for eng, m, g in zip([a, b, a, b], chats, gens)))
            manager = a._loaded.continuous
            assert manager is b._loaded.continuous and (manager is None) == (cache != "continuous")
        return out, manager

    continuous, manager = run(go("continuous"))
    assert not manager.is_running()  # stopped at the last close: its thread would keep the process alive
    assert [m.continuous for m in inprocess_models._LOADED.values()] == [None]  # the model itself stays loaded
    dynamic, _ = run(go("dynamic"))
    assert [(r.content, r.completion_tokens, r.finish_reason) for r in continuous] == \
        [(r.content, r.completion_tokens, r.finish_reason) for r in dynamic]
    assert [r.completion_tokens for r in continuous] == [12, 3, 8, 5]  # each row's own length, in one manager

    sampled = GenerationConfig(max_new_tokens=4, temperature=0.7, min_p=0.1)

    async def refused():
        async with TransformersEngine(tiny_dense_target, tokenizer=tok, cache="continuous") as eng:
            await eng.chat(chats[0], sampled)

    with pytest.raises(EngineError, match="not min_p"):  # refused: transformers would drop it silently
        run(refused())


def test_prepared_slots_are_the_decoders_the_requests_use(tiny_dense_target, tok):
    """`prepare_slots` builds the slot decoders (and captures their graphs on CUDA) before any request, so a
    caller can time its requests without that one-time cost: the requests then decode in those same decoders,
    nothing is built again, and the answers are those of an engine that built them at its first request."""
    gen = GenerationConfig(max_new_tokens=6, temperature=0.0, enable_thinking=False)
    chats = [[{"role": "user", "content": q}] for q in ("What is 2+2?", "Name a colour.", "Hi")]

    async def go(prepare: bool):
        async with TransformersEngine(tiny_dense_target, tokenizer=tok, max_concurrency=4, cache="slots",
                                      slot_len=64, slot_tiers=[]) as eng:
            seconds = await eng.prepare_slots() if prepare else None
            built = list(eng._slots.decoders) if prepare else None
            out = await asyncio.gather(*(eng.chat(m, gen) for m in chats))
            again = await eng.prepare_slots()
            return out, seconds, built, list(eng._slots.decoders), len(eng._slot_runs), again

    out, seconds, built, used, builds, again = run(go(True))
    assert seconds > 0 and built and [id(d) for d in used] == [id(d) for d in built]
    assert builds == 1 and again == 0.0  # built once, before the first request
    plain, *_ = run(go(False))
    assert [(r.content, r.completion_tokens) for r in out] == [(r.content, r.completion_tokens) for r in plain]

    async def other_cache():
        async with TransformersEngine(tiny_dense_target, tokenizer=tok, cache="dynamic") as eng:
            return await eng.prepare_slots()

    assert run(other_cache()) == 0.0
