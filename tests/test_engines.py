"""Engine clients against real servers on 127.0.0.1: the SGLang-shaped loopback, `transformers serve`
with the tiny target, and the in-process Transformers engine."""

from __future__ import annotations

import asyncio

import pytest

from dflash_assets.generation.chat_tokenizer import ChatTokenizer, strip_stop_text
from dflash_assets.generation.engines import (
    EngineError,
    GenerationConfig,
    OpenAIEngine,
    SGLangEngine,
    TransformersEngine,
    normalize_model_id,
    split_reasoning_text,
)
from dflash_assets.generation.server import local_engine_server
from dflash_assets.testing.sglang_loopback import QWEN3_6_IDS, LoopbackServer, _Generator, _prompt_key

THINK_END, IM_END = QWEN3_6_IDS["think_end"], QWEN3_6_IDS["im_end"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def tok(tiny_dense_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dense_target))


def run(coro):
    return asyncio.run(coro)


# -- pure functions ------------------------------------------------------------


@pytest.mark.parametrize("text,thinking,expected", [
    ("step one\n</think>\n\nFour.", True, ("step one", "Four.")),
    ("<think>\nstep\n</think>\n\nFour.", True, ("step", "Four.")),
    ("still thinking, cut off", True, ("still thinking, cut off", "")),
    ("Four.", False, ("", "Four.")),
    ("\n</think>\n\nFour.", True, ("", "Four.")),
    ("", True, ("", "")),
])
def test_split_reasoning_text(text, thinking, expected):
    assert split_reasoning_text(text, thinking) == expected


@pytest.mark.parametrize("a,b", [
    ("/models/Qwen3.6-27B/", "Qwen/Qwen3.6-27B"),
    ("qwen3.6-27b@main", "Qwen3.6-27B"),
    ("Qwen3-8B", "/data/ckpt/qwen3-8b"),
])
def test_normalize_model_id_matches(a, b):
    assert normalize_model_id(a) == normalize_model_id(b)


def test_normalize_model_id_distinguishes():
    assert normalize_model_id("Qwen/Qwen3-8B") != normalize_model_id("Qwen/Qwen3.6-27B")


def test_config_hash_tracks_every_setting_and_target():
    g = GenerationConfig()
    assert g.config_hash("t") == GenerationConfig().config_hash("t")
    assert g.config_hash("t") != g.config_hash("other")
    assert g.config_hash("t") != GenerationConfig(temperature=0.7).config_hash("t")
    assert g.config_hash("t") != GenerationConfig(enable_thinking=False).config_hash("t")
    assert g.config_hash("/m/Qwen3-8B") == g.config_hash("Qwen/Qwen3-8B")  # normalized target id


def test_chat_tokenizer_renders_generation_prompt_and_splits_ids(tok):
    ct = ChatTokenizer(tok)
    ids = ct.prompt_ids(MESSAGES, enable_thinking=True)
    assert ids[-2:] == [QWEN3_6_IDS["think_start"], tok.encode("\n", add_special_tokens=False)[0]]
    no_think = ct.prompt_ids(MESSAGES, enable_thinking=False)
    assert tok.decode(no_think).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ct.think_end_id == THINK_END and IM_END in ct.stop_ids

    r = tok.encode("Let me add.\n", add_special_tokens=False)
    c = tok.encode("\n\nFour.", add_special_tokens=False)
    assert ct.split_output_ids(r + [THINK_END] + c + [IM_END], True) == ("Let me add.", "Four.")
    assert ct.split_output_ids(r, True) == ("Let me add.", "")  # cut inside the think block
    assert ct.split_output_ids(c + [IM_END], False) == ("", "Four.")


@pytest.mark.parametrize("output,thinking", [
    ("Let me add 2 and 2.\n</think>\n\nFour.<|im_end|>", True),  # thinking present
    ("<think>\nLet me add.\n</think>\n\nFour.<|im_end|>", True),  # the model repeats the opener
    ("<think>\n\n</think>\n\nFour.<|im_end|>", True),  # an empty think block
    ("<think>\n\n</think>\n\nFour.<|im_end|>", False),
    ("Four.<|im_end|>", False),  # no think tags
    ("Four.<|im_end|>", True),  # no think tags, thinking on: all reasoning
    ("Let me think about 2 and", True),  # cut by max_new_tokens inside the think block
    ("Let me think about 2 and", False),
    ("Call it.\n</think>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call><|im_end|>", True),
])
def test_chat_tokenizer_id_split_matches_the_text_split(tok, output, thinking):
    """`ChatTokenizer.split_output_ids` (on ids, SGLang's native and the in-process paths) and
    `target.chat_template.split_reasoning_text` (on text, the OpenAI path) split one output alike."""
    ids = tok.encode(output, add_special_tokens=False)
    assert (THINK_END in ids) == ("</think>" in output)  # the real tokenizer: `</think>` is one id
    text = strip_stop_text(tok.decode(ids, skip_special_tokens=False))
    assert ChatTokenizer(tok).split_output_ids(ids, thinking) == split_reasoning_text(text, thinking)


# -- SGLang native against the loopback -----------------------------------------


def _expected(tok, prompt_ids, max_new, seed=None):
    """What the loopback generates for prompt_ids: the same deterministic function, decoded."""
    out, finish = _Generator(LoopbackServer().cfg).generate(_prompt_key(prompt_ids, None, seed),
                                                           {"max_new_tokens": max_new})
    return ChatTokenizer(tok).split_output_ids(out, True), finish["type"], len(out)


def test_sglang_native_chat_probe_and_sampling_params(tok):
    gen = GenerationConfig(max_new_tokens=64, top_k=20, stop_token_ids=(7,))
    with LoopbackServer(model_path="/models/Qwen3.6-27B") as srv:

        async def go():
            async with SGLangEngine(srv.url, tok) as eng:
                probe = await eng.probe()
                res = await eng.chat(MESSAGES, gen)
                return probe, res

        probe, res = run(go())
        body = srv.stats.last_body
    assert probe.healthy and probe.served_models[0] == "/models/Qwen3.6-27B" and probe.latency_s > 0
    prompt_ids = ChatTokenizer(tok).prompt_ids(MESSAGES, True)
    assert body["input_ids"] == prompt_ids
    sp = body["sampling_params"]
    assert sp["max_new_tokens"] == 64 and sp["temperature"] == 0.6 and sp["top_p"] == 0.95 and sp["top_k"] == 20
    assert {IM_END, 7} <= set(sp["stop_token_ids"])
    (reasoning, content), finish, n = _expected(tok, prompt_ids, 64)
    assert (res.reasoning_content, res.content) == (reasoning, content)
    assert res.finish_reason == finish == "stop"
    assert res.prompt_tokens == len(prompt_ids) and res.completion_tokens == n
    assert res.served_model == "/models/Qwen3.6-27B" and res.endpoint == srv.url


def test_sglang_native_length_batch_and_text_only_agree(tok, tiny_dense_target):
    gen = GenerationConfig(max_new_tokens=3)
    convs = [MESSAGES, [{"role": "user", "content": "Another one"}]]
    with LoopbackServer() as ids_srv, LoopbackServer(output_ids=False,
                                                     tokenizer_json=str(tiny_dense_target / "tokenizer.json")) as txt:

        async def go():
            async with SGLangEngine(ids_srv.url, tok) as a, SGLangEngine(txt.url, tok) as b:
                await a.probe(), await b.probe()
                single = [await a.chat(m, gen) for m in convs]
                batch = await a.chat_batch(convs, gen)
                text = [await b.chat(m, GenerationConfig(max_new_tokens=64)) for m in convs]
                full = [await a.chat(m, GenerationConfig(max_new_tokens=64)) for m in convs]
                return single, batch, text, full

        single, batch, text, full = run(go())
        assert ids_srv.stats.generate_requests == 2 + 1 + 2 and ids_srv.stats.generate_prompts == 6
    assert [r.finish_reason for r in single] == ["length", "length"]
    assert all(r.completion_tokens == 3 for r in single)
    assert [(r.content, r.reasoning_content, r.completion_tokens) for r in batch] == \
        [(r.content, r.reasoning_content, r.completion_tokens) for r in single]
    # older SGLang (text only): the text split gives what the id split gives
    assert [(r.reasoning_content, r.content) for r in text] == [(r.reasoning_content, r.content) for r in full]
    assert all(r.content for r in full)


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
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def go():
        async with SGLangEngine(f"http://127.0.0.1:{port}", tok, connect_timeout_s=2) as eng:
            probe = await eng.probe()
            assert not probe.healthy and "Cannot connect" in probe.error
            await eng.chat(MESSAGES, GenerationConfig(max_new_tokens=4))

    with pytest.raises(EngineError) as info:
        run(go())
    assert info.value.connection and info.value.retryable


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


# -- broken or hostile engines (issue 14 item 4) ----------------------------------------


def _engine(kind: str, url: str, tok, **kwargs):
    return SGLangEngine(url, tok, **kwargs) if kind == "sglang" else OpenAIEngine(url, **kwargs)


async def _probe_then_chat(eng, gen=GenerationConfig(max_new_tokens=16)):
    async with eng:
        probe = await eng.probe()
        return probe, await eng.chat(MESSAGES, gen)


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
