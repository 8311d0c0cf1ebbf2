"""The in-process engine with the tiny target: answers, and concurrent requests batched into one generate call."""

from __future__ import annotations

import asyncio

from dflash_assets.generation.chat_tokenizer import ChatTokenizer
from dflash_assets.generation.engines import GenerationConfig, TransformersEngine
from tests.generation.engines.support import MESSAGES, run


def test_transformers_engine_in_process(tiny_dense_target, tok):
    gen = GenerationConfig(max_new_tokens=5, temperature=0.0)

    async def go():
        async with TransformersEngine(tiny_dense_target, tokenizer=tok) as eng:
            probe = await eng.probe()
            return probe, await eng.chat(MESSAGES, gen), await eng.chat(MESSAGES, gen)

    probe, a, b = run(go())
    assert probe.healthy and probe.served_model == str(tiny_dense_target)
    assert a.prompt_tokens == len(ChatTokenizer(tok).prompt_ids(MESSAGES, True))
    assert 1 <= a.completion_tokens <= 5 and a.finish_reason in ("length", "stop")
    assert (a.content, a.reasoning_content) == (b.content, b.reasoning_content)  # greedy is deterministic


def test_transformers_engine_batches_concurrent_requests_with_the_same_answers(tiny_dense_target, tok):
    """Requests in flight together are one left-padded generate; each row equals its own greedy run."""
    gen = GenerationConfig(max_new_tokens=12, temperature=0.0, enable_thinking=False)
    questions = ["What is 2+2?", "Name a colour.", "Write one long sentence about the weather in Paris today.", "Hi"]
    chats = [[{"role": "user", "content": q}] for q in questions]

    async def go():
        async with TransformersEngine(tiny_dense_target, tokenizer=tok, max_concurrency=3) as eng:
            together = await asyncio.gather(*(eng.chat(m, gen) for m in chats))
            sizes = list(eng.batch_sizes)
            alone = [await eng.chat(m, gen) for m in chats]
            return together, alone, sizes

    together, alone, sizes = run(go())
    assert sizes == [3, 1]  # max_concurrency rows per generate, the rest in the next
    lengths = [len(ChatTokenizer(tok).prompt_ids(m, False)) for m in chats]
    long = lengths.index(max(lengths))

    async def budgeted():  # room for the first prompt and the one closest to it in length, nothing more
        budget = 2 * lengths[0]
        async with TransformersEngine(tiny_dense_target, tokenizer=tok, max_concurrency=4,
                                      max_batch_tokens=budget) as eng:
            out = await asyncio.gather(*(eng.chat(m, gen) for m in chats))
            return out, eng.batch_sizes

    out, sizes = run(budgeted())
    assert sorted(lengths) == [lengths[3], lengths[1], lengths[0], lengths[2]]  # Hi < colour < 2+2 < Paris
    assert sizes == [2, 1, 1]  # 2+2 with colour (padded to 2+2's length), then Paris and Hi alone
    assert [r.content for r in out] == [r.content for r in alone] and out[long].prompt_tokens == max(lengths)
    assert len({len(ChatTokenizer(tok).prompt_ids(m, False)) for m in chats}) > 1  # the batch really was padded
    for a, b in zip(together, alone):
        assert (a.content, a.completion_tokens, a.finish_reason) == (b.content, b.completion_tokens, b.finish_reason)
        assert a.prompt_tokens == b.prompt_tokens and 1 <= a.completion_tokens <= 12


def test_transformers_engine_encodes_the_prompts_of_one_pass_together(tiny_dense_target, tok):
    """A shard's requests arrive together: their prompts are encoded in one call, with the ids of one by one."""
    gen = GenerationConfig(max_new_tokens=2, temperature=0.0, enable_thinking=False)
    chats = [[{"role": "user", "content": f"Question {k}: " + "why is the sky blue? " * 40}] for k in range(24)]

    async def go():
        async with TransformersEngine(tiny_dense_target, tokenizer=tok, max_concurrency=24) as eng:
            out = await asyncio.gather(*(eng.chat(m, gen) for m in chats))
            return out, dict(eng.prompt_encoder.batches)

    out, batches = run(go())
    assert batches["together"] == 1
    assert [r.prompt_tokens for r in out] == [len(ChatTokenizer(tok).prompt_ids(m, False)) for m in chats]
