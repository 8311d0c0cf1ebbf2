"""Backfills through the Dagster daemon, launched the way the UI launches them, against ``dagster dev``.

One ``dagster dev`` (webserver + daemon, SQLite instance, ``gpu`` pool at 1)
for the module, with ``DFLASH_PROMPT_SOURCE`` pointing at a JSONL of 20
prompts and ``DFLASH_STORE`` at a temp dir. A ``prompt_corpus`` run launched
as the launchpad does (``max_prompts_per_shard`` 8) registers three
``prompt_shards`` partitions. Then:

- ``prompt_source_sensor``, started over GraphQL as the UI's toggle does,
  ticks in the daemon and launches ``ingest_prompts_job``; re-ingesting the
  unchanged source adds nothing and registers no partition.
- The running instance has the ``gpu`` pool at 1 and the GPU stages hold it.
- ``launchPartitionBackfill`` of every partition of each selection in
  ``BACKFILL_SELECTIONS`` completes with every partition materialized by the
  backfill's own runs, each partition's metadata describing that partition,
  the number of runs the assets' ``BackfillPolicy`` implies, and every check
  of the selected assets evaluated.
- A partition whose blocking ``empty_response_ratio`` check fails (its
  completions are stubs) fails alone: the other partitions materialize and
  pass, its own downstream (``hidden_state_cache``) stays unmaterialized and
  its quality gate refuses it; every check is evaluated on every partition,
  and the GPU steps of the other partitions never overlap.

To cover a stage as it lands, add its selection to ``BACKFILL_SELECTIONS``.
A stage that generates runs on the embedded engine (the harness is the
local profile with no ``DFLASH_ENGINE_URLS``: each generating step starts
``transformers serve`` on the tiny target); ``tests/dagster_project/test_ui_browser.py``
backfills ``completions`` and ``prepare_data_job`` that way from the UI.
Assets downstream of ``tokenized_samples`` that are partitioned by
``prompt_shards`` join the blocking-check backfill by themselves.
"""

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pytest
from tests.dagster_dev import DagsterDev, dagster_dev, write_completions, write_prompt_source

from dagster_project.definitions import defs
from dagster_project.partitions import prompt_shards
from dagster_project.sensors import SOURCE_TAG
from dflash_assets.store.backends import LocalStore
from dflash_assets.tokenization.quality import QualityGateFailed, require_quality_gate

pytestmark = pytest.mark.slow

N_PROMPTS = 20
SHARD_SIZE = 8  # -> shards of 8, 8 and 4 prompts
BACKFILL_SELECTIONS = {
    "prompts": ["raw_prompts"],
    # "cpu_stages": ["raw_prompts", "completions", "tokenized_samples"] runs on the embedded engine, but whether
    # its blocking checks pass depends on the tiny target's answers: it is covered in test_ui_browser.py (this folder).
}
BACKFILL_TAG = "dagster/backfill"


@dataclass
class Harness:
    dev: DagsterDev
    store: LocalStore
    source: Path
    backfills: dict  # selection name -> backfill id, so a selection is backfilled once per module


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    root = tmp_path_factory.mktemp("backfill-daemon")
    source = write_prompt_source(root / "prompts.jsonl", N_PROMPTS)
    env = {"DFLASH_PROMPT_SOURCE": str(source), "DFLASH_STORE": str(root / "store"), "DFLASH_PROFILE": "local",
           "DFLASH_ENGINE_URLS": ""}
    with dagster_dev(root / "home", env=env) as dev:
        yield Harness(dev, LocalStore(root / "store"), source, {})


@pytest.fixture(scope="module")
def shards(harness) -> list[str]:
    """Ingest from the launchpad (small shards); the run registers the prompt_shards partitions."""
    config = {"ops": {"prompt_corpus": {"config": {"max_prompts_per_shard": SHARD_SIZE}}}}
    run_id = harness.dev.launch_run(["prompt_corpus"], config)
    assert harness.dev.wait_for_run(run_id) == "SUCCESS", harness.dev.log_tail()
    return harness.dev.instance().get_dynamic_partitions(prompt_shards.name)


def _run_backfill(harness: Harness, name: str, assets: list[str]) -> str:
    if name not in harness.backfills:
        backfill_id = harness.dev.launch_partition_backfill(assets, title=f"test {name}")
        harness.dev.wait_for_backfill(backfill_id, timeout_s=900)
        harness.backfills[name] = backfill_id
    return harness.backfills[name]


def _backfill_runs(instance, backfill_id):
    return instance.get_runs(filters=dg.RunsFilter(tags={BACKFILL_TAG: backfill_id}))


def _materializations(instance, asset: str, run_ids: set[str]) -> dict[str, dg.AssetMaterialization]:
    """Partition -> its materialization by one of ``run_ids`` (the latest, if several)."""
    records = instance.fetch_materializations(dg.AssetKey(asset), limit=10_000).records
    out: dict[str, dg.AssetMaterialization] = {}
    for record in reversed(records):  # oldest first: later ones win
        if record.run_id in run_ids:
            out[record.asset_materialization.partition] = record.asset_materialization
    return out


def _check_evaluations(instance, check_key: dg.AssetCheckKey, runs) -> dict[str, str]:
    """Partition -> status of ``check_key``'s evaluations in ``runs``.

    An evaluation carries its partition when the check spec is partitioned;
    otherwise it is mapped through its run (a single-partition run's tag).
    """
    by_run = {r.run_id: r for r in runs}
    out: dict[str, str] = {}
    history = instance.event_log_storage.get_asset_check_execution_history(check_key, limit=10_000)
    for record in reversed(history):  # oldest first: later ones win
        run = by_run.get(record.run_id)
        if run is None:
            continue
        evaluation = record.event.dagster_event.event_specific_data if record.event else None
        partition = getattr(evaluation, "partition", None) or run.tags.get("dagster/partition")
        assert partition, f"{check_key} evaluated in ranged run {run.run_id} without a partition"
        out[partition] = record.status.value
    return out


def _step_spans(instance, runs, step_key: str) -> list[tuple[float, float]]:
    """(start, end) of ``step_key`` in each of ``runs`` that executed it."""
    spans = []
    for run in runs:
        start = end = None
        for event in instance.all_logs(run.run_id):
            if not event.is_dagster_event or event.step_key != step_key:
                continue
            kind = event.dagster_event.event_type_value
            if kind == "STEP_START":
                start = event.timestamp
            elif kind in ("STEP_SUCCESS", "STEP_FAILURE"):
                end = event.timestamp
        if start is not None and end is not None:
            spans.append((start, end))
    return sorted(spans)


def _expected_runs(policy: dg.BackfillPolicy | None, partitions: int) -> int:
    if policy is None:
        return partitions
    if policy.max_partitions_per_run is None:  # single_run
        return 1
    return math.ceil(partitions / policy.max_partitions_per_run)


def test_sensor_ingests_through_the_daemon(harness, shards):
    """Turned on as in the UI, the sensor's first tick launches ingest_prompts_job; nothing new to register."""
    assert shards == ["shard-00000", "shard-00001", "shard-00002"]
    dev, instance = harness.dev, harness.dev.instance()
    assert dev.start_sensor("prompt_source_sensor") == "RUNNING"
    deadline = time.monotonic() + 300
    while not (runs := instance.get_runs(filters=dg.RunsFilter(job_name="ingest_prompts_job"))) or \
            not runs[0].is_finished:
        assert time.monotonic() < deadline, f"no finished ingest run from the sensor; log:\n{dev.log_tail()}"
        time.sleep(1)
    [run] = runs
    assert run.status == dg.DagsterRunStatus.SUCCESS, dev.log_tail()
    assert run.tags["dagster/sensor_name"] == "prompt_source_sensor"
    assert run.tags[SOURCE_TAG] == str(harness.source)
    [mat] = _materializations(instance, "prompt_corpus", {run.run_id}).values()
    assert mat.metadata["valid"].value == N_PROMPTS and mat.metadata["new_prompts"].value == 0
    assert instance.get_dynamic_partitions(prompt_shards.name) == shards


def test_instance_runs_gpu_stages_one_at_a_time(harness):
    """dagster.yaml's pools.default_limit = 1 is what the running instance enforces for pool 'gpu'."""
    data = harness.dev.graphql("{ instance { poolConfig { poolGranularity defaultPoolLimit } } }")
    assert data["instance"]["poolConfig"] == {"poolGranularity": "op", "defaultPoolLimit": 1}
    graph = defs.resolve_asset_graph()
    gpu_stages = {"hidden_state_cache", "drafter_checkpoint", "drafter_eval"}
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        if key.to_user_string() in gpu_stages:
            assert node.pools == {"gpu"}, f"{key.to_user_string()} must hold the 'gpu' pool"


@pytest.mark.parametrize("name", list(BACKFILL_SELECTIONS))
def test_backfill_of_every_partition(harness, shards, name):
    assets = BACKFILL_SELECTIONS[name]
    dev, instance = harness.dev, harness.dev.instance()
    backfill_id = _run_backfill(harness, name, assets)
    state = dev.backfill(backfill_id)
    assert state["status"] == "COMPLETED_SUCCESS", json.dumps(state)
    assert state["numPartitions"] == len(shards)

    runs = _backfill_runs(instance, backfill_id)
    assert runs and all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs)
    run_ids = {r.run_id for r in runs}
    graph = defs.resolve_asset_graph()
    for asset in assets:
        mats = _materializations(instance, asset, run_ids)
        assert set(mats) == set(shards), f"{asset}: materialized {sorted(mats)}"
        node = graph.get(dg.AssetKey(asset))
        if not any(p.to_user_string() in assets for p in node.parent_keys):  # a root of the selection
            asset_runs = [r for r in runs if dg.AssetKey(asset) in (r.asset_selection or set())]
            assert len(asset_runs) == _expected_runs(node.backfill_policy, len(shards)), node.backfill_policy
        for check_key in node.check_keys:  # every check of the asset, evaluated for every partition
            evaluated = _check_evaluations(instance, check_key, runs)
            assert set(evaluated) == set(shards), f"{check_key.to_user_string()}: {evaluated}"

    if "raw_prompts" in assets:  # each partition's metadata describes that partition, also in a ranged run
        mats = _materializations(instance, "raw_prompts", run_ids)
        for shard, mat in mats.items():
            table = harness.store.read_parquet(f"raw_prompts/{shard}.parquet")
            assert mat.metadata["num_prompts"].value == table.num_rows
        assert sorted(m.metadata["num_prompts"].value for m in mats.values()) == [4, 8, 8]


def _prompt_shard_descendants(asset: str) -> list[str]:
    graph = defs.resolve_asset_graph()
    out, todo = [], [dg.AssetKey(asset)]
    while todo:
        for child in sorted(graph.get(todo.pop()).child_keys):
            node = graph.get(child)
            if node.partitions_def == prompt_shards and child.to_user_string() not in out:
                out.append(child.to_user_string())
                todo.append(child)
    return out


def test_failed_blocking_check_stops_only_its_partition(harness, shards):
    dev, instance = harness.dev, harness.dev.instance()
    _run_backfill(harness, "prompts", BACKFILL_SELECTIONS["prompts"])  # raw prompts of every shard
    bad = shards[-1]
    for shard in shards:
        write_completions(harness.store, shard, stub=shard == bad)

    downstream = _prompt_shard_descendants("tokenized_samples")
    backfill_id = _run_backfill(harness, "samples", ["tokenized_samples", *downstream])
    state = dev.backfill(backfill_id)
    assert state["status"] == "COMPLETED_FAILED", json.dumps(state)

    runs = _backfill_runs(instance, backfill_id)
    failed = {r.tags.get("dagster/partition") for r in runs if r.status == dg.DagsterRunStatus.FAILURE}
    assert failed == {bad}, f"failed runs: {failed}"

    for check_key in defs.resolve_asset_graph().get(dg.AssetKey("tokenized_samples")).check_keys:
        assert set(_check_evaluations(instance, check_key, runs)) == set(shards), check_key.to_user_string()
    key = dg.AssetCheckKey(dg.AssetKey("tokenized_samples"), "empty_response_ratio")
    evaluated = _check_evaluations(instance, key, runs)
    assert evaluated == {s: ("FAILED" if s == bad else "SUCCEEDED") for s in shards}
    [record] = [r for r in instance.event_log_storage.get_asset_check_execution_history(key, limit=100)
                if r.run_id in {run.run_id for run in runs} and r.status.value == "FAILED"]
    meta = record.event.dagster_event.event_specific_data.metadata
    assert meta["ratio"].value > meta["threshold"].value

    run_ids = {r.run_id for r in runs}
    for asset in downstream:  # the failed partition's downstream never ran; the others did
        assert set(_materializations(instance, asset, run_ids)) == set(shards) - {bad}, asset
    gpu_stages = [a for a in downstream if "gpu" in defs.resolve_asset_graph().get(dg.AssetKey(a)).pools]
    for asset in gpu_stages:  # pool "gpu" at 1 (dagster.yaml): never two GPU steps at once
        spans = _step_spans(instance, runs, asset)
        assert len(spans) == len(shards) - 1
        assert all(prev_end <= start for (_, prev_end), (start, _) in zip(spans, spans[1:])), spans
    with pytest.raises(QualityGateFailed):
        require_quality_gate(harness.store, bad)
    for shard in set(shards) - {bad}:
        require_quality_gate(harness.store, shard)
