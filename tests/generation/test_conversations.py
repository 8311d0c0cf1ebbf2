"""One prompt's conversation against the SGLang-shaped loopback on 127.0.0.1: turns regenerated in order with the
regenerated history, the row in the completions shape, a failed request leaving the conversation where it was, and
agentic rows that cannot be generated named with their reason."""

from __future__ import annotations

import asyncio

import pytest

from dflash_assets.generation.conversations import AgenticConversation, Conversation, agentic_task
from dflash_assets.generation.engines import EngineError, GenerationConfig, OpenAIEngine
from tests.support.sglang_loopback import LoopbackServer

GEN = GenerationConfig(max_new_tokens=8)


def _run_to_end(conversation: Conversation, url: str) -> list:
    async def go():
        async with OpenAIEngine(url) as engine:
            await engine.probe()
            steps = []
            while True:
                done, result = await conversation.step(engine)
                steps.append(result)
                if done:
                    return steps

    return asyncio.run(go())


def test_turns_are_regenerated_in_order_and_the_row_has_the_completions_shape():
    gen = GEN.model_copy(update={"stop_after_truncated_turn": False})  # a turn cut at max_new_tokens goes on
    conversation = Conversation("p1", "Be brief.", ["Hi", "And then?"], gen, "h1")
    with LoopbackServer() as srv:
        steps = _run_to_end(conversation, srv.url)
    row = conversation.row()
    assert len(steps) == 2 and row["num_turns"] == 2 and row["config_hash"] == "h1" and row["attempts"] == 2
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in row["messages"][2::2]] == [s.content for s in steps]
    # the second request carried the first answer (assistant contents only)
    assert conversation.history[-2] == {"role": "user", "content": "And then?"}
    assert conversation.history[2] == {"role": "assistant", "content": steps[0].content}
    assert row["completion_tokens_total"] == sum(s.completion_tokens for s in steps)


def test_a_failed_request_leaves_the_conversation_where_it_was():
    conversation = Conversation("p1", None, ["Hi"], GEN, "h1")
    with LoopbackServer(fail_every=1, fail_status=503) as srv:
        with pytest.raises(EngineError):
            _run_to_end(conversation, srv.url)
    assert conversation.results == [] and conversation.messages == [] and conversation.attempts == 1


def test_a_turn_cut_at_max_new_tokens_ends_the_conversation_by_default():
    conversation = Conversation("p1", None, ["Hi", "And then?"], GEN, "h1")
    with LoopbackServer() as srv:
        steps = _run_to_end(conversation, srv.url)
    assert [s.finish_reason for s in steps] == ["length"] and conversation.row()["finish_reasons"] == ["length"]


@pytest.mark.parametrize("row,reason", [
    ({"agentic_turns": "not json"}, "not JSON"),
    ({"agentic_turns": '[{"role": "assistant", "content": "x"}]'}, "do not start with a user turn"),
    ({"agentic_turns": "[]"}, "do not start with a user turn"),
])
def test_agentic_rows_that_cannot_be_generated_say_why(row, reason):
    assert reason in agentic_task("p1", row, GEN, "h1")


def test_an_agentic_row_becomes_an_agentic_conversation():
    task = agentic_task("p1", {"agentic_turns": '[{"role": "user", "content": "Weather?"}]', "tools": "[]"}, GEN, "h1")
    assert isinstance(task, AgenticConversation) and task.prompt_id == "p1"
