"""Recording what happened to a request: Prometheus metrics and the stats, in one call each."""

from __future__ import annotations

from collections import Counter

from gateway.metrics import GatewayMetrics
from gateway.stats import StatsRecorder
from routing.types import Decision


class Observer:
    """Updates metrics and stats; label children are cached because `.labels()` is slow."""

    def __init__(self, metrics: GatewayMetrics, stats: StatsRecorder) -> None:
        self.m = metrics
        self.stats = stats
        self._children: dict[tuple, object] = {}

    def _child(self, metric, *labels: str):
        key = (id(metric), *labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def decided(self, pool: str, policy: str, cls: str, d: Decision) -> None:
        self._child(self.m.decisions, pool, policy, d.reason).inc()
        decisions = self.stats.decisions.get(pool)  # not setdefault: no Counter() per call
        if decisions is None:
            decisions = self.stats.decisions[pool] = Counter()
        decisions[d.reason] += 1
        classes = self.stats.classes.get(pool)
        if classes is None:
            classes = self.stats.classes[pool] = Counter()
        classes[cls] += 1
        if d.total_blocks:
            missed = d.total_blocks - d.matched_blocks
            self._child(self.m.prefix_blocks, pool, d.replica, "hit").inc(d.matched_blocks)
            self._child(self.m.prefix_blocks, pool, d.replica, "miss").inc(missed)
            s = self.stats.replica(d.replica)
            s.hit_blocks += d.matched_blocks
            s.miss_blocks += missed
            self._child(self.m.match_fraction, pool).observe(d.matched_fraction)

    def chars_per_token(self, pool: str, value: float) -> None:
        self._child(self.m.chars_per_token, pool).set(value)

    def retried(self, pool: str, replica: str) -> None:
        self._child(self.m.retries, pool, replica).inc()

    def resent(self, pool: str, replica: str) -> None:
        self._child(self.m.resends, pool, replica).inc()

    def inflight(self, pool: str, replica: str, delta: int) -> None:
        self._child(self.m.inflight, pool, replica).inc(delta)

    def finished(
        self,
        pool: str,
        replica: str,
        cls: str,
        status: str,
        duration: float,
        ttft: float | None,
        tokens: int,
        decode_time: float,
    ) -> None:
        self._child(self.m.requests, pool, replica, cls, status).inc()
        self._child(self.m.duration, pool, replica, cls).observe(duration)
        s = self.stats.replica(replica)
        s.requests += 1
        if not status.startswith("2"):
            s.errors += 1
        if ttft is not None:
            self._child(self.m.ttft, pool, replica, cls).observe(ttft)
            s.ttfts.append(ttft)
            if tokens > 1:
                self._child(self.m.tpot, pool, replica, cls).observe(decode_time / (tokens - 1))
