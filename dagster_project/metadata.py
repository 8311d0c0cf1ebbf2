"""Turning library statistics into Dagster metadata the UI renders well; reads and writes nothing.

- ``to_metadata``: a materialization's values, from the ``to_metadata()`` dict every result type of the
  library returns (one name for all of them). Numbers stay numbers (``int``/``float``): the UI plots them per
  partition, or over time for a series such as one loss or tau per checkpoint.
- ``check_metadata``: an asset check's values. The UI plots a check's numeric metadata as one line over time,
  joining every partition's result as if it were a time series, so numbers become text here.
- ``table_metadata``: Dagster's table keys (column schema, row count) of a partition's Parquet table.
- ``chart``: a PNG chart embedded in Markdown (``dagster_project.charts``): histograms and curves are pictures.
- ``render_pipes_result``: the same for what a GPU-host stage reported through Pipes (chart data as JSON).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import dagster as dg
import numpy as np
import pyarrow as pa

from dagster_project.charts import bar_chart_png, line_chart_png, markdown_image
from dflash_assets.tokenization.quality import LOSS_TOKEN_BIN_EDGES, loss_token_histogram


def to_metadata(values: Mapping[str, Any], *, numbers_as_text: bool = False) -> dict[str, dg.MetadataValue]:
    """bools -> bool, ints -> int, floats -> float (text with ``numbers_as_text``), dicts -> markdown tables,
    strings -> text (markdown when tabular), lists -> JSON; None is left out."""
    out: dict[str, dg.MetadataValue] = {}
    for key, value in values.items():
        if isinstance(value, bool):
            out[key] = dg.MetadataValue.bool(value)
        elif isinstance(value, (int, float)) and numbers_as_text:
            out[key] = dg.MetadataValue.text(str(value) if isinstance(value, int) else f"{value:.6g}")
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


def check_metadata(values: Mapping[str, Any]) -> dict[str, dg.MetadataValue]:
    """An asset check's metadata: as ``to_metadata``, with numbers as text (never plotted across partitions)."""
    return to_metadata(values, numbers_as_text=True)


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


def arrow_type_name(t: pa.DataType) -> str:
    """An Arrow type as the catalog shows it: ``list<struct<role: string, ...>>``, whatever a list's child field
    is called (Arrow writes ``item``, a Parquet file read back ``element``)."""
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"list<{arrow_type_name(t.value_type)}>"
    if pa.types.is_struct(t):
        return "struct<" + ", ".join(f"{f.name}: {arrow_type_name(f.type)}" for f in t) + ">"
    return str(t)


def table_metadata(table) -> dict[str, dg.MetadataValue]:
    """Dagster's table keys for one partition's Parquet table (a pyarrow Table), so the catalog and lineage show
    its columns: ``dagster/column_schema`` (each column's Arrow type and nullability) and ``dagster/row_count``
    with ``dagster/partition_row_count`` (both the partition's rows: a partition is one Parquet file)."""
    columns = [dg.TableColumn(f.name, arrow_type_name(f.type),
                              constraints=dg.TableColumnConstraints(nullable=f.nullable)) for f in table.schema]
    rows = dg.MetadataValue.int(table.num_rows)
    return {"dagster/column_schema": dg.MetadataValue.table_schema(dg.TableSchema(columns=columns)),
            "dagster/row_count": rows, "dagster/partition_row_count": rows}


def chart(title: str, png: bytes, caption: str = "") -> dg.MetadataValue:
    """A chart as Markdown metadata: the PNG inline (a data URI), with a one-line caption of its numbers."""
    return dg.MetadataValue.md(markdown_image(title, png, caption))


# -- the charts of this project's assets ---------------------------------------------------------------------


def loss_tokens_chart(num_loss_tokens: Sequence[int], min_loss_tokens: int) -> dg.MetadataValue:
    """Samples per loss-mask sum; bins that start below ``min_loss_tokens`` (stubs for ``empty_response_ratio``)
    in red, with the exact number of stub samples in the caption."""
    histogram = loss_token_histogram(num_loss_tokens)
    stub_bins = [label for label, lo in zip(histogram, LOSS_TOKEN_BIN_EDGES) if lo < min_loss_tokens]
    stubs = int((np.asarray(num_loss_tokens) < min_loss_tokens).sum())
    png = bar_chart_png(histogram, title=f"Loss-mask sum per sample ({len(num_loss_tokens)} samples)",
                        xlabel="supervised tokens per sample", ylabel="samples", highlight=stub_bins)
    return chart("loss-mask sum histogram", png, f"{len(num_loss_tokens)} samples; {stubs} with fewer than "
                 f"{min_loss_tokens} supervised tokens (red bins: stubs for empty_response_ratio).")


def response_length_chart(histogram: Mapping[str, int], max_new_tokens: int | None = None) -> dg.MetadataValue:
    """Assistant turns per generated-token count; with ``max_new_tokens``, the last bin (turns cut at the cap,
    the histogram of ``response_length_histogram(table, max_new_tokens)``) in red."""
    total = sum(histogram.values())
    at_cap = list(histogram)[-1:] if max_new_tokens else []
    png = bar_chart_png(histogram, title=f"Generated tokens per assistant turn ({total} turns)",
                        xlabel="generated tokens", ylabel="assistant turns", highlight=at_cap)
    caption = f"{total} assistant turns" + (
        f"; {histogram[at_cap[0]]} reached max_new_tokens = {max_new_tokens} (red)." if at_cap else ".")
    return chart("response length histogram", png, caption)


def loss_curve_chart(points: Sequence[Sequence[float]]) -> dg.MetadataValue:
    """Training loss over steps, from ``[step, mean loss]`` points."""
    steps, losses = [p[0] for p in points], [p[1] for p in points]
    png = line_chart_png(steps, losses, title="Training loss", xlabel="step", ylabel="loss")
    caption = f"{int(steps[-1])} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}." if points else "no steps."
    return chart("training loss curve", png, caption)


def tau_while_training_chart(points: Sequence[Sequence[float]]) -> dg.MetadataValue:
    """The held-out tau estimate at each evaluation while training, from ``[step, tau]`` points; the best (the
    first highest, the checkpoint marked best) in red."""
    steps, taus = [p[0] for p in points], [p[1] for p in points]
    best = max(range(len(taus)), key=lambda i: (taus[i], -i)) if points else None
    mark = (steps[best], taus[best], f"best: step {int(steps[best])}, tau {taus[best]:.3f}") if points else None
    png = line_chart_png(steps, taus, title="tau while training (held-out, teacher-forced)", xlabel="step",
                         ylabel="expected tau", mark=mark)
    caption = (f"{len(points)} evaluations: tau {taus[0]:.3f} -> {taus[-1]:.3f}, best {taus[best]:.3f} at step "
               f"{int(steps[best])}." if points else "no estimate while training.")
    return chart("tau while training", png, caption)


def accuracy_by_position_chart(accuracy: Sequence[float]) -> dg.MetadataValue:
    """Training accuracy of the drafter's prediction at each block position k = 1..B-1."""
    bars = {str(k): a for k, a in enumerate(accuracy, start=1)}
    png = bar_chart_png(bars, title="Draft accuracy by block position (last epoch)", xlabel="block position k",
                        ylabel="accuracy", value_format="{:.2f}")
    return chart("accuracy by block position", png, f"{len(accuracy)} positions.")


def acceptance_by_position_chart(shares: Sequence[float]) -> dg.MetadataValue:
    """Share of verifications that accepted block position k (k = 1..B); the bars sum to tau."""
    bars = {str(k): s for k, s in enumerate(shares, start=1)}
    png = bar_chart_png(bars, title=f"Acceptance by block position (tau = {sum(shares):.3f})",
                        xlabel="block position k", ylabel="share of verifications", value_format="{:.2f}")
    return chart("tau by block position", png, f"tau = {sum(shares):.3f}: the sum of the bars (position 1 is the "
                 "target's bonus token, produced by every verification).")


def learning_curve_chart(points: Sequence[Sequence[float]]) -> dg.MetadataValue:
    """tau on held-out prompts at the training run's checkpoints, from ``[sequence tokens trained, tau]`` points."""
    tokens, taus = [p[0] / 1e6 for p in points], [p[1] for p in points]
    png = line_chart_png(tokens, taus, title="Learning curve: tau at checkpoints", xlabel="tokens trained (M)",
                         ylabel="tau")
    caption = f"{len(points)} checkpoints: tau {taus[0]:.3f} -> {taus[-1]:.3f}." if points else "no checkpoints."
    return chart("learning curve", png, caption)


def learning_curve_by_slice_chart(curves: Mapping[str, Sequence[Sequence[float]]]) -> dg.MetadataValue:
    """tau against tokens trained, one line per slice of the held-out prompts (``{slice: [[tokens, tau], ...]}``;
    slices: thinking, tools, prompt length, category; see ``dflash_assets.drafter.promotion``)."""
    from dagster_project.charts import _figure, _label, _png

    fig, ax = _figure()
    for name, points in sorted(curves.items()):
        ax.plot([p[0] / 1e6 for p in points], [p[1] for p in points], linewidth=1.2, marker=".", label=name)
    if curves:
        ax.legend(fontsize=7, loc="best")
    _label(ax, "Learning curve by slice: tau at checkpoints", "tokens trained (M)", "tau")
    last = ", ".join(f"{n} {pts[-1][1]:.2f}" for n, pts in sorted(curves.items()) if pts)
    return chart("learning curve by slice", _png(fig), f"{len(curves)} slices; last checkpoint: {last}."
                 if curves else "no checkpoints.")


PIPES_CHARTS: dict[str, Callable[[Any], dg.MetadataValue]] = {
    "loss_curve": loss_curve_chart,
    "tau_while_training": tau_while_training_chart,
    "learning_curve": learning_curve_chart,
    "learning_curve_by_slice": learning_curve_by_slice_chart,
    "accuracy_by_position": accuracy_by_position_chart,
    "acceptance_by_position": acceptance_by_position_chart,
}


def render_pipes_result(result: Any) -> Any:
    """A Pipes result as the UI should show it: chart data that a GPU-host stage reported as JSON lists drawn
    as charts (``PIPES_CHARTS``), and a check result's numbers as text (``check_metadata``)."""
    if isinstance(result, dg.MaterializeResult):
        metadata = dict(result.metadata or {})
        for key, draw in PIPES_CHARTS.items():
            if key in metadata and metadata[key].value:
                metadata[key] = draw(metadata[key].value)
        return result._replace(metadata=metadata)
    if isinstance(result, dg.AssetCheckResult):
        return result._replace(metadata=check_metadata({k: v.value for k, v in result.metadata.items()}))
    return result
