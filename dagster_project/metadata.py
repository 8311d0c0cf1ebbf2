"""Turning library statistics into Dagster metadata the UI renders well."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg


def to_metadata(values: Mapping[str, Any]) -> dict[str, dg.MetadataValue]:
    """ints -> int, floats -> float, dicts -> markdown tables/JSON, strings -> text (markdown if tabular)."""
    out: dict[str, dg.MetadataValue] = {}
    for key, value in values.items():
        if isinstance(value, bool):
            out[key] = dg.MetadataValue.bool(value)
        elif isinstance(value, int):
            out[key] = dg.MetadataValue.int(value)
        elif isinstance(value, float):
            out[key] = dg.MetadataValue.float(value)
        elif isinstance(value, Mapping):
            out[key] = dg.MetadataValue.md(markdown_counts(value)) if value else dg.MetadataValue.json({})
        elif isinstance(value, str) and value.lstrip().startswith("|"):
            out[key] = dg.MetadataValue.md(value)
        elif isinstance(value, str):
            out[key] = dg.MetadataValue.text(value)
        elif value is None:
            continue
        else:
            out[key] = dg.MetadataValue.json(value)
    return out


def markdown_counts(counts: Mapping[str, Any], key_name: str = "key", value_name: str = "value") -> str:
    lines = [f"| {key_name} | {value_name} |", "| --- | ---: |"]
    lines += [f"| {k} | {v} |" for k, v in counts.items()]
    return "\n".join(lines)


def preview_table(table, columns: Sequence[str], rows: int = 5, width: int = 80) -> dg.MetadataValue:
    """A small markdown preview of a pyarrow table (strings cut to ``width``)."""
    cols = [c for c in columns if c in table.column_names]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for row in table.slice(0, rows).select(cols).to_pylist():
        cells = []
        for c in cols:
            text = str(row[c]).replace("\n", " ").replace("|", "\\|")
            cells.append(text[:width] + ("…" if len(text) > width else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return dg.MetadataValue.md("\n".join(lines))
