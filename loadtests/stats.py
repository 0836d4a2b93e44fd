"""Summary statistics of benchmark samples: percentiles, medians and imbalance."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

from gateway.experiments.report import percentile as gateway_percentile


def percentile(values: Iterable[float], q: float, default: float | None = None) -> float | None:
    """The q-quantile (0 <= q <= 1) with linear interpolation between the two nearest ranks
    (numpy's default); `default` when there are no values."""
    value = gateway_percentile(list(values), q)
    return default if value is None else value


def nearest_rank(values: Iterable[float], q: float) -> float:
    """The sample at rank floor(q * n), no interpolation; NaN when there are none.

    overhead.py reports its latencies this way, so its figures stay comparable across runs.
    """
    s = sorted(values)
    if not s:
        return math.nan
    return s[min(len(s) - 1, int(q * len(s)))]


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None; None when there are none."""
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def max_over_mean(values: Sequence[float], default: float | None = None) -> float | None:
    """Busiest over mean (1.0 is perfect balance); `default` when empty or the mean is 0."""
    if not values:
        return default
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else default


def prefill_seconds(tokens: Sequence[float], rates: Sequence[float]) -> list[float]:
    """Per replica, its busy prefill time normalised by its speed: the uncached prompt tokens
    it computed over its profile's prefill rate (tokens/s)."""
    return [t / r for t, r in zip(tokens, rates, strict=True)]


def bucket_bound(bounds: Sequence[float], cumulative: Sequence[float], q: float) -> float | None:
    """The upper bound of the histogram bucket holding quantile `q` (a figure that is at
    most this), from cumulative counts per bound as Prometheus exposes them; None if empty."""
    total = cumulative[-1] if cumulative else 0.0
    if not total:
        return None
    return next(b for b, n in zip(bounds, cumulative, strict=True) if n >= q * total)
