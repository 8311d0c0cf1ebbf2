"""The prompt corpus's index: shard names, one generation's index, reading it and committing the next one.

A generation of the corpus is a :class:`CorpusIndex` (shard -> staged object
and sha256, the assignment manifest's key, the sources seen, the run that
committed it). :func:`commit_corpus_index` commits generation N by *creating*
``prompt_corpus/commits/gen-<N>.json`` (exactly one run can) and then copies it
to ``prompt_corpus/index.json``; :func:`load_corpus_index` reads ``index.json``
and rolls forward through newer commit objects. :func:`collect_garbage` deletes
staged shards, manifests and commits no live ingest can need.

Reads the store's ``prompt_corpus/index.json``, commit objects and staged
shards; writes, atomically through the store (keys in
:mod:`dflash_assets.store.layout`), the commit object and ``index.json``, and
deletes old staged objects and commits.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

from dflash_assets.store import layout

__all__ = [
    "MANIFEST_SCHEMA",
    "ShardEntry",
    "CorpusIndex",
    "ConcurrentIngestError",
    "shard_name",
    "shard_number",
    "load_corpus_index",
    "commit_corpus_index",
    "collect_garbage",
    "corpus_prompt_count",
    "list_shard_keys",
    "read_corpus_shard",
]


MANIFEST_SCHEMA = pa.schema([
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("shard", pa.string(), nullable=False),
    pa.field("generation", pa.int32(), nullable=False),
])


def shard_name(n: int) -> str:
    return f"shard-{n:05d}"


_SHARD_RE = re.compile(r"shard-(\d{5,})")


def shard_number(key: str) -> int:
    m = _SHARD_RE.fullmatch(key)
    if not m:
        raise ValueError(f"not a shard key: {key!r}")
    return int(m.group(1))


@dataclass(frozen=True)
class ShardEntry:
    key: str  # staged object
    num_prompts: int
    sha256: str
    generation: int


@dataclass(frozen=True)
class CorpusIndex:
    """One generation of the corpus: what ``prompt_corpus/commits/gen-<N>.json`` (created once) and its copy
    ``prompt_corpus/index.json`` hold: generation, run, manifest key, shard -> staged object + sha256."""

    generation: int = 0
    manifest_key: str | None = None
    shards: dict[str, ShardEntry] = field(default_factory=dict)
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)
    run: str | None = None  # the ingest run that committed this generation

    def to_json(self) -> dict[str, Any]:
        return {
            "format": 1,
            "generation": self.generation,
            "run": self.run,
            "manifest_key": self.manifest_key,
            "shards": {k: asdict(v) for k, v in sorted(self.shards.items())},
            "sources": self.sources,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> CorpusIndex:
        if obj.get("format") != 1:
            raise ValueError(f"unknown prompt-corpus index format {obj.get('format')!r}")
        return cls(
            generation=int(obj["generation"]),
            manifest_key=obj["manifest_key"],
            shards={k: ShardEntry(**v) for k, v in obj["shards"].items()},
            sources=obj.get("sources", {}),
            run=obj.get("run"),
        )


def load_corpus_index(store: Any) -> CorpusIndex:
    """The newest committed generation: ``index.json``, rolled forward through any newer commit objects.

    ``index.json`` is written after the commit object, so it can lag (a crash
    in between) or, rarely, be set back by a slow writer; the commit objects
    are the truth and are never overwritten.
    """
    try:
        index = CorpusIndex.from_json(store.read_json(layout.corpus_index()))
    except FileNotFoundError:
        index = CorpusIndex()
    while True:
        try:
            obj = store.read_json(layout.corpus_commit(index.generation + 1))
        except FileNotFoundError:
            return index
        index = CorpusIndex.from_json(obj)


class ConcurrentIngestError(RuntimeError):
    """Another ingest committed the generation this one was building; nothing of this one was committed."""


def corpus_prompt_count(store: Any) -> int:
    """Prompts in the whole corpus, from the ingest's index (0 before the first ingest)."""
    return sum(entry.num_prompts for entry in load_corpus_index(store).shards.values())


def list_shard_keys(store: Any) -> list[str]:
    """Shard keys of the committed corpus, sorted (the ``prompt_shards`` partitions)."""
    return sorted(load_corpus_index(store).shards)


def read_corpus_shard(store: Any, shard_key: str, columns: list[str] | None = None) -> pa.Table:
    """The committed corpus's rows of one shard (what ``raw_prompts/<shard>`` holds once materialized), read
    without writing anything; the cost plan samples prompts from it before any ``raw_prompts`` run."""
    return store.read_parquet(load_corpus_index(store).shards[shard_key].key, columns=columns)


def commit_corpus_index(store: Any, index: CorpusIndex, *, based_on: CorpusIndex, source: str) -> None:
    """Commit ``index`` (generation N, built from ``based_on``): create its commit object, then copy it to
    ``index.json``.

    Raises :class:`ConcurrentIngestError` when another run created generation N first (nothing of this run
    is committed then). ``source`` names the ingested source in that message.
    """
    # The commit: generation N's index is created once; a run that finds it taken lost the race.
    if not store.create(layout.corpus_commit(index.generation), json.dumps(index.to_json(), indent=2).encode()):
        winner = load_corpus_index(store)
        raise ConcurrentIngestError(
            f"another ingest (run {winner.run or 'unknown'}) committed generation {index.generation} of the prompt "
            f"corpus at {store.uri} while this one (run {index.run}, source {source}) ran from generation "
            f"{based_on.generation}; nothing of this run was committed and its staged objects are removed. "
            "Run the ingest again: it starts from the new corpus. (Ingests of one store should run one at a time.)"
        )
    store.write_json(layout.corpus_index(), index.to_json())  # a copy for readers; may lag, see load_corpus_index


_KEEP_COMMITS = 16  # commit objects kept behind the newest (index.json rolls forward through them)


def collect_garbage(store: Any, current: CorpusIndex, previous: CorpusIndex) -> None:
    """Delete staged shards, manifests and commits that no live ingest can need.

    An unreferenced object of generation <= ``previous.generation`` belongs to
    a run that lost or died (that generation is committed by another run), so
    it goes; objects of newer generations may belong to an ingest still
    running (it will fail to commit and remove them itself) and stay. The
    previous generation's objects stay too, so that a partition run that read
    the old index can still finish. Commit objects more than ``_KEEP_COMMITS``
    (16) generations old go.
    """
    keep = {e.key for e in current.shards.values()} | {e.key for e in previous.shards.values()}
    keep |= {current.manifest_key, previous.manifest_key}
    for prefix in (layout.corpus_staged_prefix(), layout.corpus_manifest_prefix()):
        for key in store.list(prefix):
            gen = layout.corpus_key_generation(key)
            if key not in keep and gen is not None and gen <= previous.generation:
                store.delete(key)
    for key in store.list(layout.corpus_commits_prefix()):
        gen = layout.corpus_key_generation(key)
        if gen is not None and gen < current.generation - _KEEP_COMMITS:
            store.delete(key)
