"""The generation stage through Dagster: the plan asset measures the fleet; no engine fails at once."""

import json
import re

import dagster as dg
import pytest

from dagster_project.definitions import defs
from dagster_project.resources import EngineFleetResource, StoreResource
from tests.support.sglang_loopback import LoopbackServer


def _resources(tmp_path, *endpoints, max_concurrency=2):
    """The project's resources over a local store in tmp_path and these engine endpoints."""
    return {**defs.resources, "store": StoreResource(uri=str(tmp_path / "store")),
            "engines": EngineFleetResource(endpoints=list(endpoints), max_concurrency=max_concurrency)}


def _ingest(instance, resources, tmp_path, conversations):
    """prompt_corpus over a JSONL source of ``conversations`` (message lists; an int n: n one-turn prompts
    "Prompt i"); returns the prompt shards it registered."""
    if isinstance(conversations, int):
        conversations = [[{"role": "user", "content": f"Prompt {i}"}] for i in range(conversations)]
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    dg.materialize(defs.assets, selection=["prompt_corpus"], instance=instance, resources=resources,
                   run_config={"ops": {"prompt_corpus": {"config": {"source_uri": str(source)}}}})
    return instance.get_dynamic_partitions("prompt_shards")


def test_generation_plan_estimates_from_a_measured_burst(tmp_path, tiny_dense_target):
    # 5 ms per generated token per request: throughput is bounded by that latency and the concurrency.
    with LoopbackServer(model_path=str(tiny_dense_target), per_token_s=0.005) as a, \
         LoopbackServer(model_path=str(tiny_dense_target), per_token_s=0.005) as b:
        resources = _resources(tmp_path, f"sglang:{a.url}", f"sglang:{b.url}", max_concurrency=4)
        with dg.instance_for_test() as instance:
            _ingest(instance, resources, tmp_path, 300)
            result = dg.materialize(defs.assets, selection=["generation_plan"], instance=instance,
                                    resources=resources, run_config={"ops": {"generation_plan": {"config": {
                                        "probe_max_new_tokens": 32, "probe_requests": 8,
                                        "expected_output_tokens": 1000}}}})
            meta = {k: v.value for k, v in result.asset_materializations_for_node("generation_plan")[0].metadata.items()}
            assert a.stats.generate_requests >= 8 and b.stats.generate_requests >= 8  # both were measured
    assert meta["prompts"] == 300
    assert meta["total_output_tokens"] == 300_000
    tps = meta["measured_tokens_per_s"]
    assert 50 < tps < 4 * 2 / 0.005 * 1.1  # below the latency bound of 2 endpoints x 4 in flight
    assert meta["estimated_wall_s"] == pytest.approx(300_000 / tps, rel=0.01)
    assert meta[f"tokens_per_s[{a.url}]"] > 0 and meta[f"tokens_per_s[{b.url}]"] > 0


def test_completions_without_any_engine_fail_at_once_with_the_probe_table(tmp_path):
    resources = _resources(tmp_path, "sglang:http://127.0.0.1:9", max_concurrency=1)
    with dg.instance_for_test() as instance:
        (shard,) = _ingest(instance, resources, tmp_path, 3)
        result = dg.materialize(defs.assets, selection=["raw_prompts", "completions"], partition_key=shard,
                                instance=instance, resources=resources, raise_on_error=False)
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    message = str(failure.event_specific_data.error)
    assert "| endpoint |" in message and "127.0.0.1:9" in message


def test_completions_probe_each_endpoint_once_and_log_the_table(tmp_path, tiny_dense_target):
    with LoopbackServer(model_path=str(tiny_dense_target)) as engine:
        resources = _resources(tmp_path, f"sglang:{engine.url}")
        with dg.instance_for_test() as instance:
            (shard,) = _ingest(instance, resources, tmp_path, 4)
            result = dg.materialize(defs.assets, selection=["raw_prompts", "completions"], partition_key=shard,
                                    instance=instance, resources=resources,
                                    run_config={"ops": {"completions": {"config": {"max_new_tokens": 16}}}})
            logs = [e.user_message for e in instance.all_logs(result.run_id) if e.user_message]
        assert engine.stats.model_info_requests == 1  # one probe per materialization, not one in the asset and one in the library
    assert sum("engine probe:" in m and "| endpoint |" in m for m in logs) == 1
    # the UI shows what the target wrote: the first conversations' prompt and answer, as text
    (materialization,) = result.asset_materializations_for_node("completions")
    examples = materialization.metadata["examples"].value.splitlines()
    assert examples[:2] == ["| prompt | answer |", "| --- | --- |"] and len(examples) == 5, examples
    assert all(re.fullmatch(r"\| Prompt \d \| .*\S.* \|", row) for row in examples[2:]), examples


def test_generation_plan_takes_turns_and_lengths_from_the_completions(tmp_path, tiny_dense_target):
    """Turns per prompt from the completions' num_turns (not 1.0), output length measured, burst on real prompts."""
    from dagster_project.config import GenerationStageConfig
    from dflash_assets.store import layout
    from dflash_assets.store.backends import LocalStore

    chats = [[{"role": "user", "content": f"Question {i}"}, {"role": "assistant", "content": "A"},
              {"role": "user", "content": f"Follow-up {i}"}] for i in range(6)]
    with LoopbackServer(model_path=str(tiny_dense_target)) as engine:
        resources = _resources(tmp_path, f"sglang:{engine.url}")
        with dg.instance_for_test() as instance:
            (shard,) = _ingest(instance, resources, tmp_path, chats)
            empty = dg.materialize(defs.assets, selection=["generation_plan"], instance=instance, resources=resources,
                                   run_config={"ops": {"generation_plan": {"config": {
                                       "probe_max_new_tokens": 8, "probe_requests": 4}}}})
            dg.materialize(defs.assets, selection=["raw_prompts", "completions"], partition_key=shard,
                           instance=instance, resources=resources,
                           run_config={"ops": {"completions": {"config": {"max_new_tokens": 64}}}})
            engine.stats.prompts_seen.clear()
            result = dg.materialize(defs.assets, selection=["generation_plan"], instance=instance,
                                    resources=resources, run_config={"ops": {"generation_plan": {"config": {
                                        "probe_max_new_tokens": 8, "probe_requests": 4}}}})
            assert len(engine.stats.prompts_seen) == 4  # the burst sent 4 different real requests
    first = {k: v.value for k, v in empty.asset_materializations_for_node("generation_plan")[0].metadata.items()}
    meta = {k: v.value for k, v in result.asset_materializations_for_node("generation_plan")[0].metadata.items()}
    # nothing generated yet: the generation config's max_new_tokens, not a constant; turns from the committed
    # corpus's user turns (no raw_prompts yet): two per prompt
    assert first["output_tokens_source"] == "max_new_tokens" and first["turns_source"] == "raw_prompts"
    assert first["total_output_tokens"] == 6 * 2 * GenerationStageConfig().max_new_tokens
    table = LocalStore(tmp_path / "store").read_parquet(layout.completions(shard))
    turns = sum(table["num_turns"].to_pylist())
    tokens = sum(sum(t) for t in table["completion_tokens"].to_pylist())
    assert turns == 12  # two regenerated turns per prompt
    assert meta["output_tokens_source"] == "completions" and meta["turns_source"] == "completions"
    assert meta["burst_prompts"] == "completions"  # real requests, history included
    assert meta["total_output_tokens"] == int(6 * (turns / 6) * (tokens / turns))


def test_completions_run_config_caps_the_context_at_the_drafters_max_length(tmp_path, tiny_dense_target):
    """``max_context_tokens`` in the completions' run config: the prompt over it is listed as failed with its reason
    and counted in the metadata, the partition still materializes (1 of 4 is over the default 1% gate)."""
    from dflash_assets.store import layout
    from dflash_assets.store.backends import LocalStore

    texts = [f"Question {i}" for i in range(3)] + [" ".join(["word"] * 400)]
    with LoopbackServer(model_path=str(tiny_dense_target)) as engine:
        resources = _resources(tmp_path, f"sglang:{engine.url}")
        with dg.instance_for_test() as instance:
            (shard,) = _ingest(instance, resources, tmp_path, [[{"role": "user", "content": t}] for t in texts])
            result = dg.materialize(defs.assets, selection=["raw_prompts", "completions"], partition_key=shard,
                                    instance=instance, resources=resources, run_config={"ops": {"completions": {
                                        "config": {"max_new_tokens": 32, "max_context_tokens": 256}}}})
    assert result.success
    meta = {k: v.value for k, v in result.asset_materializations_for_node("completions")[0].metadata.items()}
    assert meta["prompts_over_max_context_tokens"] == 1 and meta["prompts_failed"] == 1
    store = LocalStore(tmp_path / "store")
    assert store.read_parquet(layout.completions(shard)).num_rows == 3
    [reason] = store.read_parquet(layout.completions_failed(shard))["reason"].to_pylist()
    assert "max_context_tokens 256" in reason
