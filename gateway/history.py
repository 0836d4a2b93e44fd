"""The /admin page's memory: one sample per interval over the last minutes, in a ring.

Nothing is added to a request's path for it: every `interval_s` the sampler reads the running
totals the metrics already keep (requests by status, the TTFT histogram, expected prefix
blocks, decisions by reason, requests routed per replica) and stores what changed since the
last sample, with the gauges of the moment (health, in flight, the engines' hit ratios). The
ring holds `window_s / interval_s` samples; the oldest is dropped when a new one comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from backends.pool import Pool
from gateway.config import HistoryConfig
from gateway.metrics import GatewayMetrics
from gateway.stats import StatsRecorder

log = logging.getLogger("prefix_gateway.history")


@dataclass(slots=True)
class _Totals:
    """Running totals at one moment, as the metrics keep them."""

    at: float
    """time.monotonic()"""
    requests: dict[str, float] = field(default_factory=dict)
    """pool -> finished requests."""
    errors: dict[str, float] = field(default_factory=dict)
    """pool -> finished requests whose status was not 2xx."""
    replica_requests: dict[tuple[str, str], float] = field(default_factory=dict)
    ttft: dict[str, list[float]] = field(default_factory=dict)
    """pool -> TTFT histogram bucket counts (not cumulative), the sum last."""
    blocks: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    """(pool, replica) -> [hit blocks, miss blocks]."""
    decisions: dict[tuple[str, str], float] = field(default_factory=dict)
    """(pool, reason) -> decisions."""
    routed: dict[str, int] = field(default_factory=dict)
    """replica -> requests routed to it (first decisions)."""


def quantile(bounds: tuple[float, ...], counts: list[float], q: float) -> float | None:
    """The q-quantile of a histogram (`counts` per bucket of upper bound `bounds`, the last
    +Inf), interpolated linearly within its bucket as Prometheus's histogram_quantile does;
    None when it is empty."""
    total = sum(counts[:len(bounds)])
    if total <= 0:
        return None
    rank = q * total
    seen = 0.0
    for i, n in enumerate(counts[:len(bounds)]):
        if n and seen + n >= rank:
            upper = bounds[i]
            lower = bounds[i - 1] if i else 0.0
            if upper == float("inf"):
                return round(lower, 4)  # above the last finite bound: that bound
            return round(lower + (upper - lower) * (rank - seen) / n, 4)
        seen += n
    return round(bounds[-2], 4)


def _ratio(hit: float, miss: float) -> float | None:
    looked = hit + miss
    return round(hit / looked, 4) if looked > 0 else None


class History:
    """The ring of samples, and the task that fills it."""

    def __init__(self, config: HistoryConfig, metrics: GatewayMetrics, stats: StatsRecorder,
                 pools: list[Pool]) -> None:
        self.interval_s = config.interval_s
        self.window_s = config.window_s
        self.samples: deque[dict[str, Any]] = deque(maxlen=config.samples)
        self.metrics = metrics
        self.stats = stats
        self.pools = pools
        self._last: _Totals | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._last = self._totals()
            self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            due += self.interval_s
            await asyncio.sleep(max(0.0, due - loop.time()))
            try:
                self.sample()
            except Exception:  # a bug here must not stop the page's history for good
                log.exception("history sample failed")
            if loop.time() - due > self.interval_s:
                due = loop.time()  # starved for more than an interval: do not catch up

    def sample(self) -> dict[str, Any]:
        """Take a sample of what changed since the last one, and keep it."""
        now = self._totals()
        last = self._last or now
        self._last = now
        elapsed = max(now.at - last.at, 1e-9)
        pools = [self._pool(pool, now, last, elapsed) for pool in self.pools]
        sample = {"t": round(time.time(), 3), "interval_s": round(elapsed, 3), "pools": pools}
        self.samples.append(sample)
        return sample

    def snapshot(self, since: float | None = None) -> dict[str, Any]:
        """What /admin/history returns: the samples (after `since`, a sample's `t`, if given)
        and the latest routing decisions, newest first."""
        samples = [s for s in self.samples if since is None or s["t"] > since]
        recent = [{
            "t": round(t, 3), "pool": pool, "traffic_class": cls, "replica": d.replica,
            "reason": d.reason, "matched_fraction": round(d.matched_fraction, 4),
            "matched_blocks": d.matched_blocks, "total_blocks": d.total_blocks,
        } for t, pool, cls, d in reversed(self.stats.recent)]
        return {"interval_s": self.interval_s, "window_s": self.window_s,
                "max_samples": self.samples.maxlen, "samples": samples,
                "recent_decisions": recent}

    # Inside ---------------------------------------------------------------------------------

    def _totals(self) -> _Totals:
        m = self.metrics
        t = _Totals(time.monotonic())
        for (pool, replica, _cls, status), n in m.requests.values.items():
            t.requests[pool] = t.requests.get(pool, 0.0) + n
            if not status.startswith("2"):
                t.errors[pool] = t.errors.get(pool, 0.0) + n
            key = (pool, replica)
            t.replica_requests[key] = t.replica_requests.get(key, 0.0) + n
        for (pool, _replica, _cls), row in m.ttft.rows.items():
            acc = t.ttft.get(pool)
            if acc is None:
                t.ttft[pool] = list(row)
            else:
                for i, n in enumerate(row):
                    acc[i] += n
        for (pool, replica, result), n in m.prefix_blocks.values.items():
            acc = t.blocks.setdefault((pool, replica), [0.0, 0.0])
            acc[0 if result == "hit" else 1] += n
        for (pool, _policy, reason), n in m.decisions.values.items():
            key = (pool, reason)
            t.decisions[key] = t.decisions.get(key, 0.0) + n
        t.routed = {name: s.routed for name, s in self.stats.replicas.items()}
        return t

    def _pool(self, pool: Pool, now: _Totals, last: _Totals, elapsed: float) -> dict[str, Any]:
        name = pool.name
        requests = _delta(now.requests.get(name), last.requests.get(name))
        errors = _delta(now.errors.get(name), last.errors.get(name))
        ttft = _row_delta(now.ttft.get(name), last.ttft.get(name))
        bounds = self.metrics.ttft.bounds
        replicas = list(pool.replicas.values())
        routed = {r.name: _delta(now.routed.get(r.name), last.routed.get(r.name))
                  for r in replicas}
        routed_all = sum(routed.values())
        hit = miss = 0.0
        reps = []
        for r in replicas:
            key = (name, r.name)
            b = _row_delta(now.blocks.get(key), last.blocks.get(key)) or [0.0, 0.0]
            hit += b[0]
            miss += b[1]
            reps.append({
                "name": r.name,
                "healthy": r.healthy,
                "inflight": pool.load.inflight.get(r.name, 0),
                "requests": int(_delta(now.replica_requests.get(key),
                                       last.replica_requests.get(key))),
                "routed": int(routed[r.name]),
                "load_share": round(routed[r.name] / routed_all, 4) if routed_all else None,
                "estimated_hit_ratio": _ratio(b[0], b[1]),
                "engine_hit_ratio": (round(r.engine_hit_ratio, 4)
                                     if r.engine_hit_ratio is not None else None),
            })
        engine = [r.engine_hit_ratio for r in replicas
                  if r.engine_hit_ratio is not None and r.healthy]
        reasons = {reason: int(d) for (p, reason), n in now.decisions.items()
                   if p == name and (d := _delta(n, last.decisions.get((p, reason))))}
        return {
            "name": name,
            "requests": int(requests),
            "errors": int(errors),
            "requests_per_s": round(requests / elapsed, 3),
            "ttft_p50_s": quantile(bounds, ttft, 0.5) if ttft else None,
            "ttft_p95_s": quantile(bounds, ttft, 0.95) if ttft else None,
            "estimated_hit_ratio": _ratio(hit, miss),
            "engine_hit_ratio": round(sum(engine) / len(engine), 4) if engine else None,
            "healthy_replicas": sum(r.healthy for r in replicas),
            "inflight": sum(pool.load.inflight.get(r.name, 0) for r in replicas),
            "decisions_by_reason": reasons,
            "replicas": reps,
        }


def _delta(now: float | None, last: float | None) -> float:
    """What a running total grew by; a total that went down (its series was dropped and
    started again) counts from zero."""
    now = now or 0.0
    last = last or 0.0
    return now - last if now >= last else now


def _row_delta(now: Iterable[float] | None, last: list[float] | None) -> list[float] | None:
    if now is None:
        return None
    row = list(now)
    if last is None or any(a < b for a, b in zip(row, last, strict=False)):
        return row
    return [a - b for a, b in zip(row, last, strict=False)]
