"""The whole graph, end to end, on S3 (moto's server on 127.0.0.1): what `make demo` does, on another store.

Real parts throughout: the embedded ShareGPT file, the tiny target served by
`transformers serve`, the GPU stages launched through Dagster Pipes as
subprocesses that reach the store only through S3.
"""

import re

import boto3
import dagster as dg
import pytest

from tests.chart_png import MAX_CHART_BYTES, PNG_SIGNATURE, decode_chart
from dagster_project.demo import run_demo
from dagster_project.resources import StoreResource
from dflash_assets.store import layout
from dflash_assets.store.backends import S3Store


@pytest.mark.slow
def test_whole_graph_on_s3(moto_endpoint, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)  # for the Pipes worker subprocesses
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    client.create_bucket(Bucket="dflash-e2e")
    store = StoreResource(uri="s3://dflash-e2e/run", endpoint_url=moto_endpoint)

    with dg.instance_for_test() as instance:
        summary = run_demo(instance, prompts=8, shard_size=4, max_new_tokens=64, max_turns=1, eval_prompts=2,
                           eval_new_tokens=24, store=store)
        assert summary["failed_shards"] == [] and summary["drafter_ok"], summary
        assert summary["tau"] is not None and summary["tau"] >= 1.0

        shards = summary["shards"]
        for key in ["raw_prompts", "completions", "tokenized_samples", "hidden_state_cache"]:
            assert instance.get_materialized_partitions(dg.AssetKey(key)) == set(shards), key

        # The GPU stages' chart data arrives through Pipes and is drawn as PNGs in the metadata.
        trained = instance.get_latest_materialization_event(dg.AssetKey("drafter_checkpoint")).asset_materialization
        evaluated = instance.get_latest_materialization_event(dg.AssetKey("drafter_eval")).asset_materialization
        for metadata, key in [(trained.metadata, "loss_curve"), (trained.metadata, "accuracy_by_position"),
                              (evaluated.metadata, "acceptance_by_position")]:
            png, image, _ = decode_chart(metadata[key].value)
            assert png.startswith(PNG_SIGNATURE) and len(png) < MAX_CHART_BYTES and image.size == (640, 300), key
        caption = decode_chart(evaluated.metadata["acceptance_by_position"].value)[2]
        assert abs(float(caption.split()[2].rstrip(":")) - summary["tau"]) < 0.01, caption  # the bars sum to tau

    s3 = S3Store("s3://dflash-e2e/run", client)
    keys = s3.list("")
    for shard in shards:
        assert f"raw_prompts/{shard}.parquet" in keys
        assert f"completions/{shard}.parquet" in keys
        assert f"tokenized_samples/{shard}.parquet" in keys
        parts = layout.list_hidden_state_parts(s3).get(shard, [])  # the parts its manifest names
        assert parts and set(parts) <= set(keys)
    checkpoint = layout.drafter_checkpoint_files(s3, "demo-v1")
    curve = {name for name in checkpoint if re.fullmatch(r"curve-step-\d{8}\.safetensors", name)}
    assert curve  # the learning-curve checkpoints the recipe's save_every kept, published in the same manifest
    assert set(checkpoint) - curve == {"model.safetensors", "config.json", "train_metrics.json", "provenance.json"}
    assert {*checkpoint.values(), "drafter_eval/demo-v1.json"} <= set(keys)
    assert not [k for k in keys if k.startswith("_pipes/")]  # Pipes sessions cleaned up
    for shard in shards:  # the blocking checks ran and passed on every shard
        gate = s3.read_json(f"tokenized_samples/{shard}.quality.json")
        assert gate["checks"]["empty_response_ratio"]["passed"] and gate["checks"]["schema"]["passed"]
    config = s3.read_json(checkpoint["config.json"])
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["target_layer_ids"]
