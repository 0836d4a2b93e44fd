"""The one writer of metrics and stats: what requests, routing and health checks report."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from time import time

from backends.pool import Pool, ReplicaState
from gateway.metrics import GatewayMetrics
from gateway.outcome import Finished
from gateway.stats import StatsRecorder
from routing.types import Decision


class Observer:
    """Updates metrics and stats, each update a few dict operations (gateway/metric_families)."""

    def __init__(self, metrics: GatewayMetrics, stats: StatsRecorder) -> None:
        self.m = metrics
        self.stats = stats
        self.load_moved: Callable[[], None] | None = None
        """Called when a request starts or ends on a replica, while set: the workers' shared
        load (gateway/workerload.py), idle, is woken at once by the first request."""
        self.before_route: Callable[[], None] | None = None
        """Called before a request is routed, while set: the workers' shared load and
        prefixes, idle, catch up with the other workers' before the first decision."""

    def decided(self, pool: str, policy: str, cls: str, d: Decision) -> None:
        m = self.m
        m.decisions.inc((pool, policy, d.reason))
        decisions = self.stats.decisions.get(pool)  # not setdefault: no Counter() per call
        if decisions is None:
            decisions = self.stats.decisions[pool] = Counter()
        decisions[d.reason] += 1
        classes = self.stats.classes.get(pool)
        if classes is None:
            classes = self.stats.classes[pool] = Counter()
        classes[cls] += 1
        self.stats.recent.append((time(), pool, cls, d))
        s = self.stats.replica(d.replica)
        s.routed += 1
        if d.total_blocks:
            missed = d.total_blocks - d.matched_blocks
            m.prefix_blocks.inc((pool, d.replica, "hit"), d.matched_blocks)
            m.prefix_blocks.inc((pool, d.replica, "miss"), missed)
            s.hit_blocks += d.matched_blocks
            s.miss_blocks += missed
            m.match_fraction.observe((pool,), d.matched_fraction)

    def chars_per_token(self, pool: str, value: float) -> None:
        self.m.chars_per_token.set((pool,), value)

    def retried(self, pool: str, replica: str) -> None:
        self.m.retries.inc((pool, replica))

    def try_failed(self, pool: str, replica: str, reason: str) -> None:
        """A try failed before anything reached the client."""
        self.m.tries_failed.inc((pool, replica, reason))

    def ejected(self, pool: str, replica: str, reason: str) -> None:
        self.m.ejections.inc((pool, replica, reason))

    def resent(self, pool: str, replica: str) -> None:
        self.m.resends.inc((pool, replica))

    def inflight(self, pool: str, replica: str, delta: int) -> None:
        self.m.inflight.inc((pool, replica), delta)
        if self.load_moved is not None:
            self.load_moved()

    def finished(self, f: Finished) -> None:
        m = self.m
        series = (f.pool, f.replica, f.traffic_class)
        m.requests.inc((*series, f.status))
        m.duration.observe(series, f.duration_s)
        s = self.stats.replica(f.replica)
        s.requests += 1
        if not f.status.startswith("2"):
            s.errors += 1
        if f.ttft_s is not None:
            m.ttft.observe(series, f.ttft_s)
            s.ttfts.append(f.ttft_s)
            if f.completion_tokens > 1:
                m.tpot.observe(series, f.decode_s / (f.completion_tokens - 1))

    # The Batch API ------------------------------------------------------------------------

    def batch_line(self, result: str) -> None:
        self.m.batch_lines.inc((result,))

    def batch_inflight(self, delta: int) -> None:
        self.m.batch_inflight.inc((), delta)

    def batch_unwritten(self, n: int) -> None:
        self.m.batch_unwritten.set((), n)

    def redis_up(self, up: bool) -> None:
        self.m.redis_up.set((), 1 if up else 0)

    # Routing state shared through Redis ---------------------------------------------------

    def shared_up(self, up: bool) -> None:
        self.m.shared_up.set((), 1 if up else 0)

    def shared_lag(self, pool: str, seconds: float) -> None:
        self.m.shared_lag.observe((pool,), seconds)

    def shared_inserts(self, pool: str, direction: str, n: int) -> None:
        self.m.shared_inserts.inc((pool, direction), n)

    # What health checks and scrapes find (backends.health.HealthListener) -------------------

    def pools_started(self, pools: list[Pool]) -> None:
        """Every replica's series exist from the start, at zero, so dashboards see them."""
        for pool in pools:
            self.chars_per_token(pool.name, pool.router.chars_per_token)
            for r in pool.replicas.values():
                self.replica_up(pool.name, r.name, False)
                self.m.inflight.set((pool.name, r.name), 0)

    def replica_up(self, pool: str, replica: str, up: bool) -> None:
        self.m.replica_up.set((pool, replica), 1 if up else 0)

    def engine_state(self, pool: str, replica: ReplicaState) -> None:
        m, key, snap = self.m, (pool, replica.name), replica.snapshot
        if replica.engine_hit_ratio is not None:
            m.engine_hit_ratio.set(key, replica.engine_hit_ratio)
        if snap is None:
            return
        if snap.waiting is not None:
            m.engine_waiting.set(key, snap.waiting)
        if snap.kv_usage is not None:
            m.engine_kv_usage.set(key, snap.kv_usage)

    def step_timing(self, pool: Pool) -> None:
        steps = pool.load.steps
        for name, step in steps.step_times().items():
            self.m.engine_step.set((pool.name, name), step)
        self.m.prefill_rate.set((pool.name,), steps.rate)

    # Admission control (gateway/admission.py) ------------------------------------------------

    def admission_started(self, classes: dict[str, list[str]],
                          capacities: dict[str, int]) -> None:
        """Each class's series (and its pools') exist from the start, at zero."""
        m = self.m
        for cls, pools in classes.items():
            m.queue_depth.set((cls,), 0)
            for pool in pools:
                m.admission_inflight.set((cls, pool), 0)
        for pool, capacity in capacities.items():
            m.admission_capacity.set((pool,), capacity)

    def admission_capacity(self, pool: str, capacity: int) -> None:
        self.m.admission_capacity.set((pool,), capacity)

    def queue_depth(self, cls: str, depth: int) -> None:
        self.m.queue_depth.set((cls,), depth)

    def admitted(self, cls: str, pool: str, waited_s: float, borrowed: bool) -> None:
        m = self.m
        m.admission_inflight.inc((cls, pool))
        m.queue_wait.observe((cls,), waited_s)
        waits = self.stats.queue_waits.get(cls)
        if waits is None:
            waits = self.stats.queue_waits[cls] = deque(maxlen=2048)
        waits.append(waited_s)
        if borrowed:
            m.borrowed.inc((cls, pool))
            self.stats.borrowed.setdefault(cls, Counter())[pool] += 1

    def admission_released(self, cls: str, pool: str) -> None:
        self.m.admission_inflight.inc((cls, pool), -1)

    def left_queue(self, cls: str, waited_s: float) -> None:
        """A request left the queue without a slot (timed out, its client left)."""
        self.m.queue_wait.observe((cls,), waited_s)

    def admission_rejected(self, cls: str, reason: str) -> None:
        self.m.admission_rejected.inc((cls, reason))
        self.stats.rejected.setdefault(cls, Counter())[reason] += 1

    # Authentication and rate limits ------------------------------------------------------

    def auth_rejected(self, surface: str, traffic_class: str, reason: str) -> None:
        self.m.auth_rejected.inc((surface, traffic_class, reason))
