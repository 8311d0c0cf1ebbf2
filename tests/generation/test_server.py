"""What a row's config_hash records is what the engine did: sampling settings reach a real `transformers serve`.

`transformers serve` starts every request from the served model's generation_config.json and turns sampling
on from nothing in a plain OpenAI request, so a target shipping `do_sample: false` (the tiny target did) decoded
every "temperature 0.6" row greedily. The server here serves a copy of the tiny target whose
generation_config.json says `do_sample: false`, so only the request can turn sampling on.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from dflash_assets.generation.engines import GenerationConfig, OpenAIEngine, hf_generation_settings
from dflash_assets.generation.server import local_engine_server

MESSAGES = [{"role": "user", "content": "Give me three ideas for a birthday party."}]


def test_hf_generation_settings_follow_the_config():
    assert hf_generation_settings(GenerationConfig(temperature=0.0)) == {"do_sample": False}
    assert hf_generation_settings(GenerationConfig()) == {"do_sample": True, "temperature": 0.6, "top_p": 0.95,
                                                          "top_k": 20}
    assert hf_generation_settings(GenerationConfig(top_k=-1, min_p=0.05, repetition_penalty=1.1)) == {
        "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 0, "min_p": 0.05, "repetition_penalty": 1.1}


def test_payload_carries_the_sampling_only_for_transformers_serve():
    engine = OpenAIEngine("http://127.0.0.1:1")
    gen = GenerationConfig(seed=7)
    engine.dialect, engine.extra_sampling_params = "transformers_serve", False
    payload = engine._payload(MESSAGES, gen)
    assert json.loads(payload["generation_config"]) == hf_generation_settings(gen) and payload["seed"] == 7
    assert "top_k" not in payload  # not a request field there (422)
    engine.dialect, engine.extra_sampling_params = "openai", True  # SGLang / vLLM take the fields themselves
    payload = engine._payload(MESSAGES, gen)
    assert "generation_config" not in payload and payload["top_k"] == 20 and payload["temperature"] == 0.6


def test_the_tiny_target_ships_sampling_defaults(tiny_dense_target):
    shipped = json.loads((tiny_dense_target / "generation_config.json").read_text())
    assert shipped["do_sample"] is True and (shipped["temperature"], shipped["top_p"], shipped["top_k"]) == (0.6, 0.95, 20)


@pytest.fixture(scope="module")
def greedy_shipping_server(tiny_dense_target, tmp_path_factory):
    """`transformers serve` on a copy of the tiny target whose generation_config.json turns sampling off."""
    copy = tmp_path_factory.mktemp("greedy-target")
    for f in tiny_dense_target.iterdir():
        if f.name != "generation_config.json":
            (copy / f.name).symlink_to(f)
    shipped = json.loads((tiny_dense_target / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**shipped, "do_sample": False}))
    server = local_engine_server("transformers", copy, port=0, log_path=copy.parent / "serve.log",
                                 extra_args=["--dtype", "float32"])
    with server.start(wait_s=300):
        yield server


@pytest.mark.slow
def test_seeds_change_sampled_text_and_greedy_stays_put(greedy_shipping_server):
    def chat(**settings) -> str:
        async def go():
            async with OpenAIEngine(greedy_shipping_server.url) as engine:
                await engine.probe()
                res = await engine.chat(MESSAGES, GenerationConfig(max_new_tokens=40, **settings))
                return res.reasoning_content + "|" + res.content
        return asyncio.run(go())

    greedy = [chat(temperature=0.0, seed=seed) for seed in (1, 2)]
    assert greedy[0] == greedy[1]  # greedy: the seed changes nothing
    sampled = {seed: chat(temperature=0.6, seed=seed) for seed in (1, 2, 3)}
    assert len(set(sampled.values())) == 3, sampled  # sampling happened although the target ships do_sample=false
    assert chat(temperature=0.6, seed=2) == sampled[2]  # and a seed reproduces its text
    assert greedy[0] not in sampled.values()
