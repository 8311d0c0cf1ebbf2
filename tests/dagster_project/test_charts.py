"""Charts in the UI's metadata: the numbers behind them, the PNGs, and what the assets attach.

The chart data functions are tested on numbers whose answer is known; the PNGs are decoded with
Pillow; the generation and tokenization assets are materialized through Dagster against a loopback
engine in SGLang's native shapes (30% stub answers, so both histograms have something to show).
"""

import io

import dagster as dg
import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from tests.chart_png import MAX_CHART_BYTES, PNG_SIGNATURE, decode_chart, has_color
from dagster_project.charts import HIGHLIGHT_COLOR, bar_chart_png, line_chart_png
from dagster_project.definitions import defs
from dagster_project.metadata import check_metadata, render_pipes_result
from dagster_project.resources import EngineFleetResource, StoreResource
from dflash_assets.chart_data import bin_labels, binned_counts, curve_points, share_at_least
from dflash_assets.generation.completions import response_length_histogram
from tests.support.sglang_loopback import LoopbackServer
from dflash_assets.store.backends import LocalStore
from dflash_assets.tokenization.quality import LOSS_TOKEN_BIN_EDGES, loss_token_histogram

# -- the numbers ---------------------------------------------------------------------------------------------


def test_binned_counts_put_edges_in_the_right_bins_and_sum_to_the_values():
    counts = binned_counts([0, 1, 7, 8, 15, 16, 4095, 4096, 10**6], LOSS_TOKEN_BIN_EDGES)
    assert list(counts) == bin_labels(LOSS_TOKEN_BIN_EDGES)
    assert counts["0"] == 1 and counts["1-7"] == 2 and counts["8-15"] == 2 and counts["16-31"] == 1
    assert counts["2048-4095"] == 1 and counts["4096+"] == 2
    values = np.random.default_rng(0).integers(0, 6000, 1234)
    assert sum(loss_token_histogram(values).values()) == 1234
    with pytest.raises(ValueError):
        binned_counts([-1], LOSS_TOKEN_BIN_EDGES)


def test_response_length_histogram_counts_every_turn_and_the_cap():
    turns = [[96, 12], [96], [], [0, 5, 95], None]
    table = pa.table({"completion_tokens": pa.array(turns, pa.list_(pa.int32()))})
    hist = response_length_histogram(table, max_new_tokens=96)
    assert sum(hist.values()) == 6  # every assistant turn, none of the empty rows
    assert hist["96+"] == 2 and hist["0"] == 1 and hist["1-11"] == 1 and hist["12-23"] == 1 and hist["84-95"] == 1
    assert sum(response_length_histogram(table).values()) == 6  # the fixed log bins without a cap


def test_curve_points_downsample_by_window_means():
    losses = np.random.default_rng(1).random(1003)
    points = curve_points(losses, max_points=200)
    assert len(points) == 200 and points[-1][0] == 1003 and points[0][0] >= 1
    steps = [0] + [p[0] for p in points]
    weights = np.diff(steps)
    assert np.average([p[1] for p in points], weights=weights) == pytest.approx(losses.mean())
    assert curve_points([3.0, 2.0, 1.0]) == [[1, 3.0], [2, 2.0], [3, 1.0]]
    assert curve_points([]) == []


def test_share_at_least_sums_to_tau():
    lengths = np.random.default_rng(2).integers(1, 9, 500)  # tokens per verification, block size 8
    counts = np.bincount(lengths, minlength=9).tolist()
    shares = share_at_least(counts)
    assert len(shares) == 8 and shares[0] == 1.0  # every verification produces the bonus token
    assert sum(shares) == pytest.approx(lengths.mean())
    assert all(a >= b for a, b in zip(shares, shares[1:]))
    assert share_at_least([0, 0, 0]) == [0.0, 0.0]


# -- the pictures --------------------------------------------------------------------------------------------


def test_bar_and_line_charts_are_small_pngs():
    bars = {"0": 3, "1-7": 40, "8-15": 2, "16-31": 9}
    plain = bar_chart_png(bars, title="t", xlabel="x", ylabel="y")
    red = bar_chart_png(bars, title="t", xlabel="x", ylabel="y", highlight=["1-7"])
    line = line_chart_png(list(range(1, 101)), list(np.linspace(5, 1, 100)), title="t", xlabel="x", ylabel="y")
    for png in (plain, red, line):
        assert png.startswith(PNG_SIGNATURE) and 2_000 < len(png) < MAX_CHART_BYTES
        assert Image.open(io.BytesIO(png)).size == (640, 300)
    assert has_color(Image.open(io.BytesIO(red)), HIGHLIGHT_COLOR)
    assert not has_color(Image.open(io.BytesIO(plain)), HIGHLIGHT_COLOR)


def test_check_metadata_has_no_numbers_to_plot():
    meta = check_metadata({"ratio": 0.0869565, "num_empty": 2, "passed_before": True, "examples": ["p1"]})
    assert not any(isinstance(v, (dg.IntMetadataValue, dg.FloatMetadataValue)) for v in meta.values())
    assert meta["ratio"].value == "0.0869565" and meta["num_empty"].value == "2"
    assert meta["passed_before"].value is True and meta["examples"].value == ["p1"]


def test_pipes_chart_data_becomes_charts_and_check_numbers_text():
    reported = dg.MaterializeResult(metadata={
        "final_loss": 1.5,
        "loss_curve": dg.MetadataValue.json([[1, 4.0], [2, 3.0], [3, 1.5]]),
        "accuracy_by_position": dg.MetadataValue.json([0.6, 0.4, 0.2]),
        "acceptance_by_position": dg.MetadataValue.json([1.0, 0.5, 0.25, 0.0]),
    })
    shown = render_pipes_result(reported)
    assert shown.metadata["final_loss"] == 1.5  # a series over checkpoints: stays a number
    for key in ("loss_curve", "accuracy_by_position", "acceptance_by_position"):
        png, image, _ = decode_chart(shown.metadata[key].value)
        assert len(png) < MAX_CHART_BYTES and image.size == (640, 300)
    assert "3 steps: loss 4.000 -> 1.500" in decode_chart(shown.metadata["loss_curve"].value)[2]
    assert decode_chart(shown.metadata["acceptance_by_position"].value)[2].startswith("tau = 1.750:")
    check = render_pipes_result(dg.AssetCheckResult(check_name="lossless", passed=True,
                                                    metadata={"num_mismatches": 0, "num_prompts": 4}))
    assert {k: v.value for k, v in check.metadata.items()} == {"num_mismatches": "0", "num_prompts": "4"}


# -- what the assets attach ----------------------------------------------------------------------------------


@pytest.fixture
def engine_with_stubs(tiny_dense_target):
    with LoopbackServer(model_path=str(tiny_dense_target), tokenizer_json=str(tiny_dense_target / "tokenizer.json"),
                        stub_ratio=0.3, reasoning_tokens=(24, 40), content_tokens=(20, 120)) as server:
        yield server


def test_generation_and_tokenization_carry_their_histograms_as_charts(engine_with_stubs, tmp_path):
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(f'{{"conversations": [{{"from": "human", "value": "Question {i}?"}}]}}\n'
                              for i in range(30)))
    resources = {**defs.resources, "store": StoreResource(uri=str(tmp_path / "store")),
                 "engines": EngineFleetResource(endpoints=[f"sglang:{engine_with_stubs.url}"], max_concurrency=8)}
    with dg.instance_for_test() as instance:
        dg.materialize(defs.assets, selection=["prompt_corpus"], instance=instance, resources=resources,
                       run_config={"ops": {"prompt_corpus": {"config": {"source_uri": str(source)}}}})
        (shard,) = instance.get_dynamic_partitions("prompt_shards")
        result = dg.materialize(
            defs.assets, selection=["raw_prompts", "completions", "tokenized_samples"], partition_key=shard,
            instance=instance, resources=resources, raise_on_error=False,
            run_config={"ops": {"completions": {"config": {"max_new_tokens": 128, "max_turns": 1}}}})
        store = LocalStore(tmp_path / "store")

        generated = result.asset_materializations_for_node("completions")[0].metadata
        png, image, caption = decode_chart(generated["response_length_histogram"].value)
        turns = store.read_parquet(f"completions/{shard}.parquet").column("completion_tokens").to_pylist()
        num_turns, at_cap = sum(len(t or []) for t in turns), sum(n == 128 for t in turns for n in (t or []))
        assert png.startswith(PNG_SIGNATURE) and len(png) < MAX_CHART_BYTES and image.size == (640, 300)
        assert caption.startswith(f"{num_turns} assistant turns; {at_cap} reached max_new_tokens = 128")
        assert at_cap > 0 and has_color(image, HIGHLIGHT_COLOR)  # turns cut at the cap show in red

        tokenized = result.asset_materializations_for_node("tokenized_samples")[0].metadata
        samples = store.read_parquet(f"tokenized_samples/{shard}.parquet")
        loss = samples.column("num_loss_tokens").to_numpy()
        png, image, caption = decode_chart(tokenized["loss_tokens_histogram"].value)
        assert png.startswith(PNG_SIGNATURE) and len(png) < MAX_CHART_BYTES and image.size == (640, 300)
        assert caption.startswith(f"{samples.num_rows} samples; {int((loss < 16).sum())} with fewer than 16")
        assert (loss < 16).any() and has_color(image, HIGHLIGHT_COLOR)  # the stubs show in red
        assert tokenized["samples"].value == samples.num_rows  # per-partition numbers stay numbers here
        assert not [k for k in tokenized if "histogram" in k and k != "loss_tokens_histogram"]  # drawn once

        evaluations = result.get_asset_check_evaluations()
        assert {e.check_name for e in evaluations} >= {"empty_response_ratio", "schema"}
        for evaluation in evaluations:  # nothing the UI would plot across partitions as one time series
            numeric = [k for k, v in evaluation.metadata.items()
                       if isinstance(v, (dg.IntMetadataValue, dg.FloatMetadataValue))]
            assert numeric == [], (evaluation.check_name, numeric)
        empty = next(e for e in evaluations if e.check_name == "empty_response_ratio")
        assert float(empty.metadata["ratio"].value) == pytest.approx(((loss < 16) | samples.column(
            "answer_empty").to_numpy(zero_copy_only=False)).mean(), abs=1e-6)
