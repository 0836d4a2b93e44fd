"""Active health probing and engine-metric scraping of every replica, in the background."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from backends.adapters import Probe
from backends.pool import Pool, ReplicaState
from backends.upstream import Upstream

log = logging.getLogger("prefix_gateway.health")


class HealthListener(Protocol):
    """Told what health checks and scrapes find (the gateway turns it into metrics)."""

    def replica_up(self, pool: str, replica: str, up: bool) -> None: ...

    def engine_state(self, pool: str, replica: ReplicaState) -> None:
        """`replica.snapshot` and `replica.engine_hit_ratio` were just updated."""

    def step_timing(self, pool: Pool) -> None:
        """The pool's step timing (`pool.load.steps`) was refreshed."""


class HealthMonitor:
    """Probes each replica's liveness path and scrapes its metrics on a schedule.

    A replica leaves rotation after `failure_threshold` failed probes in a row (or at once when
    a request to it fails to connect) and returns on its first successful probe. Replicas whose
    probes only timed out stay as a last resort: when a pool has no healthy replica left, they
    still take traffic (as Envoy's panic mode does), because a gateway starved of CPU must not
    declare a whole working pool dead.
    """

    def __init__(self, pools: list[Pool], upstream: Upstream, listener: HealthListener) -> None:
        self.pools = pools
        self.upstream = upstream
        self.listener = listener
        self._tasks: list[asyncio.Task[None]] = []
        self._reported: dict[tuple[str, str], bool] = {}
        """(pool, replica) -> the health state last logged, so each change is logged once."""

    async def check_all(self) -> None:
        """One round of probes and scrapes for every replica, concurrently."""
        jobs = []
        for pool in self.pools:
            for r in pool.replicas.values():
                jobs.append(self.probe(pool, r))
                jobs.append(self.scrape(pool, r))
        await asyncio.gather(*jobs)

    def start(self) -> None:
        for pool in self.pools:
            self._tasks.append(asyncio.create_task(self._probe_loop(pool)))
            self._tasks.append(asyncio.create_task(self._scrape_loop(pool)))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def _probe_loop(self, pool: Pool) -> None:
        while True:
            await asyncio.sleep(pool.health.interval_s)
            await asyncio.gather(*(self.probe(pool, r) for r in pool.replicas.values()))

    async def _scrape_loop(self, pool: Pool) -> None:
        while True:
            await asyncio.sleep(pool.health.metrics_interval_s)
            await asyncio.gather(*(self.scrape(pool, r) for r in pool.replicas.values()))
            # The gateway's own step timing needs no engine metrics, so it is reported even
            # for replicas whose /metrics cannot be read.
            self.listener.step_timing(pool)

    async def probe(self, pool: Pool, r: ReplicaState) -> None:
        outcome, why = await pool.adapter.check(self.upstream, r.base_url,
                                                pool.health.timeout_s)
        if outcome is Probe.OK:
            r.healthy = True
            r.suspect = False
            r.failures = 0
            r.last_error = ""
        else:
            r.failures += 1
            # A timed-out probe on a starved machine is not proof of death: the replica stays
            # usable as a last resort (Pool.healthy_views) until it refuses or answers non-200.
            r.suspect = outcome is Probe.TIMEOUT
            r.last_error = (f"health check {pool.adapter.health_path} "
                            f"{'timed out' if r.suspect else 'failed'}")
            if r.failures >= pool.health.failure_threshold:
                r.healthy = False
        self._log_change(pool, r, f"{r.last_error}: {why}" if why else r.last_error)
        self.listener.replica_up(pool.name, r.name, r.healthy)

    def _log_change(self, pool: Pool, r: ReplicaState, why: str) -> None:
        """Log the replica's health when it differs from what was last logged (its first
        probe included: a replica unreachable from the start is logged too), with the reason."""
        key = (pool.name, r.name)
        if self._reported.get(key) is r.healthy:
            return
        self._reported[key] = r.healthy
        if r.healthy:
            log.info("replica %s/%s (%s) is up", pool.name, r.name, r.base_url)
        else:
            log.warning("replica %s/%s (%s) is down: %s", pool.name, r.name, r.base_url, why)

    async def scrape(self, pool: Pool, r: ReplicaState) -> None:
        snap = await pool.adapter.scrape(self.upstream, r.base_url, pool.health.timeout_s)
        if snap is None:
            return
        had_capacity = r.snapshot is not None and r.snapshot.capacity_tokens
        r.observe_snapshot(snap, pool.health.hit_ratio_window_s, time.monotonic())
        if not had_capacity and snap.capacity_tokens:
            pool.apply_engine_capacity(r)
        self.listener.engine_state(pool.name, r)

    def mark_failed(self, pool: Pool, r: ReplicaState, error: str,
                    suspect: bool = False) -> None:
        """A request could not reach the replica: take it out of rotation until a probe passes."""
        r.healthy = False
        r.suspect = suspect
        r.failures = max(r.failures, pool.health.failure_threshold)
        r.last_error = error
        self._log_change(pool, r, error)
        self.listener.replica_up(pool.name, r.name, False)
