"""Small PNG charts for the Dagster UI: histograms, curves and per-position bars, embedded in Markdown metadata.

Data in, PNG bytes (or a Markdown image with a ``data:image/png;base64`` URI) out; reads and writes no files.
Renders on matplotlib's Agg canvas (no display, no pyplot state, safe in threads); matplotlib is imported on
first use so that loading the definitions does not pay for it. A chart is ~640x300 px and a few tens of KB.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence

FIGSIZE = (6.4, 3.0)  # inches, at DPI: 640 x 300 px
DPI = 100
BAR_COLOR = "#4c72b0"
HIGHLIGHT_COLOR = "#c44e52"


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None}, pil_kwargs={"optimize": True})
    return buf.getvalue()


def _label(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def bar_chart_png(bars: Mapping[str, float], *, title: str, xlabel: str, ylabel: str,
                  highlight: Sequence[str] = (), value_format: str = "{:g}") -> bytes:
    """One bar per key, in order, each with its value written above it; keys in ``highlight`` drawn in red."""
    fig, ax = _figure()
    labels, values = list(bars), [float(v) for v in bars.values()]
    colors = [HIGHLIGHT_COLOR if label in set(highlight) else BAR_COLOR for label in labels]
    drawn = ax.bar(range(len(labels)), values, color=colors)
    ax.bar_label(drawn, labels=[value_format.format(v) if v else "" for v in values], fontsize=8, padding=1)
    ax.set_xticks(range(len(labels)), labels, rotation=30 if len(labels) > 8 else 0, fontsize=8)
    ax.margins(y=0.15)
    if all(v.is_integer() for v in values):  # counts: no 2.5-sample ticks
        ax.yaxis.get_major_locator().set_params(integer=True)
    _label(ax, title, xlabel, ylabel)
    return _png(fig)


def line_chart_png(x: Sequence[float], y: Sequence[float], *, title: str, xlabel: str, ylabel: str,
                   mark: tuple[float, float, str] | None = None) -> bytes:
    """One line of ``y`` over ``x`` (a curve such as loss per training step); ``mark``: one point (x, y, label)
    drawn in red and labelled (the best checkpoint)."""
    fig, ax = _figure()
    ax.plot(list(x), list(y), color=BAR_COLOR, linewidth=1.5, marker="." if len(x) <= 40 else None)
    if mark is not None:
        ax.plot([mark[0]], [mark[1]], "o", color=HIGHLIGHT_COLOR, markersize=8, label=mark[2])
        ax.legend(fontsize=8, loc="lower right")
    _label(ax, title, xlabel, ylabel)
    return _png(fig)


def markdown_image(title: str, png: bytes, caption: str = "") -> str:
    """``png`` as a Markdown image (a data URI the Dagster UI renders), with an optional caption line below it."""
    image = f"![{title}](data:image/png;base64,{base64.b64encode(png).decode('ascii')})"
    return f"{image}\n\n{caption}" if caption else image
