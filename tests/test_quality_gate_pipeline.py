"""The failure this project exists to catch, built through the real pipeline.

87% of completions are stubs (`<think>\\n\\n</think>\\n\\nOK.<|im_end|>`: a 6-token
loss mask). The engine is a loopback server answering in SGLang's native
shapes (SGLang itself cannot be installed here), decoding with the real
Qwen3.6 tokenizer. The blocking `empty_response_ratio` check fails,
`hidden_state_cache` does not run in that run, and a later run of
`hidden_state_cache` alone is refused by the quality gate on the GPU host.
"""

import dagster as dg
import pytest

from dagster_project.definitions import defs
from dagster_project.resources import EngineFleetResource, StoreResource, TargetModelResource
from dflash_assets.testing.sglang_loopback import LoopbackServer
from dflash_assets.store.backends import LocalStore


@pytest.fixture
def stub_engine(tiny_dense_target):
    with LoopbackServer(model_path=str(tiny_dense_target), tokenizer_json=str(tiny_dense_target / "tokenizer.json"),
                        stub_ratio=0.87, reasoning_tokens=(24, 40), content_tokens=(20, 40)) as server:
        yield server


def test_stub_completions_fail_the_blocking_check_and_never_reach_the_gpu(stub_engine, tmp_path, tiny_dense_target):
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(f'{{"conversations": [{{"from": "human", "value": "Question number {i}?"}}]}}\n'
                              for i in range(100)))
    resources = {
        **defs.resources,
        "store": StoreResource(uri=str(tmp_path / "store")),
        "target": TargetModelResource(),
        "engines": EngineFleetResource(endpoints=[f"sglang:{stub_engine.url}"], max_concurrency=16),
    }
    with dg.instance_for_test() as instance:
        dg.materialize(defs.assets, selection=["prompt_corpus"], instance=instance, resources=resources,
                       run_config={"ops": {"prompt_corpus": {"config": {"source_uri": str(source)}}}})
        (shard,) = instance.get_dynamic_partitions("prompt_shards")
        run_config = {"ops": {"completions": {"config": {"max_new_tokens": 128, "max_turns": 1}}}}
        result = dg.materialize(defs.assets, partition_key=shard, instance=instance, resources=resources,
                                selection=["raw_prompts", "completions", "tokenized_samples", "hidden_state_cache"],
                                run_config=run_config, raise_on_error=False)
        assert not result.success
        assert stub_engine.stats.generate_requests >= 100  # the SGLang native path was used

        checks = {c.check_name: c for c in result.get_asset_check_evaluations()}
        empty = checks["empty_response_ratio"]
        assert not empty.passed and empty.severity == dg.AssetCheckSeverity.ERROR
        meta = {k: v.value for k, v in empty.metadata.items()}  # numbers as text: the UI does not plot them
        assert 0.75 < float(meta["ratio"]) < 0.97  # 87% expected from the stub rate
        assert meta["most_common_loss_tokens"] == "6"  # `</think>\n\nOK.<|im_end|>\n`
        assert len(meta["examples"]) == 10
        assert checks["schema"].passed

        def materialized(key):
            return instance.get_latest_materialization_event(dg.AssetKey(key))

        assert materialized("tokenized_samples") is not None  # the data is there, for inspection
        assert materialized("hidden_state_cache") is None
        store = LocalStore(tmp_path / "store")
        assert store.list("hidden_state_cache") == []

        # A later run of the GPU stage alone is refused on the host, from the gate in the store.
        again = dg.materialize(defs.assets, partition_key=shard, instance=instance, resources=resources,
                               selection=["hidden_state_cache"], raise_on_error=False)
        assert not again.success
        failure = next(e for e in again.all_events if e.event_type_value == "STEP_FAILURE")
        assert "blocking checks failed (empty_response_ratio)" in str(failure.event_specific_data.error)
        assert materialized("hidden_state_cache") is None
