"""Stage jobs and the prompt source sensor, against the real definitions and a real instance.

Jobs: the stage jobs split the asset graph (every asset in exactly one job,
one partitions definition per job, the ingest kept out of the partitioned
CPU job) and ``prepare_data_job`` runs a partition. Sensor: through
``build_sensor_context`` on a real (temporary) instance, for a local file and
for an object on a moto-served S3, it fires once per change and skips
otherwise; its run request, executed as ``ingest_prompts_job``, registers the
new shards as partitions.
"""

import json

import dagster as dg
import pytest

from dagster_project.definitions import defs
from dagster_project.jobs import ALL_JOBS, CPU_GROUPS, DRAFTER_GROUP, HIDDEN_STATES_GROUP, HOST_KIND_TAG
from dagster_project.partitions import prompt_shards
from dagster_project.resources import StoreResource
from dagster_project.sensors import (
    SOURCE_TAG,
    build_prompt_source_sensor,
    fingerprint_source,
    prompt_source_sensor,
)


@pytest.fixture
def instance():
    with dg.instance_for_test() as inst:
        yield inst


def _job_keys(definitions: dg.Definitions, name: str) -> set[str]:
    job = definitions.resolve_job_def(name)
    return {k.to_user_string() for k in job.asset_layer.executable_asset_keys}


def _prompts(path, n, start=0, word="question"):
    with open(path, "a") as f:
        for i in range(start, start + n):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"{word} {i}"}]}) + "\n")


def _tick(sensor, instance, cursor, store):
    context = dg.build_sensor_context(instance=instance, cursor=cursor, resources={"store": store})
    return sensor.evaluate_tick(context)


# --- jobs ---------------------------------------------------------------------------


def test_stage_jobs_split_the_graph():
    graph = defs.resolve_asset_graph()
    all_keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    by_job = {job.name: _job_keys(defs, job.name) for job in ALL_JOBS}

    union = set().union(*by_job.values())
    assert union == all_keys, f"assets in no stage job (give them a stage group): {sorted(all_keys - union)}"
    assert sum(len(keys) for keys in by_job.values()) == len(all_keys), f"an asset is in two jobs: {by_job}"

    assert by_job["ingest_prompts_job"] == {"prompt_corpus"}
    cpu = {k for k in graph.get_all_asset_keys() if graph.get(k).group_name in CPU_GROUPS}
    per_shard = {k.to_user_string() for k in cpu if graph.get(k).partitions_def == prompt_shards}
    assert by_job["prepare_data_job"] == per_shard and "raw_prompts" in per_shard
    corpus_level = {k.to_user_string() for k in cpu if not graph.get(k).is_partitioned} - {"prompt_corpus"}
    assert by_job["plan_generation_job"] == corpus_level
    for name, group in (("hidden_states_job", HIDDEN_STATES_GROUP), ("drafter_job", DRAFTER_GROUP)):
        in_group = {k.to_user_string() for k in graph.get_all_asset_keys() if graph.get(k).group_name == group}
        assert by_job[name] == in_group
        assert all(graph.get(dg.AssetKey(k)).pools == {"gpu"} for k in in_group), f"{name}: GPU stages hold pool 'gpu'"

    for job in ALL_JOBS:  # one partitions definition per job: the assets' own
        job_def = defs.resolve_job_def(job.name)
        parts = {repr(graph.get(dg.AssetKey(k)).partitions_def) for k in by_job[job.name]}
        assert len(parts) <= 1, f"{job.name} mixes partitions definitions: {parts}"
        if by_job[job.name] and parts != {"None"}:
            assert job_def.partitions_def is not None
        assert job_def.tags[HOST_KIND_TAG] == ("gpu" if job.name in ("hidden_states_job", "drafter_job") else "cpu")


def test_prepare_data_job_runs_one_partition(instance, tmp_path):
    source = tmp_path / "prompts.jsonl"
    _prompts(source, 5)
    store = StoreResource(uri=str(tmp_path / "store"))
    local = dg.Definitions(assets=list(defs.assets), jobs=ALL_JOBS, resources={**defs.resources, "store": store})

    ingest = local.resolve_job_def("ingest_prompts_job").execute_in_process(
        instance=instance,
        run_config={"ops": {"prompt_corpus": {"config": {"source_uri": str(source), "max_prompts_per_shard": 2}}}},
    )
    assert ingest.success
    shards = instance.get_dynamic_partitions("prompt_shards")
    assert len(shards) == 3

    result = local.resolve_job_def("prepare_data_job").execute_in_process(
        instance=instance, partition_key=shards[1], asset_selection=[dg.AssetKey("raw_prompts")]
    )
    assert result.success
    assert result.dagster_run.tags[HOST_KIND_TAG] == "cpu"
    [mat] = result.asset_materializations_for_node("raw_prompts")
    assert mat.partition == shards[1] and mat.metadata["num_prompts"].value == 2
    assert instance.get_materialized_partitions(dg.AssetKey("raw_prompts")) == {shards[1]}


# --- the sensor ----------------------------------------------------------------------


def test_sensor_is_wired_to_the_ingest_job():
    sensor = defs.resolve_sensor_def("prompt_source_sensor")
    assert sensor.job_name == "ingest_prompts_job"
    assert sensor.default_status == dg.DefaultSensorStatus.STOPPED
    with pytest.raises(ValueError, match="source_uri"):
        build_prompt_source_sensor(ingest_config={"source_uri": "x"})
    with pytest.raises(ValueError, match="max_prompt_per_shard"):
        build_prompt_source_sensor(ingest_config={"max_prompt_per_shard": 2})  # typo


def test_sensor_fires_once_per_change_of_a_local_file(instance, tmp_path, monkeypatch):
    source = tmp_path / "prompts.jsonl"
    _prompts(source, 3)
    monkeypatch.setenv("DFLASH_PROMPT_SOURCE", str(source))  # the ingest's default, resolved at each tick
    store = StoreResource(uri=str(tmp_path / "store"))

    first = _tick(prompt_source_sensor, instance, None, store)
    [request] = first.run_requests
    assert request.run_config == {"ops": {"prompt_corpus": {"config": {"source_uri": str(source)}}}}
    assert request.tags[SOURCE_TAG] == str(source)
    assert json.loads(first.cursor)["changes"] == 1

    again = _tick(prompt_source_sensor, instance, first.cursor, store)
    assert not again.run_requests and "unchanged" in again.skip_message

    _prompts(source, 2, start=3)  # a real change: size and mtime move
    changed = _tick(prompt_source_sensor, instance, again.cursor or first.cursor, store)
    [request2] = changed.run_requests
    assert request2.run_key != request.run_key
    assert json.loads(changed.cursor)["changes"] == 2
    assert not _tick(prompt_source_sensor, instance, changed.cursor, store).run_requests

    source.unlink()
    gone = _tick(prompt_source_sensor, instance, changed.cursor, store)
    assert not gone.run_requests and "not found" in gone.skip_message
    assert gone.cursor in (None, changed.cursor)  # a missing source does not move the cursor


def test_sensor_fires_once_per_change_of_an_s3_object(instance, s3_store, moto_endpoint):
    client = s3_store.client
    uri = f"s3://{s3_store.bucket}/sources/prompts.jsonl"
    body = b'{"messages": [{"role": "user", "content": "hello"}]}\n'
    client.put_object(Bucket=s3_store.bucket, Key="sources/prompts.jsonl", Body=body)
    sensor = build_prompt_source_sensor(source_uri=uri)
    store = StoreResource(uri=s3_store.uri, endpoint_url=moto_endpoint)

    first = _tick(sensor, instance, None, store)
    assert len(first.run_requests) == 1
    assert json.loads(first.cursor)["version"].startswith("etag=")

    client.put_object(Bucket=s3_store.bucket, Key="sources/prompts.jsonl", Body=body)  # same bytes: same ETag
    same = _tick(sensor, instance, first.cursor, store)
    assert not same.run_requests and "unchanged" in same.skip_message

    client.put_object(Bucket=s3_store.bucket, Key="sources/prompts.jsonl", Body=body + body.replace(b"hello", b"bye"))
    changed = _tick(sensor, instance, first.cursor, store)
    assert len(changed.run_requests) == 1
    assert json.loads(changed.cursor)["size"] == 2 * len(body) - 2

    with pytest.raises(FileNotFoundError):
        fingerprint_source(f"s3://{s3_store.bucket}/sources/missing.jsonl", client)


def test_sensor_run_registers_new_shards_once_per_change(instance, tmp_path):
    """Sensor tick -> its run request executed as ingest_prompts_job on the same instance -> partitions."""
    source = tmp_path / "prompts.jsonl"
    _prompts(source, 5)
    store = StoreResource(uri=str(tmp_path / "store"))
    sensor = build_prompt_source_sensor(source_uri=str(source), ingest_config={"max_prompts_per_shard": 2})
    local = dg.Definitions(assets=list(defs.assets), jobs=ALL_JOBS, sensors=[sensor],
                           resources={**defs.resources, "store": store})

    def tick_and_run(cursor):
        data = _tick(local.resolve_sensor_def(sensor.name), instance, cursor, store)
        for request in data.run_requests:
            job = local.resolve_job_def(request.job_name or sensor.job_name)
            assert job.name == "ingest_prompts_job"
            assert job.execute_in_process(run_config=request.run_config, instance=instance, tags=request.tags).success
        return data

    first = tick_and_run(None)
    assert len(first.run_requests) == 1
    assert instance.get_dynamic_partitions("prompt_shards") == ["shard-00000", "shard-00001", "shard-00002"]
    assert not tick_and_run(first.cursor).run_requests  # nothing changed: no run

    _prompts(source, 4, start=5, word="new question")  # 9 prompts: the last shard fills, two more
    second = tick_and_run(first.cursor)
    assert len(second.run_requests) == 1
    assert instance.get_dynamic_partitions("prompt_shards") == [f"shard-{i:05d}" for i in range(5)]
    ingest_runs = instance.get_runs(filters=dg.RunsFilter(job_name="ingest_prompts_job"))
    assert len(ingest_runs) == 2 and all(r.tags[SOURCE_TAG] == str(source) for r in ingest_runs)
