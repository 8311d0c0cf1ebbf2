"""The one rule every ratio check follows: it fails only when the data show the ratio is past its threshold.

A ratio check counts ``count`` of ``n`` records (samples with an empty
answer, samples cut at max_length, samples with reasoning) and compares the
share with a threshold. The observed share of a small shard is a noisy
estimate: 1 empty answer in 23 samples is 4.35%, yet says little about
whether the process that made them empties more than 2% of answers. So the
rule compares the threshold with the 95% Wilson score interval of the
share, not with the share itself:

- a ceiling ("at most ``threshold``": empty_response_ratio,
  truncation_ratio) fails when the interval's LOWER bound exceeds it;
- a floor ("at least ``threshold``": thinking_ratio) fails when the
  interval's UPPER bound is below it;
- 0 records give no evidence and no ratio: the check fails, saying so
  (an empty partition has nothing to train on).

At a 2% ceiling, 1 in 23 passes (lower bound 0.77%) and 2 in 23 fail
(2.42%); 87% stubs (``floor(0.87 n)`` of ``n``) fail from 2 samples up.
A threshold of 0 fails on any count above 0, and a floor of 1 on any
record short of all. ``ratio_gate`` decides; ``RatioGate.metadata`` and
``RatioGate.verdict`` are what a check shows. Pure arithmetic: reads and
writes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["CEILING", "FLOOR", "Z_95", "RatioGate", "ratio_gate", "rule_in_words", "wilson_interval"]

Z_95 = 1.959963984540054  # the 97.5% quantile of the standard normal: a two-sided 95% interval
CEILING: Literal["ceiling"] = "ceiling"  # "too many" checks: at most the threshold
FLOOR: Literal["floor"] = "floor"  # "too few" checks: at least the threshold


def wilson_interval(count: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of the share ``count / n`` (95% with the default ``z``), within [0, 1].

    Exactly 0 below when ``count`` is 0 and exactly 1 above when ``count`` is ``n`` (no float residue that
    a threshold of 0 or a floor of 1 would read as evidence). Raises ``ValueError`` for ``n < 1`` or a
    ``count`` outside ``[0, n]``.
    """
    if n < 1:
        raise ValueError(f"the Wilson interval needs at least one record, got n={n}")
    if not 0 <= count <= n:
        raise ValueError(f"count must lie in [0, n={n}], got {count}")
    share = count / n
    z2 = z * z
    denominator = 1 + z2 / n
    centre = (share + z2 / (2 * n)) / denominator
    half_width = z * math.sqrt(share * (1 - share) / n + z2 / (4 * n * n)) / denominator
    lower = 0.0 if count == 0 else max(0.0, centre - half_width)
    upper = 1.0 if count == n else min(1.0, centre + half_width)
    return lower, upper


def rule_in_words(kind: str, threshold: float) -> str:
    """The rule of a ``kind`` (``CEILING`` or ``FLOOR``) check in one sentence, for check metadata."""
    if kind == CEILING:
        return (f"fails when the lower bound of the 95% Wilson score interval of the ratio exceeds the threshold "
                f"{threshold:.2%}, i.e. only when the data show the share is over it; a partition with no records fails")
    if kind == FLOOR:
        return (f"fails when the upper bound of the 95% Wilson score interval of the ratio is below the floor "
                f"{threshold:.2%}, i.e. only when the data show the share is under it; a partition with no records fails")
    raise ValueError(f"kind must be {CEILING!r} or {FLOOR!r}, got {kind!r}")


@dataclass(frozen=True)
class RatioGate:
    """The decision on ``count`` of ``n`` records against a ceiling or a floor, with the evidence behind it."""

    kind: Literal["ceiling", "floor"]
    count: int
    n: int
    threshold: float
    lower: float | None  # the 95% Wilson bounds of count / n; None when n is 0
    upper: float | None
    passed: bool

    @property
    def ratio(self) -> float | None:
        """The observed share, ``count / n``; None when there are no records."""
        return self.count / self.n if self.n else None

    @property
    def bound(self) -> float | None:
        """The bound that decides: the lower one for a ceiling, the upper one for a floor."""
        return self.lower if self.kind == CEILING else self.upper

    @property
    def bound_name(self) -> str:
        return "wilson_lower_95" if self.kind == CEILING else "wilson_upper_95"

    def verdict(self) -> str:
        """Why it passed or failed, in words: "over the 2.00% threshold with 95% confidence (lower bound
        67.87%)" or "not shown to be over the 2.00% threshold (95% lower bound 0.77%)"."""
        if self.n == 0:
            return "no samples to check: 0 samples give no ratio and no evidence"
        side, limit = ("over", "threshold") if self.kind == CEILING else ("under", "floor")
        which = "lower" if self.kind == CEILING else "upper"
        if self.passed:
            return f"not shown to be {side} the {self.threshold:.2%} {limit} (95% {which} bound {self.bound:.2%})"
        return f"{side} the {self.threshold:.2%} {limit} with 95% confidence ({which} bound {self.bound:.2%})"

    def metadata(self) -> dict[str, Any]:
        """What a check shows: ``n``, ``count``, ``ratio``, the deciding bound (``wilson_lower_95`` for a
        ceiling, ``wilson_upper_95`` for a floor), ``threshold`` and ``rule`` in words (ratio and bound are
        absent when ``n`` is 0)."""
        values: dict[str, Any] = {"n": self.n, "count": self.count}
        if self.n:
            values["ratio"] = round(self.ratio, 6)
            values[self.bound_name] = round(self.bound, 6)
        values["threshold"] = self.threshold
        values["rule"] = rule_in_words(self.kind, self.threshold)
        return values


def ratio_gate(count: int, n: int, threshold: float, kind: Literal["ceiling", "floor"] = CEILING) -> RatioGate:
    """Decide a ratio check by the rule of this module: a ``CEILING`` fails when the 95% Wilson lower bound of
    ``count / n`` exceeds ``threshold``, a ``FLOOR`` when the upper bound is below it; ``n == 0`` fails."""
    if kind not in (CEILING, FLOOR):
        raise ValueError(f"kind must be {CEILING!r} or {FLOOR!r}, got {kind!r}")
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"a ratio threshold lies in [0, 1], got {threshold}")
    if n == 0 and count == 0:
        return RatioGate(kind, 0, 0, threshold, None, None, passed=False)
    lower, upper = wilson_interval(count, n)
    passed = lower <= threshold if kind == CEILING else upper >= threshold
    return RatioGate(kind, count, n, threshold, lower, upper, passed)
