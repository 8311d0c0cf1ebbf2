"""SGLang's native engine against the SGLang-shaped loopback on 127.0.0.1: chat, probe, sampling params, batches."""

from __future__ import annotations

from dflash_assets.generation.chat_tokenizer import ChatTokenizer
from dflash_assets.generation.engines import GenerationConfig, SGLangEngine
from tests.generation.engines.support import IM_END, MESSAGES, run, _expected
from tests.support.sglang_loopback import LoopbackServer


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
