"""Agentic records: a conversation with a tool call and its result becomes a prompt whose agentic turns keep the
user turn, the recorded call and the result (assistant text dropped), with a content-hash id; a call whose result
never comes before the next user turn is rejected as missing_tool_result."""

from __future__ import annotations

import json

from dflash_assets.prompts.agentic import agentic_prompt_id, is_agentic, normalize_agentic_record
from dflash_assets.prompts.records import Prompt, Rejection

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def record(*tail):
    return {"tools": TOOLS, "messages": [{"role": "user", "content": "Weather in Paris?"},
                                         {"role": "assistant", "content": "Checking.", "tool_calls": [CALL]}, *tail]}


def test_a_call_and_its_result_are_kept_as_agentic_turns():
    rec = record({"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "user", "content": "Thanks"})
    assert is_agentic(rec, rec["messages"])
    prompt = normalize_agentic_record(rec)
    assert isinstance(prompt, Prompt) and json.loads(prompt.tools)[0]["function"]["name"] == "get_weather"
    turns = json.loads(prompt.agentic_turns)
    assert turns[0] == {"role": "user", "content": "Weather in Paris?"} and "Checking." not in prompt.agentic_turns
    assert "sunny" in prompt.agentic_turns and prompt.user_turns == ("Weather in Paris?", "Thanks")
    assert len(prompt.prompt_id) == 20 and prompt.prompt_id == normalize_agentic_record(rec).prompt_id
    assert agentic_prompt_id(None, "x") != agentic_prompt_id("s", "x")


def test_a_call_without_its_result_before_the_next_user_turn_is_rejected():
    rejected = normalize_agentic_record(record({"role": "user", "content": "Thanks"}))
    assert isinstance(rejected, Rejection) and rejected.reason == "missing_tool_result"
