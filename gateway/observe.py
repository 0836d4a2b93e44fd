"""The one writer of metrics and stats: what requests, routing and health checks report."""

from __future__ import annotations

from collections import Counter

from backends.pool import Pool, ReplicaState
from gateway.metrics import GatewayMetrics
from gateway.outcome import Finished
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

    def finished(self, f: Finished) -> None:
        self._child(self.m.requests, f.pool, f.replica, f.traffic_class, f.status).inc()
        self._child(self.m.duration, f.pool, f.replica, f.traffic_class).observe(f.duration_s)
        s = self.stats.replica(f.replica)
        s.requests += 1
        if not f.status.startswith("2"):
            s.errors += 1
        if f.ttft_s is not None:
            self._child(self.m.ttft, f.pool, f.replica, f.traffic_class).observe(f.ttft_s)
            s.ttfts.append(f.ttft_s)
            if f.completion_tokens > 1:
                self._child(self.m.tpot, f.pool, f.replica, f.traffic_class).observe(
                    f.decode_s / (f.completion_tokens - 1))

    # What health checks and scrapes find (backends.health.HealthListener) -------------------

    def pools_started(self, pools: list[Pool]) -> None:
        """Every replica's series exist from the start, at zero, so dashboards see them."""
        for pool in pools:
            self.chars_per_token(pool.name, pool.router.chars_per_token)
            for r in pool.replicas.values():
                self.replica_up(pool.name, r.name, False)
                self._child(self.m.inflight, pool.name, r.name).set(0)

    def replica_up(self, pool: str, replica: str, up: bool) -> None:
        self._child(self.m.replica_up, pool, replica).set(1 if up else 0)

    def engine_state(self, pool: str, replica: ReplicaState) -> None:
        snap = replica.snapshot
        if replica.engine_hit_ratio is not None:
            self._child(self.m.engine_hit_ratio, pool, replica.name).set(
                replica.engine_hit_ratio)
        if snap is None:
            return
        if snap.waiting is not None:
            self._child(self.m.engine_waiting, pool, replica.name).set(snap.waiting)
        if snap.kv_usage is not None:
            self._child(self.m.engine_kv_usage, pool, replica.name).set(snap.kv_usage)

    def step_timing(self, pool: Pool) -> None:
        steps = pool.load.steps
        for name, step in steps.step_times().items():
            self._child(self.m.engine_step, pool.name, name).set(step)
        self._child(self.m.prefill_rate, pool.name).set(steps.rate)
