"""Sensors: ``prompt_source_sensor`` re-ingests the prompt corpus when its source changes;
``target_refresh_sensor`` refreshes the chain after the target changed.

Each tick fingerprints the prompt source (the ingest's own default:
``$DFLASH_PROMPT_SOURCE``, else the embedded ShareGPT file) without reading it:
a local file's size and mtime (ns), an ``s3://`` object's ETag and size from
one HEAD request through the store's S3 client (same endpoint and credentials
as the store; boto3 reads them from the environment). When the fingerprint
differs from the one in the sensor's cursor, it requests one run of
``ingest_prompts_job`` (``prompt_corpus``), which registers the new
``prompt_shards`` partitions; the cursor then holds the new fingerprint, so
the sensor fires once per change. The run key carries a change counter and
the fingerprint, so a retried tick cannot launch the same ingest twice.

The first tick of a fresh sensor (no cursor) ingests: re-ingesting an
already-ingested source is idempotent (no new prompts, no new shards). A
missing source skips with the reason and leaves the cursor alone.

The sensor is off by default (turn it on in the UI under Automation, or
``dagster sensor start prompt_source_sensor``); it checks every 60 s.

``target_refresh_sensor`` (off by default; turning it on is the one action of a refresh) advances the refresh
that ``dflash_assets.drafter.refresh`` plans, one step per tick (every 60 s): per prompt shard whose
``completions`` / ``tokenized_samples`` / ``hidden_state_cache`` was materialized at another code version (the
target's fingerprint is in it), one run of ``prepare_data_job`` or ``hidden_states_job`` for that shard; then,
per drafter family with a promoted drafter, once the shards its promoted recipe trained on are fresh, it
registers the family's next recipe (``<family>-v<N+1>``, ``init_from: "promoted"``, the same shards) and, on the
next tick (once its ``drafter_recipes`` partition exists), runs ``refresh_drafter_job`` for it (warm start; the ``promotion`` check compares old and new tau on the same
held-out prompts). Run keys carry the target's fingerprint, the step and an attempt number, so a tick never
launches a step twice; a failed step is launched again (tag ``dflash/refresh_attempt``) at most
``max_attempts`` times, then the sensor waits and says so. Its cursor holds the fingerprint and the recipes it
registered; each tick logs what it requested and what it waits for, and skips with "refresh done" when nothing
is left.

Reads: the source's metadata (stat / HEAD); the instance's materializations and runs, the store's recipes and
promoted manifests. Writes: its cursor; the refresh recipe (``drafter_recipes/<name>.json``, with its
``drafter_recipes`` partition, requested in the tick's result).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import dagster as dg

from dagster_project.config import IngestConfig
from dagster_project.jobs import hidden_states_job, ingest_prompts_job, prepare_data_job, refresh_drafter_job
from dagster_project.partitions import drafter_recipes
from dagster_project.resources import StoreParam, TargetParam
from dflash_assets.store.backends import S3Store

__all__ = [
    "SourceFingerprint",
    "fingerprint_source",
    "build_prompt_source_sensor",
    "prompt_source_sensor",
    "build_target_refresh_sensor",
    "target_refresh_sensor",
    "REFRESH_TAG",
    "SOURCE_TAG",
    "SOURCE_VERSION_TAG",
]

SOURCE_TAG = "dflash/prompt_source"
SOURCE_VERSION_TAG = "dflash/prompt_source_version"


@dataclass(frozen=True)
class SourceFingerprint:
    """What identifies one version of a prompt source, without reading it."""

    uri: str
    version: str  # "mtime_ns=...": local file; "etag=...": S3 object
    size: int

    def digest(self) -> str:
        return hashlib.sha256(f"{self.uri}\0{self.version}\0{self.size}".encode()).hexdigest()[:16]


def fingerprint_source(uri: str, s3_client: Any = None) -> SourceFingerprint:
    """Fingerprint a local path (``file://`` ok) or an ``s3://bucket/key`` object; FileNotFoundError if absent."""
    if uri.startswith("s3://"):
        from botocore.exceptions import ClientError

        bucket, _, key = uri[len("s3://"):].partition("/")
        if not bucket or not key:
            raise ValueError(f"s3 URI needs a bucket and a key: {uri!r}")
        if s3_client is None:
            from dflash_assets.store.backends import s3_client as new_s3_client

            s3_client = new_s3_client()
        try:
            head = s3_client.head_object(Bucket=bucket, Key=key)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                raise FileNotFoundError(f"no source object {uri}") from e
            raise
        etag = head["ETag"].strip('"')
        return SourceFingerprint(uri, f"etag={etag}", int(head["ContentLength"]))
    path = uri[len("file://"):] if uri.startswith("file://") else uri
    st = os.stat(os.path.expanduser(path))  # FileNotFoundError when absent
    return SourceFingerprint(uri, f"mtime_ns={st.st_mtime_ns}", st.st_size)


def _parse_cursor(cursor: str | None) -> dict[str, Any]:
    if not cursor:
        return {}
    try:
        value = json.loads(cursor)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def build_prompt_source_sensor(
    name: str = "prompt_source_sensor",
    *,
    source_uri: str | None = None,
    ingest_config: Mapping[str, Any] | None = None,
    minimum_interval_seconds: int = 60,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
) -> dg.SensorDefinition:
    """A sensor that runs ``ingest_prompts_job`` once per change of the prompt source.

    ``source_uri``: what to watch; default the ingest's own default, resolved at
    each tick. ``ingest_config``: other ``IngestConfig`` fields for the run
    (e.g. ``{"max_prompts_per_shard": 256}``); the run always gets the watched
    ``source_uri``, so it reads what the sensor saw.
    """
    extra = dict(ingest_config or {})
    unknown = (set(extra) - set(IngestConfig.model_fields)) | ({"source_uri"} & set(extra))
    if unknown:
        raise ValueError(f"ingest_config: unknown or reserved fields {sorted(unknown)}")

    @dg.sensor(
        name=name,
        job=ingest_prompts_job,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description="Re-ingest the prompt corpus (prompt_corpus) when the prompt source changes "
        "(local size/mtime or S3 ETag); new shards become prompt_shards partitions.",
    )
    def _sensor(context: dg.SensorEvaluationContext, store: StoreParam) -> dg.RunRequest | dg.SkipReason:
        uri = source_uri or IngestConfig().resolved_source()
        opened = store.open() if uri.startswith("s3://") else None
        client = opened.client if isinstance(opened, S3Store) else None
        try:
            fp = fingerprint_source(uri, client)
        except FileNotFoundError as e:
            return dg.SkipReason(f"prompt source not found: {e}")
        seen = _parse_cursor(context.cursor)
        if seen.get("digest") == fp.digest():
            return dg.SkipReason(f"prompt source unchanged since change #{seen.get('changes', 0)}: {uri} ({fp.version})")
        changes = int(seen.get("changes", 0)) + 1
        context.update_cursor(json.dumps({**asdict(fp), "digest": fp.digest(), "changes": changes}, sort_keys=True))
        context.log.info(f"prompt source changed (#{changes}): {uri} {fp.version} size {fp.size}")
        return dg.RunRequest(
            run_key=f"prompt-source-{changes}-{fp.digest()}",
            run_config={"ops": {"prompt_corpus": {"config": {"source_uri": uri, **extra}}}},
            tags={SOURCE_TAG: uri[-255:], SOURCE_VERSION_TAG: f"{fp.version} size={fp.size}"[:255]},
        )

    return _sensor


prompt_source_sensor = build_prompt_source_sensor()


# -- target_refresh_sensor ------------------------------------------------------------------------------------------

REFRESH_TAG = "dflash/target_refresh"  # the target fingerprint the run refreshes for
REFRESH_STEP_TAG = "dflash/refresh_step"  # "<shard>/<stage>" or "drafter/<recipe>"
REFRESH_ATTEMPT_TAG = "dflash/refresh_attempt"
_STAGE_JOBS = {"prepare": prepare_data_job, "hidden_states": hidden_states_job}


def _latest_by_partition(instance: dg.DagsterInstance, asset: str) -> dict[str, tuple[str | None, float]]:
    """Partition -> (code version, timestamp) of the asset's latest materialization, in one scan of its records."""
    from dagster._core.definitions.data_version import CODE_VERSION_TAG

    out: dict[str, tuple[str | None, float]] = {}
    cursor = None
    while True:
        result = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset)), limit=1000,
                                                 cursor=cursor)  # newest first
        for record in result.records:
            mat = record.asset_materialization
            if mat is not None and mat.partition is not None and mat.partition not in out:
                out[mat.partition] = ((mat.tags or {}).get(CODE_VERSION_TAG), record.timestamp)
        if not result.has_more:
            return out
        cursor = result.cursor


def _refresh_runs(instance: dg.DagsterInstance, fingerprint: str) -> dict[str, list[dg.DagsterRun]]:
    """Step -> this refresh's runs of it (newest first)."""
    runs: dict[str, list[dg.DagsterRun]] = {}
    for run in instance.get_runs(filters=dg.RunsFilter(tags={REFRESH_TAG: fingerprint})):
        runs.setdefault(run.tags.get(REFRESH_STEP_TAG, ""), []).append(run)
    return runs


def build_target_refresh_sensor(
    name: str = "target_refresh_sensor",
    *,
    run_config: Mapping[str, Mapping[str, Any]] | None = None,
    max_attempts: int = 2,
    minimum_interval_seconds: int = 60,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
) -> dg.SensorDefinition:
    """A sensor that refreshes the chain after the target changed (see the module docstring).

    ``run_config``: job name -> run config of the runs it requests (e.g. smaller generations in a test);
    default the jobs' defaults. ``max_attempts``: launches of one step before the sensor stops retrying it.
    """
    configs = {k: dict(v) for k, v in (run_config or {}).items()}

    @dg.sensor(
        name=name,
        jobs=[prepare_data_job, hidden_states_job, refresh_drafter_job],
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description="After the target changed (a new revision, a fine-tune): regenerate the stale prompt shards "
        "(prepare_data_job, then hidden_states_job, per shard), then register the family's next recipe "
        "(init_from promoted) and train it (refresh_drafter_job: warm start, tau old vs new in the promotion "
        "check). One step per tick; logs what it waits for.",
    )
    def _sensor(context: dg.SensorEvaluationContext, store: StoreParam, target: TargetParam):
        from dflash_assets.drafter.promotion import read_promoted
        from dflash_assets.drafter.recipe import DrafterRecipe
        from dflash_assets.drafter.refresh import DRAFTER_ASSETS, SHARD_CHAIN, family_states, plan_refresh
        from dflash_assets.drafter.stages import load_recipe, save_recipe

        st, instance = store.open(), context.instance
        fingerprint = target.fingerprint()
        graph = context.repository_def.asset_graph
        current = {a: graph.get(dg.AssetKey(a)).code_version for a in (*SHARD_CHAIN, *DRAFTER_ASSETS)}
        seen = _parse_cursor(context.cursor)
        registered: dict[str, str] = dict(seen.get("recipes", {})) if seen.get("target") == fingerprint else {}
        materialized = {a: _latest_by_partition(instance, a) for a in SHARD_CHAIN}
        drafter = {a: _latest_by_partition(instance, a) for a in DRAFTER_ASSETS}

        states, trained = family_states(
            context.instance.get_dynamic_partitions(drafter_recipes.name), lambda name: load_recipe(st, name),
            lambda family: read_promoted(st, family), materialized, drafter, registered, context.log.warning)
        plan = plan_refresh(current, materialized, states, trained)

        runs = _refresh_runs(instance, fingerprint)
        requests, partition_requests, waiting = [], [], list(plan.waiting)

        def request(step: str, job: dg.UnresolvedAssetJobDefinition, partition: str,
                    assets: tuple[str, ...] | None = None) -> None:
            previous = runs.get(step, [])
            active = [r for r in previous if not r.is_finished]
            if active:
                waiting.append(f"{step}: run {active[0].run_id} is {active[0].status.value}")
                return
            failed = [r for r in previous if r.status != dg.DagsterRunStatus.SUCCESS]
            if len(failed) >= max_attempts:
                waiting.append(f"{step}: failed {len(failed)} times (last run {failed[0].run_id}); fix it and "
                               f"re-execute that run, or raise max_attempts")
                return
            attempt = len(previous) + 1  # a run key is used once: a step that ran and is still stale runs anew
            requests.append(dg.RunRequest(
                run_key=f"target-refresh-{fingerprint}-{step}-{attempt}", job_name=job.name, partition_key=partition,
                run_config=configs.get(job.name, {}),
                asset_selection=[dg.AssetKey(a) for a in assets] if assets else None,
                tags={REFRESH_TAG: fingerprint, REFRESH_STEP_TAG: step, REFRESH_ATTEMPT_TAG: str(attempt)}))

        for run in plan.shard_runs:
            request(f"{run.shard}/{run.stage}", _STAGE_JOBS[run.stage], run.shard, run.assets)
        for recipe in plan.register:
            save_recipe(st, DrafterRecipe.from_dict(recipe))
            if not instance.has_dynamic_partition(drafter_recipes.name, recipe["name"]):
                partition_requests.append(drafter_recipes.build_add_request([recipe["name"]]))
            family = DrafterRecipe.from_dict(recipe).family_name
            registered[family] = recipe["name"]
        for recipe_name in plan.train:
            request(f"drafter/{recipe_name}", refresh_drafter_job, recipe_name)

        for line in plan.lines():
            if not line.startswith("waiting:"):
                context.log.info(f"target {fingerprint}: {line}")
        for line in waiting:
            context.log.info(f"target {fingerprint}: waiting: {line}")
        context.update_cursor(json.dumps({"target": fingerprint, "recipes": registered}, sort_keys=True))
        if plan.done:
            refreshed = ", ".join(f"{f} by {r}" for f, r in sorted(plan.refreshed.items())) or "no promoted drafter"
            return dg.SkipReason(f"refresh done for target {fingerprint}: every shard fresh; {refreshed}")
        if not requests and not partition_requests:
            return dg.SkipReason(f"target {fingerprint}: waiting: " + "; ".join(waiting))
        return dg.SensorResult(run_requests=requests, dynamic_partitions_requests=partition_requests)

    return _sensor


target_refresh_sensor = build_target_refresh_sensor()
