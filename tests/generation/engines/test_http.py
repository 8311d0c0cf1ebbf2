"""The HTTP engines' shared transport and probe against loopback servers on 127.0.0.1: errors classified, a broken
or hostile server guarded against, identity from whichever route answers, health waited on."""

from __future__ import annotations

import pytest

from dflash_assets.generation.engines import EngineError, GenerationConfig, SGLangEngine
from tests.generation.engines.support import MESSAGES, run, _engine, _probe_then_chat, TARGET, _http
from tests.ports import free_port
from tests.support.sglang_loopback import LoopbackServer


@pytest.mark.parametrize("status,retryable", [(503, True), (429, True), (400, False)])
def test_http_errors_are_classified(tok, status, retryable):
    with LoopbackServer(fail_every=1, fail_status=status) as srv:

        async def go():
            async with SGLangEngine(srv.url, tok) as eng:
                await eng.chat(MESSAGES, GenerationConfig(max_new_tokens=4))

        with pytest.raises(EngineError) as info:
            run(go())
    assert info.value.status == status and info.value.retryable is retryable and not info.value.connection


def test_connection_refused_is_a_connection_error(tok):
    port = free_port()  # a port nobody listens on

    async def go():
        async with SGLangEngine(f"http://127.0.0.1:{port}", tok, connect_timeout_s=2) as eng:
            probe = await eng.probe()
            assert not probe.healthy and "Cannot connect" in probe.error
            await eng.chat(MESSAGES, GenerationConfig(max_new_tokens=4))

    with pytest.raises(EngineError) as info:
        run(go())
    assert info.value.connection and info.value.retryable


@pytest.mark.parametrize("kind", ["sglang", "openai"])
def test_reply_of_the_wrong_shape_is_a_retryable_error_naming_the_endpoint(tok, kind):
    with LoopbackServer(model_path="/models/Qwen3.6-27B", bad_shape_every=1) as srv:
        with pytest.raises(EngineError) as info:
            run(_probe_then_chat(_engine(kind, srv.url, tok)))
    err = info.value
    assert err.retryable and not err.connection and err.endpoint == srv.url
    assert srv.url in str(err) and "unexpected reply shape" in str(err)


@pytest.mark.parametrize("kind", ["sglang", "openai"])
def test_redirect_is_not_followed(tok, kind):
    """A 307 must not re-send the prompt to another host: the request fails, naming the redirect."""
    with LoopbackServer(model_path="/models/Qwen3.6-27B") as elsewhere, \
            LoopbackServer(model_path="/models/Qwen3.6-27B", redirect_to=elsewhere.url) as srv:
        with pytest.raises(EngineError) as info:
            run(_probe_then_chat(_engine(kind, srv.url, tok)))
        assert srv.stats.redirected == 1
        assert elsewhere.stats.generate_requests == 0 and elsewhere.stats.chat_requests == 0  # the prompt stayed
    assert info.value.status == 307 and "redirect" in str(info.value) and not info.value.retryable


@pytest.mark.parametrize("kind", ["sglang", "openai"])
def test_hung_server_is_cut_off_by_the_read_timeout(tok, kind):
    import time

    with LoopbackServer(model_path="/models/Qwen3.6-27B", delay_s=5) as srv:
        t0 = time.perf_counter()
        with pytest.raises(EngineError) as info:
            run(_probe_then_chat(_engine(kind, srv.url, tok, request_timeout_s=60, read_timeout_s=0.5,
                                         read_timeout_per_token_s=0.0)))
        elapsed = time.perf_counter() - t0
    assert elapsed < 3.5, elapsed  # not the 60 s total limit, nor the server's 5 s
    assert info.value.connection and "read timeout" in str(info.value)


def test_read_timeout_grows_with_the_requested_tokens(tok):
    eng = SGLangEngine("http://127.0.0.1:1", tok, read_timeout_s=300, read_timeout_per_token_s=0.1)
    assert eng.read_timeout_for(2048) == pytest.approx(504.8)
    assert SGLangEngine("http://127.0.0.1:1", tok, read_timeout_s=None).read_timeout_for(2048) is None


@pytest.mark.parametrize("kind", ["sglang", "openai"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_reply_body_size_is_capped(tok, kind, chunked):
    with LoopbackServer(model_path="/models/Qwen3.6-27B", pad_reply_bytes=300_000, chunked=chunked) as srv:
        with pytest.raises(EngineError, match="max_response_bytes") as info:
            run(_probe_then_chat(_engine(kind, srv.url, tok, max_response_bytes=100_000)))
        probe, res = run(_probe_then_chat(_engine(kind, srv.url, tok)))  # the default cap (64 MiB) lets it through
    assert srv.url in str(info.value) and res.completion_tokens > 0
    assert ("cut off" in str(info.value)) is chunked  # no declared length: counted as it arrives


@pytest.mark.parametrize("kind", ["sglang", "openai"])
def test_reply_naming_another_model_is_refused(tok, kind):
    with LoopbackServer(model_path="/models/Qwen3.6-27B", reply_model="/models/Llama-3-8B") as srv:
        with pytest.raises(EngineError, match="Llama-3-8B") as info:
            run(_probe_then_chat(_engine(kind, srv.url, tok)))
    assert info.value.retryable and srv.url in str(info.value)
    # the same model under another spelling of its id is fine
    with LoopbackServer(model_path="/models/Qwen3.6-27B", reply_model="Qwen/Qwen3.6-27B") as srv:
        _, res = run(_probe_then_chat(_engine(kind, srv.url, tok)))
    assert res.completion_tokens > 0


@pytest.mark.parametrize("kind", ["sglang", "openai"])
def test_plain_text_health_answer_is_healthy(tok, kind):
    with LoopbackServer(model_path="/models/Qwen3.6-27B", health_body="ok") as srv:
        probe, res = run(_probe_then_chat(_engine(kind, srv.url, tok)))
    assert probe.healthy and probe.error is None and res.completion_tokens > 0


@pytest.mark.parametrize("kind", ["sglang", "openai"])
def test_api_key_is_sent_as_bearer_and_kept_out_of_reprs_and_errors(tok, kind):
    key = "sk-loopback-0123456789abcdef"
    with LoopbackServer(model_path="/models/Qwen3.6-27B", api_key=key) as srv:
        probe, res = run(_probe_then_chat(_engine(kind, srv.url, tok, api_key=key)))
        assert probe.healthy and res.completion_tokens > 0 and srv.stats.unauthorized == 0
        wrong = _engine(kind, srv.url, tok, api_key="sk-wrong")
        with pytest.raises(EngineError) as info:
            run(_probe_then_chat(wrong))
        assert srv.stats.unauthorized >= 1
    assert key not in repr(_engine(kind, srv.url, tok, api_key=key)) and "sk-wrong" not in repr(wrong)
    assert "sk-wrong" not in str(info.value) and info.value.status == 401 and not info.value.retryable


@pytest.mark.parametrize("missing", [(), ("/model_info",), ("/model_info", "/get_model_info"),
                                     ("/model_info", "/get_model_info", "/server_info", "/get_server_info"),
                                     ("/v1/models",)])
@pytest.mark.parametrize("kind", ["sglang", "openai"])
def test_probe_identifies_the_model_whatever_route_is_missing(tok, kind, missing):
    with LoopbackServer(model_path=TARGET, served_model_name="qwen3.6-27b", missing_routes=missing) as srv:
        probe, res = run(_probe_then_chat(_engine(kind, srv.url, tok)))
        info_calls = srv.stats.model_info_requests
    assert probe.healthy and probe.error is None and res.completion_tokens > 0
    assert "qwen3.6-27b" in probe.served_models
    assert probe.facts.routes_missing == missing
    assert info_calls == (0 if "/get_model_info" in missing else 1)  # one identity call, the first route there
    assert probe.facts.context_length == (None if "/v1/models" in missing else 32768)


def test_health_is_waited_on_while_503_and_never_needs_the_key(tok):
    import time

    key = "sk-loopback-health"
    with LoopbackServer(model_path=TARGET, api_key=key, health_503_s=1.5) as srv:
        assert _http(srv.url, "/health")[0] == 503  # starting
        assert _http(srv.url, "/model_info") == (401, {"error": "Unauthorized"})
        t0 = time.perf_counter()
        probe, res = run(_probe_then_chat(SGLangEngine(srv.url, tok, api_key=key, health_wait_s=20)))
        waited = time.perf_counter() - t0
        assert srv.stats.health_requests >= 2 and srv.stats.unauthorized == 1  # only the raw call above
    assert probe.healthy and waited >= 1.0 and res.completion_tokens > 0


def test_health_that_stays_503_is_unhealthy_not_unreachable_and_the_router_is_asked_for_readiness(tok):
    from dflash_assets.generation.fleet import EndpointConfig, EngineFleetConfig, probe_fleet

    with LoopbackServer(model_path=TARGET, health_503_s=60) as starting, \
            LoopbackServer(model_path=TARGET, health_503_s=60, router=True) as router, \
            LoopbackServer(model_path=TARGET, router=True, router_workers_healthy=False) as empty_router:
        assert _http(empty_router.url, "/health") == (200, "OK")  # liveness, whatever the workers do
        cfg = EngineFleetConfig(target_model=TARGET, health_wait_s=0.5, endpoints=[
            EndpointConfig(url=starting.url), EndpointConfig(url=router.url), EndpointConfig(url=empty_router.url)])
        rows = {r.endpoint: r for r in probe_fleet(cfg, tok).rows}
    assert rows[starting.url].status == "unhealthy" and "503" in rows[starting.url].detail
    assert rows[starting.url].served_model == TARGET  # identified all the same
    assert rows[router.url].status == "ok"  # its /health says nothing about its workers; /readiness does
    assert rows[empty_router.url].status == "unhealthy" and "no healthy worker" in rows[empty_router.url].detail


def test_the_engines_import_and_speak_json_without_orjson():
    """A GPU image may lack orjson: the engines package (the in-process engine imports it) still imports, and
    its JSON helpers fall back to the standard library with the same bytes for plain data."""
    import subprocess
    import sys

    code = (
        "import sys, json\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'orjson': raise ImportError('no orjson here')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from dflash_assets.generation.engines import TransformersEngine, json_dumps, json_loads\n"
        "from dflash_assets.generation.engines import http\n"
        "assert http.orjson is None\n"
        "obj = {'messages': [{'role': 'user', 'content': 'h\\u00e9 \\u4f60'}], 'max_tokens': 3}\n"
        "print(json_dumps(obj).decode()); assert json_loads(json_dumps(obj)) == obj\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import orjson

    assert out.stdout.strip().encode() == orjson.dumps(
        {"messages": [{"role": "user", "content": "h\u00e9 \u4f60"}], "max_tokens": 3})
