"""Prompt shard tables: their schemas, building them during an ingest, and materializing one as a partition.

A shard table holds one row per prompt (:data:`PROMPT_SCHEMA`; with an agentic
prompt in it, :data:`AGENTIC_PROMPT_SCHEMA`, two more columns null for its
plain chats). The ingest fills shards with :class:`ShardBuilder` and stages
them; :func:`materialize_prompt_shard` copies one staged shard to
``raw_prompts/<shard>.parquet`` (a ``raw_prompts`` partition) after checking it
against the corpus index (other sources of the partition mixed in by weight, when
given), and returns its :class:`ShardStats`. Each partition reads only its own
staged shard, never the whole corpus (914K prompts are ~900 shards).

Reads the store's corpus index (:mod:`dflash_assets.prompts.corpus`) and one
staged shard; writes ``raw_prompts/<shard>.parquet`` atomically through the
store (key from :mod:`dflash_assets.store.layout`). ``ShardBuilder`` reads and
writes nothing (the ingest writes its table).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_assets.prompts.corpus import load_corpus_index
from dflash_assets.prompts.normalization import Prompt
from dflash_assets.store import layout

__all__ = ["PROMPT_SCHEMA", "AGENTIC_PROMPT_SCHEMA", "ShardStats", "ShardBuilder", "materialize_prompt_shard"]


PROMPT_SCHEMA = pa.schema([
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("shard", pa.string(), nullable=False),
    pa.field("system", pa.string()),
    pa.field("user_turns", pa.list_(pa.string()), nullable=False),
    pa.field("num_user_turns", pa.int32(), nullable=False),
    pa.field("prompt_chars", pa.int64(), nullable=False),  # chars of system + user turns
    pa.field("source", pa.string(), nullable=False),
    pa.field("source_id", pa.string(), nullable=False),  # the record's `id`, else "#<index>"
    pa.field("source_index", pa.int64(), nullable=False),  # position of the record in the source
    pa.field("category", pa.string(), nullable=False),  # the record's category field, else "unknown"
    pa.field("starts_mid_conversation", pa.bool_(), nullable=False),  # leading assistant turns dropped
    pa.field("ingest_generation", pa.int32(), nullable=False),  # the ingest that added the prompt
])

# A shard holding an agentic prompt: two more columns (null for its plain chats).
AGENTIC_PROMPT_SCHEMA = PROMPT_SCHEMA.append(pa.field("tools", pa.string())).append(
    pa.field("agentic_turns", pa.string()))


@dataclass(frozen=True)
class ShardStats:
    """What one ``raw_prompts`` partition holds; ``to_metadata()`` gives its fields for asset metadata."""

    shard: str
    key: str  # raw_prompts/<shard>.parquet
    num_prompts: int
    num_user_turns: int
    max_user_turns: int
    with_system: int
    starts_mid_conversation: int
    prompt_chars_mean: float
    prompt_chars_max: int
    sources: dict[str, int]
    categories: dict[str, int]
    sha256: str  # of the Parquet bytes: a data version for the partition
    generation: int  # the ingest generation that last changed this shard
    agentic_prompts: int = 0  # prompts with tools, tool calls or tool results

    def to_metadata(self) -> dict[str, Any]:
        """Flat values for asset metadata (the name every result type of the library uses)."""
        return asdict(self)


class ShardBuilder:
    """Columns of the rows being added to one shard."""

    def __init__(self, shard: str, existing: pa.Table | None, capacity: int):
        self.shard = shard
        if existing is not None:
            existing = existing.cast(AGENTIC_PROMPT_SCHEMA if "agentic_turns" in existing.column_names
                                     else PROMPT_SCHEMA)
        self.existing = existing
        self.free = capacity - (existing.num_rows if existing is not None else 0)
        self.cols: dict[str, list[Any]] = {f.name: [] for f in AGENTIC_PROMPT_SCHEMA}

    def add(self, p: Prompt, source: str, index: int, generation: int) -> None:
        c = self.cols
        c["prompt_id"].append(p.prompt_id)
        c["shard"].append(self.shard)
        c["system"].append(p.system)
        c["user_turns"].append(list(p.user_turns))
        c["num_user_turns"].append(len(p.user_turns))
        c["prompt_chars"].append(p.prompt_chars)
        c["source"].append(source)
        c["source_id"].append(p.source_id)
        c["source_index"].append(index)
        c["category"].append(p.category)
        c["starts_mid_conversation"].append(p.starts_mid_conversation)
        c["ingest_generation"].append(generation)
        c["tools"].append(p.tools)
        c["agentic_turns"].append(p.agentic_turns)
        self.free -= 1

    @property
    def added(self) -> int:
        return len(self.cols["prompt_id"])

    def table(self) -> pa.Table:
        """PROMPT_SCHEMA while the shard holds no agentic prompt (plain shards as before), else AGENTIC_PROMPT_SCHEMA."""
        old = self.existing
        agentic = (any(v is not None for v in self.cols["agentic_turns"])
                   or (old is not None and "agentic_turns" in old.column_names))
        schema = AGENTIC_PROMPT_SCHEMA if agentic else PROMPT_SCHEMA
        new = pa.table({f.name: self.cols[f.name] for f in schema}, schema=schema)
        if old is None:
            return new
        if agentic and "agentic_turns" not in old.column_names:
            for name in ("tools", "agentic_turns"):
                old = old.append_column(schema.field(name), pa.nulls(old.num_rows, pa.string()))
        return pa.concat_tables([old, new])


def materialize_prompt_shard(store: Any, shard_key: str, mix: Sequence[tuple[str, pa.Table, float]] = ()
                             ) -> tuple[pa.Table, ShardStats]:
    """Write ``raw_prompts/<shard_key>.parquet`` from the committed corpus; return its table and stats.

    ``mix``: other sources of this partition as (name, table, weight), added by weight
    (:func:`dflash_assets.prompts.prompt_mix.mix_by_weight`); a weight of 0 adds nothing.
    """
    index = load_corpus_index(store)
    entry = index.shards.get(shard_key)
    if entry is None:
        known = sorted(index.shards)
        span = f"{known[0]} .. {known[-1]}" if known else "none (run the ingest first)"
        raise KeyError(f"shard {shard_key!r} is not in the prompt corpus at {store.uri}; shards: {span}")
    data = store.read_bytes(entry.key)
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.sha256:
        raise ValueError(f"staged shard {entry.key} has sha256 {digest}, the index says {entry.sha256}")
    table = pq.read_table(pa.BufferReader(data))
    if table.num_rows != entry.num_prompts or set(table.column("shard").unique().to_pylist()) != {shard_key}:
        raise ValueError(f"staged shard {entry.key} does not hold {entry.num_prompts} rows of {shard_key}")
    others = [m for m in mix if m[2] > 0]
    if others:
        from dflash_assets.prompts.prompt_mix import mix_by_weight

        table, _ = mix_by_weight(table, shard_key, others)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression="zstd")
        data = sink.getvalue().to_pybytes()
        digest = hashlib.sha256(data).hexdigest()
    key = layout.raw_prompts(shard_key)
    store.write_bytes(key, data)
    return table, _shard_stats(table, shard_key, key, digest, entry.generation)


def _shard_stats(table: pa.Table, shard: str, key: str, digest: str, generation: int) -> ShardStats:
    import polars as pl

    n = table.num_rows
    df = pl.from_arrow(table.select(["num_user_turns", "prompt_chars", "starts_mid_conversation", "source", "category"]))
    turns, chars = pl.col("num_user_turns").cast(pl.Int64), pl.col("prompt_chars")
    r = df.select(turns=turns.sum(), max_turns=turns.max(), mid=pl.col("starts_mid_conversation").sum(),
                  chars_mean=chars.mean(), chars_max=chars.max()).row(0, named=True)

    def counts(col: str) -> dict[str, int]:
        """Prompts per value, most first (ties by value)."""
        vc = df.group_by(col).len().sort(["len", col], descending=[True, False], nulls_last=True)
        return dict(vc.iter_rows())

    return ShardStats(
        shard=shard,
        key=key,
        num_prompts=n,
        num_user_turns=int(r["turns"] or 0),
        max_user_turns=int(r["max_turns"] or 0),
        with_system=n - table.column("system").null_count,
        starts_mid_conversation=int(r["mid"] or 0),
        prompt_chars_mean=round(float(r["chars_mean"] or 0.0), 1),
        prompt_chars_max=int(r["chars_max"] or 0),
        sources=counts("source"),
        categories=counts("category"),
        sha256=digest,
        generation=generation,
        agentic_prompts=(n - table.column("agentic_turns").null_count) if "agentic_turns" in table.column_names else 0,
    )
