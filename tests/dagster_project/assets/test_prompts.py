"""The prompt stage through Dagster: the whole embedded ShareGPT file, partitions, metadata."""

import json

import dagster as dg
import pytest
import zstandard

from dagster_project.assets.prompts import prompt_corpus, raw_prompts
from dagster_project.resources import StoreResource
from dflash_assets.store.backends import LocalStore


@pytest.fixture
def instance():
    with dg.instance_for_test() as inst:
        yield inst


def _values(materialization):
    return {k: v.value for k, v in materialization.metadata.items()}


@pytest.mark.slow
def test_embedded_sharegpt_file_through_dagster(instance, tmp_path):
    store = StoreResource(uri=str(tmp_path / "store"))
    result = dg.materialize([prompt_corpus, raw_prompts], selection=["prompt_corpus"], instance=instance,
                            resources={"store": store})
    meta = _values(result.asset_materializations_for_node("prompt_corpus")[0])
    # The file holds 17,671 complete records followed by a cut-off one.
    assert meta["records_read"] == 17_671
    assert meta["truncated"] is True
    assert meta["records_read"] == meta["valid"] + meta["duplicates"] + meta["quarantined_total"]
    assert meta["valid"] == 16_317 and meta["duplicates"] == 1_075
    assert "empty_conversation" in meta["quarantined"] and "no_user_turn" in meta["quarantined"]
    shards = instance.get_dynamic_partitions("prompt_shards")
    assert len(shards) == meta["num_shards"] == 16  # ceil(16,317 / 1024)
    assert meta["shard_size_max"] == 1024

    last = sorted(shards)[-1]
    result = dg.materialize([prompt_corpus, raw_prompts], selection=["raw_prompts"], partition_key=last,
                            instance=instance, resources={"store": store})
    shard_meta = _values(result.asset_materializations_for_node("raw_prompts")[0])
    assert shard_meta["num_prompts"] == 16_317 - 15 * 1024
    table = LocalStore(tmp_path / "store").read_parquet(f"raw_prompts/{last}.parquet")
    assert table.num_rows == shard_meta["num_prompts"]
    assert "assistant" not in str(table.column_names)  # assistant turns are never carried over


def test_reingest_registers_only_new_shards(instance, tmp_path):
    source = tmp_path / "prompts.jsonl"
    lines = [f'{{"messages": [{{"role": "user", "content": "question {i}"}}]}}' for i in range(5)]
    source.write_text("\n".join(lines) + "\n")
    store = StoreResource(uri=str(tmp_path / "store"))
    config = {"ops": {"prompt_corpus": {"config": {"source_uri": str(source), "max_prompts_per_shard": 2}}}}

    dg.materialize([prompt_corpus], instance=instance, resources={"store": store}, run_config=config)
    first = instance.get_dynamic_partitions("prompt_shards")
    assert len(first) == 3

    lines += [f'{{"messages": [{{"role": "user", "content": "new question {i}"}}]}}' for i in range(3)]
    source.write_text("\n".join(lines) + "\n")
    result = dg.materialize([prompt_corpus], instance=instance, resources={"store": store}, run_config=config)
    meta = _values(result.asset_materializations_for_node("prompt_corpus")[0])
    assert meta["new_prompts"] == 3 and meta["existing_prompts"] == 5
    assert set(first) <= set(instance.get_dynamic_partitions("prompt_shards"))
    assert len(instance.get_dynamic_partitions("prompt_shards")) == 4  # 8 prompts / 2
    assert meta["new_partitions"] == 1
    assert meta["changed_shards"] == sorted(first)[-1]  # the last, non-full shard was filled


def test_source_with_no_valid_prompt_fails_with_reason(instance, tmp_path):
    source = tmp_path / "bad.jsonl"
    source.write_text('{"conversations": []}\n{"conversations": [{"from": "gpt", "value": "hi"}]}\n')
    store = StoreResource(uri=str(tmp_path / "store"))
    config = {"ops": {"prompt_corpus": {"config": {"source_uri": str(source)}}}}
    with pytest.raises(Exception, match="valid"):
        dg.materialize([prompt_corpus], instance=instance, resources={"store": store}, run_config=config)
    assert instance.get_dynamic_partitions("prompt_shards") == []


def test_cut_source_and_unknown_fields_show_in_the_metadata(instance, tmp_path):
    lines = [json.dumps({"id": str(i), "model": "m",
                         "conversations": [{"from": "human", "value": f"question {i} " * 9}]})
             for i in range(2000)]  # ~300 KB: several zstd blocks, so the blocks before the cut decode
    packed = zstandard.ZstdCompressor().compress(("\n".join(lines) + "\n").encode())
    source = tmp_path / "prompts.jsonl.zst"
    cut = len(packed) // 2
    source.write_bytes(packed[:cut])
    store = StoreResource(uri=str(tmp_path / "store"))
    config = {"ops": {"prompt_corpus": {"config": {"source_uri": str(source)}}}}
    result = dg.materialize([prompt_corpus], instance=instance, resources={"store": store}, run_config=config)
    meta = _values(result.asset_materializations_for_node("prompt_corpus")[0])
    assert meta["source_damage"] == "cut" and meta["stopped_at_compressed_byte"] == cut and meta["truncated"] is True
    assert f"{source}: zstd stream cut at compressed byte {cut}" in meta["parse_error"]
    assert 0 < meta["valid"] < 2000 and "| model | " + str(meta["valid"]) + " |" in meta["unknown_fields"]
