"""The OpenAI-compatible engine against `transformers serve` with the tiny target and the SGLang-shaped loopback:
the reasoning split decided once at probe time, tool calls kept, ignore_eos."""

from __future__ import annotations

import pytest

from dflash_assets.generation.chat_tokenizer import ChatTokenizer
from dflash_assets.generation.engines import GenerationConfig, OpenAIEngine, normalize_model_id
from dflash_assets.generation.server import local_engine_server
from tests.support.sglang_loopback import LoopbackServer
from tests.generation.engines.support import (
    MESSAGES,
    run,
    TARGET,
    CALL_BLOCK,
    WEATHER_TOOL,
    _sglang_chat_reply,
    _http,
)


def test_openai_engine_splits_think_when_server_has_no_reasoning_parser():
    with LoopbackServer(reasoning_parser=None) as raw, LoopbackServer() as parsed:

        async def go():
            out = []
            for url in (raw.url, parsed.url):
                async with OpenAIEngine(url) as eng:
                    probe = await eng.probe()
                    out.append((probe, await eng.chat(MESSAGES, GenerationConfig(max_new_tokens=64))))
            return out

        (p_raw, r_raw), (p_parsed, r_parsed) = run(go())
        body = parsed.stats.last_body
    assert p_raw.dialect == "openai" and body["chat_template_kwargs"] == {"enable_thinking": True}
    assert body["top_k"] == 20 and body["max_tokens"] == 64 and body["model"] == p_parsed.served_model
    assert "</think>" not in r_raw.content and r_raw.reasoning_content
    assert (r_raw.reasoning_content, r_raw.content) == (r_parsed.reasoning_content, r_parsed.content)


# -- real servers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def transformers_serve(tiny_dense_target, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    server = local_engine_server("transformers", tiny_dense_target, port=0, log_path=log)
    with server.start(wait_s=300):
        yield server


@pytest.mark.slow
def test_openai_engine_against_transformers_serve(transformers_serve, tiny_dense_target, tok):
    gen = GenerationConfig(max_new_tokens=8, enable_thinking=True)

    async def go():
        async with OpenAIEngine(transformers_serve.url) as eng:
            probe = await eng.probe()
            res = await eng.chat(MESSAGES, gen)
            return probe, res, eng

    probe, res, eng = run(go())
    assert probe.healthy and probe.dialect == "transformers_serve"
    assert normalize_model_id(probe.served_model) == normalize_model_id(str(tiny_dense_target))
    assert eng.extra_sampling_params is False  # top_k would be a 422 there
    assert res.finish_reason in ("length", "stop") and 1 <= res.completion_tokens <= 8
    assert res.prompt_tokens == len(ChatTokenizer(tok).prompt_ids(MESSAGES, True))
    # random weights: garbage, but the thinking prompt puts it in the reasoning unless </think> appeared
    assert isinstance(res.content, str) and isinstance(res.reasoning_content, str)
    assert res.reasoning_content or res.content


@pytest.mark.slow
def test_ignore_eos_reaches_transformers_serve(transformers_serve):
    """The plan's burst asks for exactly max_new_tokens; `transformers serve` has no ignore_eos field, so the
    client asks for min_new_tokens in the request's generation config."""
    gen = GenerationConfig(max_new_tokens=48, temperature=0.0)

    async def go():
        async with OpenAIEngine(transformers_serve.url) as eng:
            await eng.probe()
            return await eng.chat(MESSAGES, gen), await eng.chat(MESSAGES, gen, ignore_eos=True)

    free, forced = run(go())
    assert free.completion_tokens < 48  # the trained tiny target ends its turn on its own ...
    assert forced.completion_tokens == 48 and forced.finish_reason == "length"  # ... unless told not to


@pytest.mark.parametrize("reply,server_splits,expected", [
    # empty think block, server with --reasoning-parser: null reasoning, the answer stays the answer
    (_sglang_chat_reply("\n\nParis.", None), True, ("", "Paris.")),
    (_sglang_chat_reply("Paris.", None), True, ("", "Paris.")),
    # a tool call opened without </think> (SGLang's Qwen3 detector ends the reasoning at <tool_call>)
    (_sglang_chat_reply(CALL_BLOCK, None), True, ("", CALL_BLOCK)),
    (_sglang_chat_reply("", None, [{"id": "c0", "type": "function", "index": 0, "function": {
        "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}], "tool_calls"), True, ("", "")),
    (_sglang_chat_reply("\n\nParis.", "Think.\n"), True, ("Think.", "Paris.")),
    # a server without a parser: the raw text, split here
    (_sglang_chat_reply("Think.\n</think>\n\nParis.", None), False, ("Think.", "Paris.")),
])
def test_openai_reply_with_null_reasoning_keeps_answer_and_calls_where_they_are(reply, server_splits, expected):
    eng = OpenAIEngine("http://127.0.0.1:1")
    eng.splits_reasoning = server_splits
    res = eng._parse_chat(reply, GenerationConfig(), 0.1)
    assert (res.reasoning_content, res.content) == expected
    assert res.tool_calls == reply["choices"][0]["message"]["tool_calls"]


def test_openai_probe_learns_the_reasoning_parser_once_and_empty_reasoning_stays_empty():
    # reasoning_tokens (0, 0): the target emits `</think>` first, SGLang answers reasoning_content null
    with LoopbackServer(model_path=TARGET, reasoning_tokens=(0, 0)) as parsed, \
            LoopbackServer(model_path=TARGET, reasoning_tokens=(0, 0), reasoning_parser=None) as raw:
        status, wire = _http(parsed.url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 64})
        assert status == 200 and wire["choices"][0]["message"]["reasoning_content"] is None
        answer = wire["choices"][0]["message"]["content"]

        async def go(url):
            async with OpenAIEngine(url) as eng:
                probe = await eng.probe()
                return probe, eng.splits_reasoning, await eng.chat(MESSAGES, GenerationConfig(max_new_tokens=64))

        (probe, splits, res), (raw_probe, raw_splits, raw_res) = run(go(parsed.url)), run(go(raw.url))
    assert probe.facts.reasoning_parser == "qwen3" and splits is True
    assert raw_probe.facts.reasoning_parser == "" and raw_splits is False
    assert answer and "</think>" not in answer
    assert (res.reasoning_content, res.content) == ("", answer)  # not moved into the reasoning
    assert (raw_res.reasoning_content, raw_res.content) == ("", answer)  # split here, the same turn


@pytest.mark.parametrize("tool_parser", [True, False], ids=["tool-call-parser", "no-tool-call-parser"])
def test_openai_tool_call_without_think_end_is_kept(tool_parser):
    with LoopbackServer(model_path=TARGET, reasoning_tokens=(0, 0), tool_call_without_think_end=True,
                        tool_call_parser=tool_parser, tool_rules=(("weather", "get_weather", {"city": "Paris"}),)) as srv:

        async def go():
            async with OpenAIEngine(srv.url) as eng:
                await eng.probe()
                return await eng.chat([{"role": "user", "content": "weather in Paris?"}], GenerationConfig(),
                                      tools=[WEATHER_TOOL])

        res = run(go())
    assert res.reasoning_content == ""
    if tool_parser:
        assert res.finish_reason == "tool_calls" and res.tool_calls[0]["function"]["name"] == "get_weather"
    else:
        assert res.tool_calls is None and res.content == CALL_BLOCK
