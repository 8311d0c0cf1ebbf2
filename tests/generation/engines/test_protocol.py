"""What every engine does before and after a request: the context fit (never a request the server would refuse)
and whether a seed is honoured."""

from __future__ import annotations

import pytest

from dflash_assets.generation.chat_tokenizer import ChatTokenizer
from dflash_assets.generation.engines import GenerationConfig
from tests.generation.engines.support import MESSAGES, run, _engine, TARGET
from tests.support.sglang_loopback import LoopbackServer


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
