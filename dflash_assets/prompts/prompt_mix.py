"""Mixing prompt sources into one shard by weight.

A ``raw_prompts`` partition holds its corpus shard whole; another source (the target's self-generated prompts
of the same partition) joins it by weight relative to the corpus: weight ``w`` adds ``round(w * corpus rows)``
of its rows, its first ones (their order is the order they were generated and filtered in, so a rerun adds the
same ones). :func:`mix_by_weight` returns the mixed table in the corpus shard's schema and what each source gave.
Pure: reads and writes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa

__all__ = ["CORPUS", "SourceShare", "check_weights", "mix_by_weight"]

CORPUS = "corpus"


@dataclass(frozen=True)
class SourceShare:
    source: str
    weight: float
    wanted: int
    taken: int  # fewer than wanted when the source holds fewer new prompts


def check_weights(weights: Mapping[str, float], known: Sequence[str]) -> dict[str, float]:
    """``weights`` checked: every source known, no negative weight, the corpus's weight 1 (the unit)."""
    unknown = sorted(set(weights) - set(known) - {CORPUS})
    if unknown:
        raise ValueError(f"unknown prompt sources {unknown}: the mix takes {[CORPUS, *known]}")
    if any(w < 0 for w in weights.values()):
        raise ValueError(f"prompt source weights must be >= 0: {dict(weights)}")
    if weights.get(CORPUS, 1.0) != 1.0:
        raise ValueError(f"the corpus's weight is the unit (1.0), not {weights[CORPUS]}: weigh the other sources "
                         "against it")
    return {k: float(v) for k, v in weights.items() if k != CORPUS}


def mix_by_weight(corpus: pa.Table, shard: str, others: Sequence[tuple[str, pa.Table, float]]
                  ) -> tuple[pa.Table, list[SourceShare]]:
    """The corpus rows, then each other source's first ``round(weight * corpus rows)`` rows whose prompt id the
    mix does not hold yet, in the corpus table's schema (columns it lacks are null) with ``shard`` set."""
    tables, shares = [corpus], []
    seen = set(corpus.column("prompt_id").to_pylist())
    for source, table, weight in others:
        wanted = round(weight * corpus.num_rows)
        ids = table.column("prompt_id").to_pylist()
        keep = []
        for i, pid in enumerate(ids):
            if len(keep) >= wanted:
                break
            if pid not in seen:
                seen.add(pid)
                keep.append(i)
        picked = table.take(pa.array(keep, pa.int64()))
        columns = []
        for field in corpus.schema:
            if field.name == "shard":
                columns.append(pa.array([shard] * picked.num_rows, field.type))
            elif field.name in picked.column_names:
                columns.append(picked.column(field.name).cast(field.type))
            else:
                columns.append(pa.nulls(picked.num_rows, field.type))
        tables.append(pa.Table.from_arrays(columns, schema=corpus.schema))
        shares.append(SourceShare(source, weight, wanted, len(keep)))
    return pa.concat_tables(tables), shares
