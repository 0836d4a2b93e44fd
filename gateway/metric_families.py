"""Labelled metric families kept as plain numbers, exported through prometheus-client.

prometheus-client's own metric objects take a lock and go through several method layers on
every update, which the gateway pays several times per request. The gateway updates its
metrics from one event loop thread only, so the values here are plain dict entries, and a
collector turns them into prometheus-client's metric families when /metrics is scraped.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

Labels = tuple[str, ...]


class Family:
    """A metric and its series, one per tuple of label values (in `labels` order)."""

    kind = ""
    __slots__ = ("help", "labels", "name")

    def __init__(self, name: str, help: str, labels: Iterable[str]) -> None:
        self.name = name
        self.help = help
        self.labels = tuple(labels)

    def collect(self) -> Metric:
        raise NotImplementedError


class _ScalarFamily(Family):
    """One number per series."""

    metric_family: type[CounterMetricFamily | GaugeMetricFamily]
    __slots__ = ("values",)

    def __init__(self, name: str, help: str, labels: Iterable[str]) -> None:
        super().__init__(name, help, labels)
        self.values: dict[Labels, float] = {}

    def inc(self, key: Labels, amount: float = 1.0) -> None:
        values = self.values
        values[key] = values.get(key, 0.0) + amount

    def collect(self) -> Metric:
        family = self.metric_family(self.name, self.help, labels=self.labels)
        for key, value in self.values.items():
            family.add_metric(key, value)
        return family


class CounterFamily(_ScalarFamily):
    """Exported as NAME_total."""

    kind = "counter"
    metric_family = CounterMetricFamily
    __slots__ = ()


class GaugeFamily(_ScalarFamily):
    kind = "gauge"
    metric_family = GaugeMetricFamily
    __slots__ = ()

    def set(self, key: Labels, value: float) -> None:
        self.values[key] = value


class HistogramFamily(Family):
    """Per series: a count per bucket (the last one +Inf), then the sum."""

    kind = "histogram"
    __slots__ = ("bounds", "rows")

    def __init__(self, name: str, help: str, labels: Iterable[str],
                 buckets: Iterable[float]) -> None:
        super().__init__(name, help, labels)
        self.bounds = (*sorted(buckets), float("inf"))
        self.rows: dict[Labels, list[float]] = {}

    def observe(self, key: Labels, value: float) -> None:
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = [0.0] * (len(self.bounds) + 1)
        row[bisect_left(self.bounds, value)] += 1  # the first bucket whose bound is >= value
        row[-1] += value

    def collect(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.help, labels=self.labels)
        for key, row in self.rows.items():
            cumulative, buckets = 0.0, []
            for bound, count in zip(self.bounds, row, strict=False):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            family.add_metric(key, buckets, sum_value=row[-1])
        return family


class FamilyCollector(Collector):
    """Exports a set of families to a prometheus-client registry."""

    def __init__(self, families: Iterable[Family]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        for family in self.families:
            yield family.collect()
