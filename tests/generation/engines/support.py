"""Helpers the engine tests share: a chat, the loopback's expected answer, an engine of either HTTP kind, SGLang
0.5.23-shaped replies and one raw HTTP request."""

from __future__ import annotations

import asyncio

from dflash_assets.generation.chat_tokenizer import ChatTokenizer
from dflash_assets.generation.engines import GenerationConfig, OpenAIEngine, SGLangEngine
from tests.support.sglang_loopback import QWEN3_6_IDS, LoopbackServer, _Generator, _prompt_key

THINK_END, IM_END = QWEN3_6_IDS["think_end"], QWEN3_6_IDS["im_end"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def run(coro):
    return asyncio.run(coro)


def _expected(tok, prompt_ids, max_new, seed=None):
    """What the loopback generates for prompt_ids: the same deterministic function, decoded."""
    out, finish = _Generator(LoopbackServer().cfg).generate(_prompt_key(prompt_ids, None, seed),
                                                           {"max_new_tokens": max_new})
    return ChatTokenizer(tok).split_output_ids(out, True), finish["type"], len(out)


def _engine(kind: str, url: str, tok, **kwargs):
    return SGLangEngine(url, tok, **kwargs) if kind == "sglang" else OpenAIEngine(url, **kwargs)


async def _probe_then_chat(eng, gen=GenerationConfig(max_new_tokens=16)):
    async with eng:
        probe = await eng.probe()
        return probe, await eng.chat(MESSAGES, gen)


# -- true to SGLang 0.5.23 --------------------------------------------------------------------
# Replies below are built as SGLang 0.5.23 builds them (srt/entrypoints/openai/serving_chat.py: `content=text if
# text else ""`, `reasoning_content=reasoning_text if reasoning_text else None`), and the loopback answers so.

TARGET = "/models/Qwen3.6-27B"
CALL_BLOCK = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}},
                                                                "required": ["city"]}}}


def _sglang_chat_reply(content: str, reasoning: str | None, tool_calls=None, finish="stop") -> dict:
    return {"id": "r1", "object": "chat.completion", "created": 0, "model": TARGET,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content or "",
                                                 "reasoning_content": reasoning or None, "tool_calls": tool_calls},
                         "finish_reason": finish, "matched_stop": None}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}}


def _http(url: str, path: str, payload: dict | None = None, headers: dict | None = None) -> tuple[int, dict | str]:
    """One raw request (urllib): (status, JSON body or text)."""
    import json
    import urllib.error
    import urllib.request

    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, body = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    try:
        return status, json.loads(body) if body else ""
    except ValueError:
        return status, body.decode()
