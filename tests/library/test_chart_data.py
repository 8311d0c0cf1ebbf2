"""The chart numbers: durations as a reader wants them, integer bins whose counts sum to the values, curves cut to
at most a number of points, and the acceptance shares that sum to tau."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_assets.chart_data import bin_labels, binned_counts, curve_points, format_duration, share_at_least


@pytest.mark.parametrize("seconds,text", [(None, "unknown"), (float("nan"), "unknown"), (45, "45 s"),
                                          (750, "12.5 min"), (3.2 * 3600, "3.2 h"), (4.1 * 86400, "4.1 days"),
                                          (float("inf"), "never (no throughput)")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_binned_counts_sum_to_the_values_and_refuse_one_below_the_first_edge():
    edges = [0, 1, 8, 16]
    assert bin_labels(edges) == ["0", "1-7", "8-15", "16+"]
    assert binned_counts([0, 1, 7, 8, 15, 16, 4096], edges) == {"0": 1, "1-7": 2, "8-15": 2, "16+": 2}
    with pytest.raises(ValueError, match="below the first bin edge"):
        binned_counts([-1], edges)


def test_curve_points_average_windows_and_end_at_the_last_step():
    assert curve_points([]) == []
    assert curve_points([1.0, 3.0]) == [[1, 1.0], [2, 3.0]]  # fewer values than points: one per step
    points = curve_points(np.arange(1, 1001, dtype=float), max_points=10)
    assert len(points) == 10 and points[-1][0] == 1000 and points[0] == [100, 50.5]


def test_acceptance_shares_sum_to_tau():
    counts = [0, 2, 1, 1]  # verifications that produced 1, 2 and 3 tokens
    shares = share_at_least(counts)
    tau = sum(n * c for n, c in enumerate(counts)) / sum(counts)
    assert shares == [1.0, 0.5, 0.25] and sum(shares) == pytest.approx(tau)
    assert share_at_least([0, 0, 0]) == [0.0, 0.0]
