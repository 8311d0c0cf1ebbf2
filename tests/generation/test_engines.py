"""Engine clients against real servers on 127.0.0.1: the SGLang-shaped loopback, `transformers serve`
with the tiny target, and the in-process Transformers engine."""

from __future__ import annotations

import asyncio
import os

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
from tests.support.sglang_loopback import QWEN3_6_IDS, LoopbackServer, _Generator, _prompt_key
from tests.ports import free_port

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
    `target_model.chat_template.split_reasoning_text` (on text, the OpenAI path) split one output alike."""
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
    port = free_port()  # a port nobody listens on

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


def test_transformers_engine_loads_and_generates_on_one_worker_thread(tiny_dense_target, tok, monkeypatch):
    """Compiled CUDA graphs keep per-thread state: the load and every batch run on the engine's one thread."""
    import threading

    from dflash_assets.generation.engines import release_idle_models

    release_idle_models()  # loaded by an earlier test: this one sees the load

    threads = []
    for name in ("_load", "_generate"):
        original = getattr(TransformersEngine, name)

        def record(self, *args, _original=original):
            threads.append((threading.get_ident(), threading.current_thread().name.split("_")[0]))
            return _original(self, *args)

        monkeypatch.setattr(TransformersEngine, name, record)
    gen = GenerationConfig(max_new_tokens=3, temperature=0.0, enable_thinking=False)

    async def go():
        async with TransformersEngine(tiny_dense_target, tokenizer=tok, max_concurrency=1) as eng:
            await asyncio.gather(*(eng.chat([{"role": "user", "content": q}], gen) for q in ("a", "b", "c")))
            return eng.batch_sizes

    assert run(go()) == [1, 1, 1]
    assert len(threads) == 4 and set(threads) == {(threads[0][0], "dflash-generate")}  # the engine's own thread
    assert threads[0][0] != threading.get_ident()


def test_static_batch_shapes_are_few_and_hold_the_batch():
    from dflash_assets.generation.engines import STATIC_WIDTH_BUCKETS, static_batch_shape, static_row_cap

    shapes = {static_batch_shape(n, w, 1024) for n in range(1, 1025) for w in range(1, 2049, 7)}
    assert {r for r, _ in shapes} == {64, 128, 256, 512, 1024}  # 1,024 row counts -> 5 row buckets
    assert {w for _, w in shapes} == {256, 512, 1024, 2048} == set(STATIC_WIDTH_BUCKETS)  # powers of two
    for n, w in [(1, 1), (17, 300), (1000, 256), (1024, 257)]:
        rows, width = static_batch_shape(n, w, 1024)
        assert rows >= n and width >= w
    assert static_batch_shape(100, 10, 96) == (100, 256)  # a batch over max_rows (never formed) is not cut
    assert static_batch_shape(70, 10, 96) == (70, 256)  # 96 rows is no bucket: the cap is the bucket under it, 64
    assert static_batch_shape(40, 10, 96) == (64, 256)
    assert static_batch_shape(3, 10, 8) == (8, 256)  # under the smallest bucket: the cap itself
    # the token cap: 2,048-token prompts fit 256 rows in 524,288 padded tokens
    assert static_row_cap(2048, 1024, 524288) == 256 and static_row_cap(512, 1024, 524288) == 1024
    assert static_row_cap(1024, 1024, 600000) == 512  # 585 rows fit: the bucket under it
    assert static_batch_shape(200, 700, 1024, 524288) == (256, 1024)
    assert static_batch_shape(300, 700, 1024, 524288) == (512, 1024)
    assert static_batch_shape(600, 500, 1024, 524288) == (1024, 512)  # 1,024 x 512 is within it
    # under a token cap every shape a formed batch (rows <= the cap) can take is a bucket pair
    formed = {static_batch_shape(n, w, 1024, 524288) for w in range(1, 2049, 7) for n in range(1, 1025)
              if n <= static_row_cap(static_batch_shape(1, w, 1024)[1], 1024, 524288)}
    assert len(formed) <= 20 and all(r in (64, 128, 256, 512, 1024) for r, _ in formed)


def test_static_engine_forms_batches_of_bucket_rows(tiny_dense_target, tok):
    """The batcher stops a static-cache batch at the row bucket its padded width allows, so 5 waiting requests
    under a 4-row token cap run as 4 + 1 (each padded to 4 rows), not as one batch of 5."""
    gen = GenerationConfig(max_new_tokens=2, temperature=0.0, enable_thinking=False)

    async def go():
        async with TransformersEngine(tiny_dense_target, tokenizer=tok, max_concurrency=6, max_batch_tokens=4 * 256,
                                      cache="static") as eng:
            await asyncio.gather(*(eng.chat([{"role": "user", "content": f"Count to {i}."}], gen) for i in range(5)))
            return eng.batch_sizes, eng.batch_shapes

    sizes, shapes = run(go())
    assert sizes == [4, 1] and shapes == [(4, 256), (4, 256)]


def test_batch_rows_apart_from_requests_in_flight(tiny_dense_target, tok):
    """`max_batch_rows` below `max_concurrency`: 5 requests in flight run as generate calls of at most 2 rows."""
    gen = GenerationConfig(max_new_tokens=2, temperature=0.0, enable_thinking=False)

    async def go(**kwargs):
        async with TransformersEngine(tiny_dense_target, tokenizer=tok, max_concurrency=8, **kwargs) as eng:
            out = await asyncio.gather(*(eng.chat([{"role": "user", "content": f"Count to {i}."}], gen)
                                         for i in range(5)))
            return eng.batch_sizes, [r.content for r in out]

    (rows_2, answers_2), (rows_8, answers_8) = run(go(max_batch_rows=2)), run(go())
    assert max(rows_2) == 2 and sum(rows_2) == 5 and rows_8 == [5]
    assert answers_2 == answers_8
    from dflash_assets.generation.fleet import EndpointConfig, EngineFleetConfig, build_engine

    ep = EndpointConfig(url="inprocess://t", kind="transformers", max_concurrency=64, max_batch_rows=16)
    engine = build_engine(ep, EngineFleetConfig(target_model=str(tiny_dense_target), endpoints=[ep]), tok)
    assert (engine.max_concurrency, engine.max_batch_rows) == (64, 16)


def test_engines_of_one_model_share_its_load_and_thread(tiny_dense_target, tok, monkeypatch, tmp_path):
    """A second engine of the same model (the next shard's) reuses the loaded model, its compiled graphs and its
    thread; another model, or the same directory rebuilt, loads anew and frees the idle one."""
    import shutil

    from dflash_assets.generation import engines

    engines.release_idle_models()
    loads = []
    original = TransformersEngine._load
    monkeypatch.setattr(TransformersEngine, "_load", lambda self: loads.append(self.model_path) or original(self))
    gen = GenerationConfig(max_new_tokens=3, temperature=0.0, enable_thinking=False)

    async def one(path):
        async with TransformersEngine(path, tokenizer=tok, max_concurrency=2) as eng:
            out = await eng.chat([{"role": "user", "content": "Hi"}], gen)
            return eng.reused_model, id(eng.model), out.content

    first, second = run(one(tiny_dense_target)), run(one(tiny_dense_target))
    assert loads == [str(tiny_dense_target)] and (first[0], second[0]) == (False, True)
    assert first[1] == second[1] and first[2] == second[2]
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dense_target, copy)
    third = run(one(copy))
    assert loads == [str(tiny_dense_target), str(copy)] and not third[0] and third[2] == first[2]
    assert list(engines._LOADED) == [TransformersEngine(copy)._key]  # the idle first model was freed
    weights = next(copy.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # rebuilt in place
    assert not run(one(copy))[0] and len(loads) == 3
    assert engines.release_idle_models() == 1 and not engines._LOADED


def test_static_cache_engine_answers_as_the_dynamic_one(tiny_dense_target, tok):
    """The static-cache path (padded rows and width) gives each request the dynamic cache's greedy answer."""
    gen = GenerationConfig(max_new_tokens=10, temperature=0.0, enable_thinking=False)
    chats = [[{"role": "user", "content": q}] for q in ("What is 2+2?", "Name a colour.", "Write a long sentence.")]

    async def go(cache):
        async with TransformersEngine(tiny_dense_target, tokenizer=tok, max_concurrency=8, cache=cache) as eng:
            out = await asyncio.gather(*(eng.chat(m, gen) for m in chats))
            return out, eng.batch_shapes

    (static, shapes), (dynamic, dyn_shapes) = run(go("static")), run(go("dynamic"))
    assert shapes == [(8, 256)] and dyn_shapes[0][0] == 3  # 3 rows padded to the 8-row cap, width to 256
    assert [(r.content, r.completion_tokens, r.finish_reason) for r in static] == \
        [(r.content, r.completion_tokens, r.finish_reason) for r in dynamic]
    long_chat = [{"role": "user", "content": "word " * 3000}]  # over STATIC_MAX_WIDTH: the dynamic cache decodes it

    async def long(cache):
        async with TransformersEngine(tiny_dense_target, tokenizer=tok, max_concurrency=8, cache=cache) as eng:
            return await eng.chat(long_chat, gen), eng.batch_shapes

    (long_static, long_shapes), (long_dynamic, _) = run(long("static")), run(long("dynamic"))
    assert long_shapes[0][0] == 1 and long_shapes[0][1] > 2048  # not padded: one row, its own width
    assert long_static.content == long_dynamic.content
    with pytest.raises(ValueError, match="dynamic', 'static', 'continuous' or 'slots'"):
        TransformersEngine(tiny_dense_target, tokenizer=tok, cache="paged")


def test_continuous_engine_answers_as_the_dynamic_one_and_stops_its_thread(tiny_dense_target, tok):
    """cache="continuous" (transformers' continuous batching) gives each request the dynamic cache's greedy answer
    and finish reason, rows of different lengths in one running batch (max_new_tokens is per request); two engines of the model share one manager;
    the last one to close stops the manager's thread, so the process can exit."""

    from dflash_assets.generation import engines

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
    assert [m.continuous for m in engines._LOADED.values()] == [None]  # the model itself stays loaded
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


# -- broken or hostile engines ----------------------------------------------------------


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


@pytest.mark.parametrize("kind", ["sglang", "openai"])
def test_seed_changes_the_output_only_on_a_deterministic_server(tok, kind):
    async def two_seeds(url):
        async with _engine(kind, url, tok) as eng:
            await eng.probe()
            a = await eng.chat(MESSAGES, GenerationConfig(max_new_tokens=64, seed=1))
            b = await eng.chat(MESSAGES, GenerationConfig(max_new_tokens=64, seed=2))
            return eng.seed_honoured, a, b

    with LoopbackServer(model_path=TARGET) as default, LoopbackServer(model_path=TARGET, deterministic=True) as det:
        ignored, a, b = run(two_seeds(default.url))
        honoured, c, d = run(two_seeds(det.url))
    assert ignored is False and (a.reasoning_content, a.content) == (b.reasoning_content, b.content)
    assert honoured is True and (c.reasoning_content, c.content) != (d.reasoning_content, d.content)


def test_config_hash_says_whether_the_seed_was_honoured():
    seeded, unseeded = GenerationConfig(seed=7), GenerationConfig()
    assert seeded.config_hash(TARGET, True) != seeded.config_hash(TARGET, False)
    assert seeded.config_hash(TARGET, False) == seeded.config_hash(TARGET)  # unknown counts as not honoured
    assert unseeded.config_hash(TARGET, True) == unseeded.config_hash(TARGET, False)  # no seed: nothing to say


@pytest.mark.parametrize("kind", ["sglang", "openai"])
def test_request_is_fitted_to_the_context_length_before_sending(tok, kind):
    from dflash_assets.generation.engines import ContextOverflow

    gen = GenerationConfig(max_new_tokens=400)
    with LoopbackServer(model_path=TARGET, context_length=300) as srv:

        async def go(**kwargs):
            async with _engine(kind, srv.url, tok, **kwargs) as eng:
                await eng.probe()
                return eng.context_length, await eng.chat(MESSAGES, gen)

        context, res = run(go())
        body = srv.stats.last_body
        sent = body["sampling_params"]["max_new_tokens"] if kind == "sglang" else body["max_tokens"]
        assert context == 300 and sent < 300 and res.max_new_tokens_cut == 400 - sent
        if kind == "sglang":  # exact: the prompt's ids
            assert sent == 300 - len(ChatTokenizer(tok).prompt_ids(MESSAGES, True))
        requests = srv.stats.generate_requests + srv.stats.chat_requests
        with pytest.raises(ContextOverflow) as info:  # fewer than the minimum left: not sent at all
            run(go(context_min_new_tokens=299))
        assert srv.stats.generate_requests + srv.stats.chat_requests == requests
    assert not info.value.retryable and info.value.context_length == 300


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
