"""The in-process engine's prompt encoder: one pass's texts encoded together, the same ids as one by one, a failing
text failing only its own request."""

from __future__ import annotations

import asyncio

import pytest

from dflash_assets.generation.chat_tokenizer import ChatTokenizer
from dflash_assets.generation.engines.prompt_encoder import PromptEncoder
from tests.generation.engines.support import run

TEXTS = ["What is 2+2?", "Nenne eine Farbe.", "写一首关于秋天的短诗。", "def f(x):\n    return x * 2\n" * 40, "Hi"]


def test_one_pass_is_encoded_together_with_the_ids_of_one_by_one(tok):
    chat = ChatTokenizer(tok)
    encoder = PromptEncoder(chat.encode, chat.encode_many, batch_chars=256)

    async def go():
        together = await asyncio.gather(*(encoder.encode(t) for t in TEXTS))
        lone = await encoder.encode(TEXTS[0])  # a pass of its own, below batch_chars
        return together, lone

    together, lone = run(go())
    assert together == [chat.encode(t) for t in TEXTS] and lone == chat.encode(TEXTS[0])
    assert encoder.batches == {"together": 1, "one_by_one": 1}
    assert len(together[3]) > 100 and together[2] != together[1]


def test_a_pass_below_batch_chars_is_encoded_one_by_one(tok):
    chat = ChatTokenizer(tok)
    encoder = PromptEncoder(chat.encode, chat.encode_many, batch_chars=10**6)

    async def go():
        return await asyncio.gather(*(encoder.encode(t) for t in TEXTS))

    assert run(go()) == [chat.encode(t) for t in TEXTS]
    assert encoder.batches == {"together": 0, "one_by_one": 1}


def test_a_text_that_fails_to_encode_fails_only_its_request(tok):
    chat = ChatTokenizer(tok)
    bad = "\udcff unpaired surrogate"  # not valid UTF-8: the Rust tokenizer refuses it

    with pytest.raises(Exception):
        chat.encode(bad)
    encoder = PromptEncoder(chat.encode, chat.encode_many, batch_chars=1)

    async def go():
        return await asyncio.gather(*(encoder.encode(t) for t in [TEXTS[0], bad, TEXTS[1]]), return_exceptions=True)

    first, failed, last = run(go())
    assert first == chat.encode(TEXTS[0]) and last == chat.encode(TEXTS[1])
    assert isinstance(failed, Exception)
    assert encoder.batches == {"together": 0, "one_by_one": 1}  # the batch failed as a whole, then text by text


def test_a_cancelled_request_leaves_the_others_of_its_pass(tok):
    chat = ChatTokenizer(tok)
    encoder = PromptEncoder(chat.encode, chat.encode_many, batch_chars=1)

    async def go():
        tasks = [asyncio.ensure_future(encoder.encode(t)) for t in TEXTS]
        await asyncio.sleep(0)  # every task is waiting on the encoder
        tasks[1].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    out = run(go())
    assert isinstance(out[1], asyncio.CancelledError)
    assert [o for k, o in enumerate(out) if k != 1] == [chat.encode(t) for k, t in enumerate(TEXTS) if k != 1]


def test_an_encoder_serves_one_event_loop_after_another(tok):
    """The engine outlives an asyncio.run: a loop stopped with a text still pending leaves nothing that blocks
    the next loop's requests."""
    chat = ChatTokenizer(tok)
    encoder = PromptEncoder(chat.encode, chat.encode_many, batch_chars=1)
    stopped = asyncio.new_event_loop()
    try:
        stopped.create_task(encoder.encode(TEXTS[0]))
        stopped.call_soon(stopped.stop)  # queued before the encoder's flush: the text stays pending
        stopped.run_forever()
        assert len(encoder._pending) == 1
    finally:
        stopped.close()

    async def go():
        return await asyncio.wait_for(asyncio.gather(*(encoder.encode(t) for t in TEXTS[:2])), timeout=10)

    assert run(go()) == [chat.encode(t) for t in TEXTS[:2]]
