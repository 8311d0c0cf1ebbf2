"""Prompt-corpus ingest, the driver: read a source, normalize, dedupe, quarantine, shard, commit.

:func:`ingest_prompt_source` reads a source (:mod:`dflash_assets.prompts.sources`),
normalizes each record (:mod:`dflash_assets.prompts.normalization`), drops exact
duplicates, quarantines bad records with a reason code
(:mod:`dflash_assets.prompts.quarantine`), assigns new prompts to shards
(:mod:`dflash_assets.prompts.shards`) and commits a new corpus index
(:mod:`dflash_assets.prompts.corpus`); it returns an :class:`IngestReport`.
Its docstring describes concurrent ingests, sharding and memory. Each shard then
becomes a ``raw_prompts`` partition through
:func:`dflash_assets.prompts.shards.materialize_prompt_shard` (Dagster runs the
two steps separately).

Reads: the source, and the store's ``prompt_corpus/`` index and manifest (and
the last shard, when it still has room). Writes, atomically through the store
(keys in :mod:`dflash_assets.store.layout`): ``prompt_corpus/`` staged shards,
assignment manifest, commit, ``index.json``, quarantine table and report.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import re
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_assets.prompts.config import IngestConfig
from dflash_assets.prompts.corpus import (
    MANIFEST_SCHEMA,
    CorpusIndex,
    ShardEntry,
    collect_garbage,
    commit_corpus_index,
    load_corpus_index,
    shard_name,
    shard_number,
)
from dflash_assets.prompts.normalization import Prompt, Rejection, normalize_record
from dflash_assets.prompts.quarantine import QuarantineWriter
from dflash_assets.prompts.shards import ShardBuilder
from dflash_assets.prompts.sources import SourceItem, SourceSummary, read_source, source_label
from dflash_assets.store import layout

# Re-exported for callers that import it from here (tests/planning/test_costs.py). Its home is
# dflash_assets.prompts.shards, as IngestConfig's (which the driver uses) is dflash_assets.prompts.config.
from dflash_assets.prompts.shards import materialize_prompt_shard  # noqa: F401,E402

__all__ = ["IngestReport", "NoValidPromptsError", "ingest_prompt_source"]


class NoValidPromptsError(ValueError):
    """An ingest found no valid prompt; the message gives the quarantine counts."""


@dataclass(frozen=True)
class IngestReport:
    source_uri: str
    source_name: str
    source_format: str
    compression: str
    generation: int
    records_read: int  # complete records (and unreadable lines/elements) read from the source
    valid: int  # unique valid prompts in the source (up to `limit`)
    duplicates: int  # valid records whose prompt_id was already seen in this source
    quarantined: dict[str, int]  # reason -> count; records_read == valid + duplicates + sum(quarantined)
    truncated: bool
    truncated_at_byte: int | None
    parse_error: str | None  # why reading stopped early (a cut or corrupt file: the file, codec and offset)
    json_arrays: int  # top-level JSON arrays read one after another (1 for a plain array file, 0 for JSONL/Parquet)
    limit_reached: bool
    new_prompts: int
    existing_prompts: int  # valid prompts already in the corpus
    kept_not_in_source: int  # corpus prompts this ingest did not see (they keep their shard)
    corpus_prompts: int
    shard_keys: list[str]
    shard_sizes: dict[str, int]
    new_shards: list[str]
    changed_shards: list[str]  # shards that existed before and gained prompts
    notes: dict[str, int]  # normalization counters (leading_assistant_dropped, user_turns_merged, ...)
    roles: dict[str, int]  # source role -> count over valid prompts
    quarantine_key: str
    seconds: float
    agentic_prompts: int = 0  # valid prompts with tools, tool calls or tool results
    damage: str | None = None  # cut | corrupt: the compressed file (or Parquet file) ends early or fails a check
    stopped_at_compressed_byte: int | None = None  # with damage: where reading stopped, in the file's own bytes
    # field -> records normalized into a prompt (duplicates too) that held it non-null but whose prompt does not
    # keep it: "model" (a record field), "conversations[].weight" (a turn field)
    unknown_fields: dict[str, int] = field(default_factory=dict)

    @property
    def quarantined_total(self) -> int:
        return sum(self.quarantined.values())

    @property
    def num_valid(self) -> int:
        return self.valid

    def to_metadata(self) -> dict[str, Any]:
        """Flat values for asset metadata (per-shard lists left out: ~900 shards for 914K prompts)."""
        sizes = list(self.shard_sizes.values())
        out: dict[str, Any] = {
            "source_uri": self.source_uri, "source_name": self.source_name,
            "source_format": self.source_format, "compression": self.compression,
            "generation": self.generation, "records_read": self.records_read, "valid": self.valid,
            "duplicates": self.duplicates, "quarantined_total": self.quarantined_total,
            "quarantined": self.quarantined, "truncated": self.truncated,
            "truncated_at_byte": self.truncated_at_byte, "parse_error": self.parse_error,
            "json_arrays": self.json_arrays,
            "limit_reached": self.limit_reached, "new_prompts": self.new_prompts,
            "existing_prompts": self.existing_prompts, "kept_not_in_source": self.kept_not_in_source,
            "corpus_prompts": self.corpus_prompts, "num_shards": len(sizes),
            "shard_size_min": min(sizes, default=0), "shard_size_max": max(sizes, default=0),
            "new_shards": len(self.new_shards), "changed_shards": ", ".join(self.changed_shards) or "none",
            "notes": self.notes, "roles": self.roles, "quarantine_key": self.quarantine_key,
            "seconds": self.seconds, "agentic_prompts": self.agentic_prompts,
            "source_damage": self.damage or "none", "stopped_at_compressed_byte": self.stopped_at_compressed_byte,
            "unknown_fields": self.unknown_fields,
        }
        return out

    @property
    def shards_to_materialize(self) -> list[str]:
        return sorted(self.new_shards + self.changed_shards)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def _safe_name(name: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")
    return name or "source"


def _default_source_name(source_uri: Any) -> str:
    label = source_label(source_uri).rstrip("/")
    base = label.rsplit("/", 1)[-1]
    for ext in (".gz", ".zst", ".zstd", ".json", ".jsonl", ".ndjson", ".parquet"):
        if base.lower().endswith(ext):
            base = base[: -len(ext)]
    return base


# --- ingest ----------------------------------------------------------------------


def ingest_prompt_source(source_uri: Any, store: Any, config: IngestConfig | None = None, *,
                         s3_client: Any = None) -> IngestReport:
    """Read, normalize, dedupe and quarantine a source; assign shards; commit the corpus index.

    ``source_uri``: a path, ``file://`` or ``s3://`` URI (read with ``s3_client``,
    else the store's client, else a new boto3 client), bytes or a binary stream.
    Returns the report; raises :class:`NoValidPromptsError` when nothing is valid
    (the quarantine table is still written, the corpus is left unchanged), and
    :class:`~dflash_assets.prompts.corpus.ConcurrentIngestError` when another
    ingest committed first (nothing of this one is committed; its staged objects
    are removed; run it again).

    Concurrent ingests: each run stages under keys carrying its own random run
    id, so no run overwrites another's objects. Generation N is committed by
    *creating* ``commits/gen-N.json`` (``Store.create``: a hard link locally,
    ``If-None-Match: *`` on S3), which exactly one run can do. Readers take
    ``index.json`` and roll forward through newer commit objects
    (:func:`~dflash_assets.prompts.corpus.load_corpus_index`), so a crash between the commit and ``index.json``
    loses nothing. The quarantine (rejected records of this ingest of the
    source: one row per record with reason, detail and raw JSON text truncated)
    and the report are written after the commit (the quarantine alone when
    nothing is valid); counts per reason are in the report. Old objects go by
    :func:`~dflash_assets.prompts.corpus.collect_garbage`.

    Damaged sources: a cut or corrupt compressed file (gzip, zstd) or a
    Parquet page that cannot be decoded keeps every record read before the
    damage; the report has ``truncated``, ``damage`` (``cut`` or ``corrupt``),
    ``stopped_at_compressed_byte`` and a ``parse_error`` naming the file. When
    nothing could be read, :class:`~dflash_assets.prompts.sources.SourceFormatError`
    is raised with the same words (such a source is never taken for an empty
    one). Fields a record holds that no prompt keeps are counted by name in
    ``unknown_fields``.

    Sharding: a prompt keeps its shard forever. New prompts, in source order,
    fill the highest-numbered shard up to ``max_prompts_per_shard``, then open
    new shards (``shard-00000``, ``shard-00001``, ...); a staged shard is
    rewritten only when it gains prompts. A shard that gains prompts is reported
    in ``changed_shards`` (its downstream partitions are stale);
    ``fill_last_shard=False`` never touches an existing shard. A prompt that is
    no longer in the source stays in its shard (the corpus only grows; counted
    as ``kept_not_in_source``); start a new store prefix to drop prompts.
    Lowering ``max_prompts_per_shard`` later leaves fuller existing shards as
    they are.

    Memory: rejected records go to a local Parquet file a row group at a time
    (``quarantine_rows_per_group``), uploaded once; one shard's rows are held
    while it fills; the dedupe set and the manifest hold a prompt id per prompt.
    """
    config = config or IngestConfig()
    quarantine = QuarantineWriter(source_name := _safe_name(config.source_name or _default_source_name(source_uri)),
                                  config.quarantine_raw_chars, config.quarantine_rows_per_group)
    run = uuid.uuid4().hex[:12]
    staged: list[str] = []  # objects this run wrote under staged/ and manifest/
    committed = False
    try:
        report = _ingest(source_uri, store, config, s3_client, source_name, run, quarantine, staged)
        committed = True
        return report
    finally:
        quarantine.close()
        if not committed:
            for key in staged:  # never another run's objects: these keys carry this run's id
                with contextlib.suppress(Exception):
                    store.delete(key)


def _ingest(source_uri: Any, store: Any, config: IngestConfig, s3_client: Any, source: str, run: str,
            quarantine: QuarantineWriter, staged: list[str]) -> IngestReport:
    """The steps of :func:`ingest_prompt_source`, in order: read the corpus, read and assign the source, stage
    the last shard and the manifest, commit, publish the quarantine, write the report, collect garbage."""
    t0 = time.perf_counter()
    index = load_corpus_index(store)
    generation = index.generation + 1
    old_manifest = store.read_parquet(index.manifest_key) if index.manifest_key else None
    in_corpus = set(old_manifest.column("prompt_id").to_pylist()) if old_manifest is not None else set()
    assign = _ShardAssigner.open(store, index, config, generation, run, staged)
    tally, summary = _read_and_assign(source_uri, store, config, s3_client, source, quarantine, in_corpus, assign)

    quarantine_key = layout.corpus_quarantine(source)
    if tally.valid == 0:
        quarantine.publish(store, quarantine_key)
        raise _no_valid_prompts(store, summary, tally, quarantine, quarantine_key)
    assign.flush()

    new_manifest = assign.manifest(old_manifest)
    manifest_key = layout.corpus_manifest(generation, run)
    staged.append(manifest_key)
    store.write_parquet(manifest_key, new_manifest)

    seconds = time.perf_counter() - t0
    sources = dict(index.sources)
    sources[source] = {"uri": summary.uri, "generation": generation, "valid": tally.valid,
                       "new_prompts": len(new_manifest) - (old_manifest.num_rows if old_manifest is not None else 0)}
    new_index = CorpusIndex(generation, manifest_key, assign.shards, sources, run)
    commit_corpus_index(store, new_index, based_on=index, source=source)  # raises ConcurrentIngestError
    quarantine.publish(store, quarantine_key)

    report = _report(summary, source, generation, tally, quarantine, assign, new_prompts=sources[source]["new_prompts"],
                     kept_not_in_source=len(in_corpus) - tally.existing, corpus_prompts=new_manifest.num_rows,
                     quarantine_key=quarantine_key, seconds=seconds)
    store.write_json(layout.corpus_report(source), report.as_dict())
    collect_garbage(store, new_index, index)
    return report


@dataclass
class _ShardAssigner:
    """New prompts -> shards: fills the highest-numbered shard (when ``fill_last_shard`` and it has room), then
    opens new ones; stages each shard that gained prompts under this run's keys and records its new entry."""

    store: Any
    generation: int
    run: str
    cap: int
    staged: list[str]  # objects this run wrote (removed if it does not commit)
    shards: dict[str, ShardEntry]  # the corpus's shards, then with this run's staged ones
    next_shard: int
    builder: ShardBuilder
    new_ids: list[str] = field(default_factory=list)
    new_shard_of: list[str] = field(default_factory=list)
    new_shards: list[str] = field(default_factory=list)
    changed_shards: list[str] = field(default_factory=list)  # shards that existed before and gained prompts

    @classmethod
    def open(cls, store: Any, index: CorpusIndex, config: IngestConfig, generation: int, run: str,
             staged: list[str]) -> _ShardAssigner:
        shards = dict(index.shards)
        cap = config.max_prompts_per_shard
        next_shard = max((shard_number(k) for k in shards), default=-1) + 1
        last = shard_name(next_shard - 1) if shards else None
        if last is not None and config.fill_last_shard and shards[last].num_prompts < cap:  # fill it first
            builder = ShardBuilder(last, store.read_parquet(shards[last].key), cap)
        else:
            builder = ShardBuilder(shard_name(next_shard), None, cap)
            next_shard += 1
        return cls(store, generation, run, cap, staged, shards, next_shard, builder)

    def add(self, p: Prompt, source: str, index: int) -> None:
        if self.builder.free <= 0:
            self.flush()
            self.builder = ShardBuilder(shard_name(self.next_shard), None, self.cap)
            self.next_shard += 1
        self.builder.add(p, source, index, self.generation)
        self.new_ids.append(p.prompt_id)
        self.new_shard_of.append(self.builder.shard)

    def flush(self) -> None:
        """Stage the current shard, if it gained prompts."""
        b = self.builder
        if not b.added:
            return
        table = b.table()
        data = _parquet_bytes(table)
        key = layout.corpus_staged_shard(self.generation, b.shard, self.run)
        self.staged.append(key)
        self.store.write_bytes(key, data)
        (self.changed_shards if b.shard in self.shards else self.new_shards).append(b.shard)
        self.shards[b.shard] = ShardEntry(key, table.num_rows, hashlib.sha256(data).hexdigest(), self.generation)

    def manifest(self, old_manifest: pa.Table | None) -> pa.Table:
        """The old manifest's rows, then one row per new prompt (its shard, this generation)."""
        new = pa.table({"prompt_id": self.new_ids, "shard": self.new_shard_of,
                        "generation": pa.array([self.generation] * len(self.new_ids), pa.int32())},
                       schema=MANIFEST_SCHEMA)
        self.new_ids, self.new_shard_of = [], []
        return new if old_manifest is None else pa.concat_tables([old_manifest.cast(MANIFEST_SCHEMA), new])


@dataclass
class _Tally:
    """What the read of a source counted."""

    records: int = 0
    valid: int = 0
    duplicates: int = 0
    existing: int = 0  # valid prompts already in the corpus
    agentic: int = 0
    limit_reached: bool = False
    notes: Counter[str] = field(default_factory=Counter)
    roles: Counter[str] = field(default_factory=Counter)
    unknown_fields: Counter[str] = field(default_factory=Counter)


def _read_and_assign(source_uri: Any, store: Any, config: IngestConfig, s3_client: Any, source: str,
                     quarantine: QuarantineWriter, in_corpus: set[str],
                     assign: _ShardAssigner) -> tuple[_Tally, SourceSummary]:
    """Read the source record by record: quarantine what cannot be read or normalized, count duplicates within the
    source, assign each new valid prompt a shard (until ``config.limit`` valid prompts)."""
    tally = _Tally()
    seen: set[str] = set()
    reader = read_source(source_uri, s3_client=s3_client, store=store,
                         max_raw_record_chars=config.max_raw_record_chars)
    with reader:
        item: SourceItem
        for item in reader:
            tally.records += 1
            if item.problem is not None:
                quarantine.add(item.index, item.problem, item.detail, raw=item.raw, raw_chars=item.raw_chars,
                               byte_offset=item.byte_offset)
                continue
            try:
                p = normalize_record(item.record, config, index=item.index)
            except RecursionError:  # a path the depth checks missed: one record must never stop the corpus
                p = Rejection("nested_too_deep", "nested too deeply to normalize (Python's recursion limit "
                                                 f"{sys.getrecursionlimit()})")
            if isinstance(p, Rejection):
                quarantine.add(item.index, p.reason, p.detail, record=item.record, byte_offset=item.byte_offset)
                continue
            tally.unknown_fields.update(p.unknown_fields)
            if p.prompt_id in seen:
                tally.duplicates += 1
                continue
            seen.add(p.prompt_id)
            tally.valid += 1
            tally.agentic += p.agentic_turns is not None
            tally.notes.update(p.notes)
            tally.roles.update(p.roles)
            if p.prompt_id in in_corpus:
                tally.existing += 1
            else:
                assign.add(p, source, item.index)
            if config.limit is not None and tally.valid >= config.limit:
                tally.limit_reached = True
                break
    return tally, reader.summary


def _no_valid_prompts(store: Any, summary: SourceSummary, tally: _Tally, quarantine: QuarantineWriter,
                      quarantine_key: str) -> NoValidPromptsError:
    """The error of an ingest that found no valid prompt: what was read, the quarantine counts, the damage."""
    counts = ", ".join(f"{k}={v}" for k, v in quarantine.counts.most_common()) or "none"
    why = f"{tally.records} records read; quarantined: {counts}"
    if summary.truncated:
        why += f"; source truncated at byte {summary.truncated_at_byte}"
    if summary.parse_error:
        why += f"; {summary.parse_error}"
    return NoValidPromptsError(
        f"no valid prompt in {summary.uri} ({summary.format}, {summary.compression}): {why}. "
        f"Rejected records are in {store.url(quarantine_key)}; the corpus is unchanged."
    )


def _report(summary: SourceSummary, source: str, generation: int, tally: _Tally, quarantine: QuarantineWriter,
            assign: _ShardAssigner, *, new_prompts: int, kept_not_in_source: int, corpus_prompts: int,
            quarantine_key: str, seconds: float) -> IngestReport:
    shards = assign.shards
    return IngestReport(
        source_uri=summary.uri,
        source_name=source,
        source_format=summary.format,
        compression=summary.compression,
        generation=generation,
        records_read=tally.records,
        valid=tally.valid,
        duplicates=tally.duplicates,
        quarantined=dict(sorted(quarantine.counts.items())),
        truncated=summary.truncated,
        truncated_at_byte=summary.truncated_at_byte,
        parse_error=summary.parse_error,
        json_arrays=summary.json_arrays,
        limit_reached=tally.limit_reached,
        new_prompts=new_prompts,
        existing_prompts=tally.existing,
        kept_not_in_source=kept_not_in_source,
        corpus_prompts=corpus_prompts,
        shard_keys=sorted(shards),
        shard_sizes={k: shards[k].num_prompts for k in sorted(shards)},
        new_shards=sorted(assign.new_shards),
        changed_shards=sorted(assign.changed_shards),
        notes=dict(sorted(tally.notes.items())),
        roles=dict(sorted(tally.roles.items())),
        quarantine_key=quarantine_key,
        seconds=round(seconds, 3),
        agentic_prompts=tally.agentic,
        damage=summary.damage,
        stopped_at_compressed_byte=summary.stopped_at_compressed_byte,
        unknown_fields=dict(sorted(tally.unknown_fields.items())),
    )
