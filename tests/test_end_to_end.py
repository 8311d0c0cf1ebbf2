"""The whole graph, end to end, on S3 (moto's server on 127.0.0.1): `make demo`'s run, read back from its store.

The session's one tiny demo (the `tiny_demo` fixture, tests/demo_run.py) runs with its store on S3: real parts
throughout, the embedded ShareGPT file, the tiny target served by `transformers serve`, the GPU stages launched
through Dagster Pipes as subprocesses that reach the store only through S3. This reads what it left there and
in its Dagster instance.
"""

import re

import dagster as dg
import pytest

from tests.chart_png import MAX_CHART_BYTES, PNG_SIGNATURE, decode_chart
from dflash_assets.store import layout


@pytest.mark.slow
@pytest.mark.timeout(1700)  # the first reader of tiny_demo waits for the demo's run
def test_whole_graph_on_s3(tiny_demo):
    assert tiny_demo.done.returncode == 0, tiny_demo.console
    with tiny_demo.instance() as instance:
        shards = sorted(instance.get_dynamic_partitions("prompt_shards"))
        assert shards == ["shard-00000", "shard-00001"]
        for key in ["raw_prompts", "completions", "tokenized_samples", "hidden_state_cache"]:
            assert instance.get_materialized_partitions(dg.AssetKey(key)) == set(shards), key

        # The GPU stages' chart data arrives through Pipes and is drawn as PNGs in the metadata.
        trained = instance.get_latest_materialization_event(dg.AssetKey("drafter_checkpoint")).asset_materialization
        evaluated = instance.get_latest_materialization_event(dg.AssetKey("drafter_eval")).asset_materialization
        tau = evaluated.metadata["tau"].value
        assert tau is not None and tau >= 1.0
        for metadata, key in [(trained.metadata, "loss_curve"), (trained.metadata, "accuracy_by_position"),
                              (evaluated.metadata, "acceptance_by_position")]:
            png, image, _ = decode_chart(metadata[key].value)
            assert png.startswith(PNG_SIGNATURE) and len(png) < MAX_CHART_BYTES and image.size == (640, 300), key
        caption = decode_chart(evaluated.metadata["acceptance_by_position"].value)[2]
        assert abs(float(caption.split()[2].rstrip(":")) - tau) < 0.01, caption  # the bars sum to tau

    s3 = tiny_demo.store()
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
