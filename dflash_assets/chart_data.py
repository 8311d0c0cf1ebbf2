"""The numbers behind the UI's charts: binned counts, downsampled curves, shares by block position,
and durations as the metadata shows them.

Pure functions over numbers (numpy); they read and write nothing. The Dagster layer draws them
(``dagster_project.charts``); the same data is what a notebook would plot.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def format_duration(seconds: float | None) -> str:
    """Seconds as a reader wants them: "45 s", "12.5 min", "3.2 h", "4.1 days"; infinity is "never"."""
    if seconds is None or seconds != seconds:
        return "unknown"
    if seconds == float("inf"):
        return "never (no throughput)"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def bin_labels(edges: Sequence[int]) -> list[str]:
    """"0", "1-7", "8-15", ..., "4096+" for integer bin edges [0, 1, 8, 16, ..., 4096]."""
    labels = [f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}" for lo, hi in zip(edges[:-1], edges[1:])]
    return labels + [f"{edges[-1]}+"]


def binned_counts(values: Sequence[int] | np.ndarray, edges: Sequence[int]) -> dict[str, int]:
    """How many ``values`` fall in each bin [edges[i], edges[i+1]) and in [edges[-1], inf), by label.

    The counts sum to the number of values (every value must be >= edges[0]).
    """
    values = np.asarray(values, dtype=np.int64).ravel()
    if len(values) and values.min() < edges[0]:
        raise ValueError(f"value {int(values.min())} is below the first bin edge {edges[0]}")
    index = np.searchsorted(np.asarray(edges), values, side="right") - 1
    counts = np.bincount(index, minlength=len(edges))
    return {label: int(c) for label, c in zip(bin_labels(edges), counts)}


def curve_points(values: Sequence[float], max_points: int = 200) -> list[list[float]]:
    """``values`` (one per step, from step 1) as at most ``max_points`` [step, mean] points.

    Each point is the mean of a window of consecutive steps, placed at the window's last step; the
    last point is always the last step. Fewer values than ``max_points`` come back one point per step.
    """
    values = np.asarray(values, dtype=np.float64)
    if not len(values):
        return []
    windows = np.array_split(np.arange(len(values)), min(max_points, len(values)))
    return [[int(w[-1]) + 1, float(values[w].mean())] for w in windows]


def share_at_least(counts: Sequence[int]) -> list[float]:
    """From ``counts[n]`` = verifications that produced n tokens: the share that produced at least k tokens,
    for k = 1..len(counts)-1 (block position k was accepted). The shares sum to the mean, tau."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum()
    if total == 0:
        return [0.0] * max(len(counts) - 1, 0)
    at_least = counts[::-1].cumsum()[::-1]  # at_least[k] = sum(counts[k:])
    return [float(x) for x in at_least[1:] / total]
