"""The whole graph, end to end: `make demo`'s one run of the tiny target, read back from its console, its Dagster
instance and its store on S3 (moto's server on 127.0.0.1).

The session's one tiny demo (the `tiny_demo` fixture, tests/demo_run.py) runs `python -m dagster_project.demo
--target tiny` as a user does, with its store on S3: real parts throughout, the embedded ShareGPT file, the tiny
target served by `transformers serve`, the GPU stages launched through Dagster Pipes as subprocesses that reach
the store only through S3. Every test that reads it lives in this module: `make test`'s workers take a module
each (pytest-xdist's `--dist loadfile`), so the demo runs once per suite (tests/test_architecture.py holds
readers to this module). Here: the console is short and every check passes; every stage's output is in the
store; the preflight's report; the checkpoint's provenance and `dflash inspect`.
"""

import hashlib
import json
import re

import dagster as dg
import pytest

from tests.chart_png import MAX_CHART_BYTES, PNG_SIGNATURE, decode_chart
from tests.dagster_project.test_demo import STAGE_LINE, assert_quiet
from dagster_project.demo import TARGET_DEFAULTS
from dflash_assets.cli import main as cli_main
from dflash_assets.drafter.provenance import PROVENANCE_FILE
from dflash_assets.drafter.stages import preflight_key
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


@pytest.mark.slow
@pytest.mark.timeout(1700)  # the first reader of tiny_demo waits for the demo's run
def test_demo_passes_every_check_with_a_short_console(tiny_demo):
    done = tiny_demo.done
    console = tiny_demo.console
    assert done.returncode == 0, console
    assert_quiet(console)
    assert len(re.findall(r"^    Q: .+  A: .+", done.stdout, re.M)) == 2, done.stdout  # the target's first answers

    stages = [m.groups() for m in map(STAGE_LINE.match, done.stdout.splitlines()) if m]
    per_shard = [(p, a) for p, a, status, _ in stages if p.startswith("shard-")]
    assert {a for _, a in per_shard} == {"raw_prompts", "completions", "tokenized_samples", "hidden_state_cache"}
    assert len(per_shard) == 8 and all(status == "ok" for _, _, status, _ in stages), done.stdout
    assert [a for p, a, _, _ in stages if p == "demo-v1"] == ["drafter_checkpoint", "drafter_eval"]
    assert len(done.stdout.splitlines()) < 38, done.stdout  # the story, not the logs
    # the cost plan before any completions, against what the run measured (ratios not asserted: 2 shared cores)
    assert [a for p, a, _, _ in stages if p == ""] == ["prompt_corpus", "generation_plan"]
    for what, unit in (("completions wall time", "s"), ("cache bytes", "MB")):
        assert re.search(rf"plan vs run: {what} predicted [\d,.]+ {unit}, measured [\d,.]+ {unit} "
                         rf"\(predicted/measured \d+\.\d\d\)", done.stdout), done.stdout

    summary = done.stdout[done.stdout.index("\nSummary\n"):]
    assert re.search(r"shard-00000 +ok \d+ s +ok \d+ s +ok \d+ s +ok \d+ s +4/4 passed", summary), summary
    assert re.search(r"shard-00001 +ok \d+ s +ok \d+ s +ok \d+ s +ok \d+ s +4/4 passed", summary), summary
    checks = re.search(r"checks: (\d+)/(\d+) passed on 2 shards and recipe demo-v1; failed shards: none", summary)
    assert checks and checks[1] == checks[2] and int(checks[2]) >= 8, summary  # 4 per shard, the drafter's too
    assert re.search(r"tau \d\.\d{3}", summary) and "make ui" in summary and tiny_demo.store_uri in summary
    assert summary.rstrip().endswith("OK: every stage succeeded and every check passed.")

    # The console was quiet; the instance kept everything, Dagster's DEBUG events included.
    with tiny_demo.instance() as instance:
        runs = instance.get_runs()
        assert len(runs) == 5 and all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs)  # + generation_plan
        levels = {e.level for r in runs for e in instance.all_logs(r.run_id)}
        assert {10, 20} <= levels  # DEBUG and INFO
        evaluations = [e for r in runs for e in instance.all_logs(r.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)]
        assert len(evaluations) == int(checks[2]) and all(e.dagster_event.event_specific_data.passed
                                                          for e in evaluations)
        empty = [e.dagster_event.event_specific_data.metadata for e in evaluations
                 if e.dagster_event.event_specific_data.check_name == "empty_response_ratio"]
        # the tiny target's demo gate (TARGET_DEFAULTS): its empty answers depend on the kernels that built it
        assert len(empty) == 2 and all(float(getattr(m["threshold"], "value", m["threshold"])) == 0.10
                                       for m in empty), empty


@pytest.mark.slow
@pytest.mark.timeout(1700)  # the first reader of tiny_demo waits for the demo's run
def test_the_demo_recipe_passes_on_the_demo_target(tiny_demo):
    """The demo's own recipe (2 layers, block 8) and target (the tiny Qwen3.5-shaped one, 248K vocabulary), on the
    demo's own first shard: the session's tiny demo (the `tiny_demo` fixture) runs the preflight before it trains,
    and its report is in the store."""
    assert tiny_demo.done.returncode == 0, tiny_demo.console
    res = tiny_demo.store().read_json(preflight_key("demo-v1"))
    assert res["passed"] and res["tau"] >= 0.8 * res["tau_max"] and res["lossless"], res
    assert res["wall_s"] < 120, res


@pytest.mark.slow
@pytest.mark.timeout(1700)  # the first reader of tiny_demo waits for the demo's run
def test_the_demo_graph_publishes_provenance_and_passes_the_new_checks(tiny_demo, capsys, monkeypatch):
    assert tiny_demo.done.returncode == 0, tiny_demo.console
    with tiny_demo.instance() as instance:
        evaluations = [e.dagster_event.event_specific_data for r in instance.get_runs()
                       for e in instance.all_logs(r.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)]
        checks = {e.asset_check_key.name: e for e in evaluations}  # the drafter's checks: one recipe, demo-v1
        assert checks["decontamination"].passed and checks["serving_match"].passed, checks
        event = instance.get_latest_materialization_event(dg.AssetKey("drafter_checkpoint")).asset_materialization
        shown = event.metadata["provenance"].value
        assert shown["thinking"] is True and shown["partitions_trained"] == 1
        shards = sorted(instance.get_dynamic_partitions("prompt_shards"))

    store = tiny_demo.store()
    files = layout.drafter_checkpoint_files(store, "demo-v1")
    assert {"model.safetensors", "config.json", "train_metrics.json", PROVENANCE_FILE} <= set(files)
    doc = json.loads(store.read_bytes(files[PROVENANCE_FILE]))
    assert doc["partitions"]["shards"] == [shards[0]]
    assert doc["decontamination"]["passed"] is True
    assert doc["decontamination"]["eval_prompts"] == TARGET_DEFAULTS["tiny"]["shard_size"]  # the held-out shard
    (hashes,) = [v["config_hashes"] for v in doc["completions"].values()]
    (settings,) = [g["settings"] for g in hashes.values()]
    # the demo's run config, found by its hash
    assert settings is not None and settings["max_new_tokens"] == TARGET_DEFAULTS["tiny"]["max_new_tokens"]
    for name in ("model.safetensors", "config.json"):  # the provenance describes the files published with it
        assert doc["checkpoint_files"][name] == hashlib.sha256(store.read_bytes(files[name])).hexdigest()
    monkeypatch.setenv("AWS_ENDPOINT_URL", tiny_demo.endpoint)  # `dflash inspect` builds its own S3 client
    assert cli_main(["inspect", tiny_demo.store_uri, "--recipe", "demo-v1"]) == 0
    assert "decontamination: passed" in capsys.readouterr().out
