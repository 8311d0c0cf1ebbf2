"""The SGLang stand-in answers as SGLang 0.5.23 does where the engine tests rely on it: context overflow refused with
400 in each route's error body, tool schemas checked, the model echoed, tokens counted."""

from __future__ import annotations

import pytest

from dflash_assets.generation.chat_tokenizer import ChatTokenizer
from dflash_assets.generation.engines import EngineError, GenerationConfig
from tests.generation.engines.support import MESSAGES, run, _engine, TARGET, WEATHER_TOOL, _http
from tests.support.sglang_loopback import LoopbackServer


@pytest.fixture(scope="module")
def tok(tiny_dense_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dense_target))


@pytest.mark.parametrize("kind", ["sglang", "openai"])
def test_loopback_refuses_overflow_with_400_in_the_route_s_error_body(tok, kind):
    ids = ChatTokenizer(tok).prompt_ids(MESSAGES, True)
    with LoopbackServer(model_path=TARGET, context_length=150) as srv:
        if kind == "sglang":
            status, body = _http(srv.url, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 200}})
            assert status == 400 and "exceeds the model's maximum context length of 150" in body["error"]["message"]
        else:
            status, body = _http(srv.url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 200})
            assert status == 400 and body["object"] == "error" and body["code"] == 400
            assert "maximum context length of 150" in body["message"]
        # a client that does not know the context length (not probed) gets the 400: not retried

        async def unprobed():
            async with _engine(kind, srv.url, tok) as eng:
                return await eng.chat(MESSAGES, GenerationConfig(max_new_tokens=200))

        with pytest.raises(EngineError) as info:
            run(unprobed())
    assert info.value.status == 400 and not info.value.retryable and "context length" in str(info.value)


def test_loopback_chat_checks_tool_schemas_echoes_the_model_and_counts_tokens(tiny_dense_target):
    from tokenizers import Tokenizer

    from tests.support.sglang_loopback import _chatml

    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}
    with LoopbackServer(model_path=TARGET, tokenizer_json=str(tiny_dense_target / "tokenizer.json")) as srv:
        status, body = _http(srv.url, "/v1/chat/completions", {"messages": MESSAGES, "tools": [WEATHER_TOOL, bad]})
        assert status == 400 and body["object"] == "error" and body["type"] == "BadRequestError"
        assert body["message"].startswith("Tool 1 function has invalid 'parameters' schema")
        status, body = _http(srv.url, "/v1/chat/completions", {"messages": MESSAGES, "model": "any-name-at-all"})
        assert status == 200 and body["model"] == "any-name-at-all"  # echoed, never checked
        rendered = _chatml(MESSAGES, None, True)
        n_tokens = len(Tokenizer.from_file(str(tiny_dense_target / "tokenizer.json")).encode(
            rendered, add_special_tokens=False).ids)
        assert body["usage"]["prompt_tokens"] == n_tokens < len(rendered)  # tokens, not characters
        status, body = _http(srv.url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 40000}})
        assert status == 400 and set(body) == {"error"} and set(body["error"]) == {"message"}
