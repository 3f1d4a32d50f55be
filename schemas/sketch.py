"""A mergeable latency sketch: DDSketch's logarithmic bins (Masson, Rim and Lee, VLDB
2019) with 1% relative accuracy.

A value ``x > 0`` falls in bin ``ceil(log_gamma(x))``; every value in a bin is within 1%
of the bin's representative value, so any quantile read from the bins is within 1% of
the true one. Sketches merge by adding counts bin by bin, which is what lets the
analytics tables store one sketch per minute (a row per bin) and answer for an hour or
a day with a ``SUM ... GROUP BY bin``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

RELATIVE_ACCURACY = 0.01
_GAMMA = (1 + RELATIVE_ACCURACY) / (1 - RELATIVE_ACCURACY)
_LOG_GAMMA = math.log(_GAMMA)
# Values at or below this (in the sketch's unit: milliseconds here) share bin MIN_BIN.
MIN_VALUE = 1e-3
MIN_BIN = math.ceil(math.log(MIN_VALUE) / _LOG_GAMMA)


def bin_of(value: float) -> int:
    if value <= MIN_VALUE:
        return MIN_BIN
    return math.ceil(math.log(value) / _LOG_GAMMA)


def value_of(bin_: int) -> float:
    """The bin's representative: within the relative accuracy of every value in it."""
    if bin_ <= MIN_BIN:
        return MIN_VALUE
    return 2 * _GAMMA ** bin_ / (_GAMMA + 1)


def quantiles(bins: Mapping[int, int], qs: Iterable[float]) -> dict[float, float | None]:
    """The ``qs`` quantiles (0..1) of the values counted in ``bins`` (None if empty), by
    the lower rank convention: the smallest value with at least ``q * (n - 1)`` below it."""
    total = sum(bins.values())
    ordered = sorted(bins.items())
    out: dict[float, float | None] = {}
    for q in qs:
        if total == 0:
            out[q] = None
            continue
        rank = q * (total - 1)
        seen = 0
        for bin_, count in ordered:
            seen += count
            if seen > rank:
                out[q] = value_of(bin_)
                break
    return out


def merge(sketches: Iterable[Mapping[int, int]]) -> dict[int, int]:
    merged: dict[int, int] = {}
    for sketch in sketches:
        for bin_, count in sketch.items():
            merged[bin_] = merged.get(bin_, 0) + count
    return merged
