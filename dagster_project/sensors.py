"""Sensors: ``prompt_source_sensor`` re-ingests the prompt corpus when its source changes.

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

Reads: the source's metadata (stat / HEAD). Writes: nothing but its cursor.
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
from dagster_project.jobs import ingest_prompts_job
from dagster_project.resources import StoreParam
from dflash_assets.store.backends import S3Store

__all__ = [
    "SourceFingerprint",
    "fingerprint_source",
    "build_prompt_source_sensor",
    "prompt_source_sensor",
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
