"""The generation_plan stage as plain calls over one store (no Dagster): before any completions its figures fall back
to the raw prompts and max_new_tokens; after a partition is regenerated they come from its completions."""

from __future__ import annotations

import pytest


def test_the_stage_functions_run_prompts_plan_completions_and_samples_without_dagster(tmp_path, tiny_dense_target):
    """The Python API (docs/python-api.md) as plain calls over one store. Before any completions the plan's figures fall back
    to the raw prompts (turns, the burst's requests) and max_new_tokens (output per turn); after one partition is
    regenerated they come from its completions."""
    from dflash_assets.generation.config import GenerationConfig
    from dflash_assets.generation.fleet import EndpointConfig, EngineFleetConfig
    from dflash_assets.generation.stage import regenerate_partition
    from dflash_assets.planning.stage import plan_corpus
    from dflash_assets.prompts.ingest import ingest_prompt_source, materialize_prompt_shard
    from dflash_assets.store.backends import LocalStore
    from dflash_assets.target_model.spec import TargetModelSpec
    from tests.support.sglang_loopback import LoopbackServer
    from dflash_assets.tokenization.stage import tokenize_partition

    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(f'{{"messages": [{{"role": "user", "content": "Prompt {i}"}}]}}\n' for i in range(6)))
    store = LocalStore(tmp_path / "store")
    (shard,) = ingest_prompt_source(str(source), store).shard_keys
    materialize_prompt_shard(store, shard)
    spec = TargetModelSpec(model_path=str(tiny_dense_target), dtype="float32")
    generation = GenerationConfig(max_new_tokens=16, enable_thinking=spec.thinking())
    probe = {"probe_requests": 4, "probe_max_new_tokens": 8}
    with LoopbackServer(model_path=str(tiny_dense_target)) as engine:
        fleet = EngineFleetConfig(endpoints=[EndpointConfig(url=engine.url, kind="sglang", max_concurrency=2)],
                                  target_model=spec.model_path)
        before = plan_corpus(store, spec, fleet, generation=generation, **probe)
        done = regenerate_partition(store, shard, spec, fleet, generation=generation)
        after = plan_corpus(store, spec, fleet, generation=generation, **probe)
    samples = tokenize_partition(store, shard, spec)
    assert before.metadata["conversations"] == 6 and before.metadata["turns_source"] == "raw_prompts"
    assert before.metadata["output_tokens_source"] == "max_new_tokens"
    assert before.metadata["burst_prompts"] == "raw_prompts"
    assert before.metadata["output_tokens_per_turn"] == 16.0
    assert done.stats.prompts_done == 6 and store.exists(done.output_key)
    assert after.metadata["turns_source"] == "completions" and after.metadata["output_tokens_source"] == "completions"
    assert after.metadata["tokens_per_sample_source"] == "completions"
    assert after.metadata["burst_prompts"] == "completions"
    assert after.metadata["output_tokens_per_turn"] == pytest.approx(done.stats.completion_tokens / done.stats.turns,
                                                                     abs=0.05)
    assert samples.stats.conversations == 6 and "Cost plan" in after.markdown()
