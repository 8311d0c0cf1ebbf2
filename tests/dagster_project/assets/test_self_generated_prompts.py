"""self_generated_prompts through Dagster: SmolLM2 writes a partition's prompts, the blocking check passes and
raw_prompts mixes them in by weight; a partition that fails the check keeps raw_prompts from running."""

from __future__ import annotations

import json

import dagster as dg
import pyarrow as pa
import pytest

from dagster_project.definitions import defs
from dagster_project.resources import StoreResource, TargetModelResource
from dflash_assets.self_generated import JOURNAL_SCHEMA, SelfPromptsConfig, journal_batch_key
from dflash_assets.store.backends import LocalStore


@pytest.fixture
def instance():
    with dg.instance_for_test() as inst:
        yield inst


def _ingest(instance, resources, tmp_path, n=4):
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Prompt {i}"}]}) + "\n"
                              for i in range(n)))
    dg.materialize(defs.assets, selection=["prompt_corpus"], instance=instance, resources=resources,
                   run_config={"ops": {"prompt_corpus": {"config": {"source_uri": str(source)}}}})
    return instance.get_dynamic_partitions("prompt_shards")


def _check(result):
    [evaluation] = result.get_asset_check_evaluations()
    return evaluation


def test_smollm2_writes_a_partition_the_check_passes_and_raw_prompts_mixes_it_in(instance, tmp_path):
    from dflash_assets.embedded.smollm2 import SmolLM2Unavailable, smollm2_target_path

    try:
        target = TargetModelResource(model_path=str(smollm2_target_path()), dtype="float32", enable_thinking=False)
    except SmolLM2Unavailable as e:
        pytest.skip(f"SmolLM2 unavailable: {e}")
    resources = {**defs.resources, "store": StoreResource(uri=str(tmp_path / "store")), "target": target}
    [shard] = _ingest(instance, resources, tmp_path)
    config = {"samples": 8, "batch_size": 4, "max_new_tokens": 48, "device": "cpu"}
    result = dg.materialize(defs.assets, selection=["self_generated_prompts"], partition_key=shard,
                            instance=instance, resources=resources,
                            run_config={"ops": {"self_generated_prompts": {"config": config}}})
    meta = {k: v.value for k, v in result.asset_materializations_for_node("self_generated_prompts")[0]
            .metadata.items()}
    assert meta["samples"] == 8 and meta["batches"] == 2 and meta["batches_resumed"] == 0
    assert meta["kept"] >= 2 and meta["prompts_per_s"] > 0 and meta["distinct_ratio"] >= 0.9
    evaluation = _check(result)
    assert evaluation.passed and evaluation.check_name == "self_generated_quality"
    assert {"distinct_ratio", "min_kept_ratio", "filtered"} <= set(evaluation.metadata)
    mixed = dg.materialize(defs.assets, selection=["raw_prompts"], partition_key=shard, instance=instance,
                           resources=resources, run_config={"ops": {"raw_prompts": {"config": {
                               "weights": {"self_generated": 0.5}}}}})
    assert mixed.success
    table = LocalStore(tmp_path / "store").read_parquet(f"raw_prompts/{shard}.parquet")
    assert table.num_rows == 6  # 4 of the corpus and 0.5 x 4 self-generated
    assert table.column("source").to_pylist()[4:] == ["self_generated"] * 2


def test_a_failing_check_blocks_raw_prompts_in_the_same_run(instance, tmp_path):
    target = TargetModelResource()  # the embedded tiny target: the journal leaves it nothing to sample
    resources = {**defs.resources, "store": StoreResource(uri=str(tmp_path / "store")), "target": target}
    [shard] = _ingest(instance, resources, tmp_path)
    spec = target.spec()
    # a journal of four copies of one request: nothing to sample, and 1 distinct first turn of 4
    key = journal_batch_key(shard, SelfPromptsConfig(samples=4, batch_size=4).config_hash(
        spec.generation_fingerprint()), 0)
    LocalStore(tmp_path / "store").write_parquet(key, pa.table({
        "sample_index": [0, 1, 2, 3], "user_turns": [["Can you help me plan a trip to Lisbon?"]] * 4,
        "answers": [[]] * 4, "ended": [True] * 4, "new_tokens": [12] * 4}, schema=JOURNAL_SCHEMA))
    result = dg.materialize(defs.assets, selection=["self_generated_prompts", "raw_prompts"], partition_key=shard,
                            instance=instance, resources=resources, raise_on_error=False,
                            run_config={"ops": {"self_generated_prompts": {"config": {"samples": 4,
                                                                                       "batch_size": 4}}}})
    evaluation = _check(result)
    assert not evaluation.passed and "distinct ratio 25.0% < 90%" in evaluation.description
    assert not result.success
    assert result.asset_materializations_for_node("raw_prompts") == []
