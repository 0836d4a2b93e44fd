"""Active health probing and engine-metric scraping of every replica, in the background."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from backends.adapters import Probe
from backends.adapters.base import EngineSnapshot
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

    def ejected(self, pool: str, replica: str, reason: str) -> None:
        """Live traffic took the replica out of rotation (consecutive_failures, broken,
        stalled)."""


class HealthMonitor:
    """Probes each replica's liveness path and scrapes its metrics on a schedule; ejects
    replicas that fail live traffic or stall.

    A replica leaves rotation after `failure_threshold` failed probes in a row, at once when a
    request to it fails to connect or its connection breaks, after `ejection.
    consecutive_failures` failed requests in a row (5xx, timeouts), or when it stalls (no byte
    for `ejection.stall_s` while streams that had content wait for it, and no answer to a
    health check meanwhile; never the pool's last healthy replica). It returns on its
    first successful probe, but not before its ejection has lasted `ejection.base_s`,
    doubled for each ejection in a row (up to `max_s`). Replicas whose probes only timed out
    stay as a last resort: when a pool has no healthy replica left, they still take traffic
    (as Envoy's panic mode does), because a gateway starved of CPU must not declare a whole
    working pool dead.
    """

    def __init__(self, pools: list[Pool], upstream: Upstream, listener: HealthListener) -> None:
        self.pools = pools
        self.upstream = upstream
        self.listener = listener
        self._tasks: list[asyncio.Task[None]] = []
        self._asking: set[asyncio.Task[None]] = set()
        """Health checks of replicas that look stalled, in flight."""
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
            if pool.health.passed_through_interval_s > 0:
                self._tasks.append(asyncio.create_task(self._passed_through_loop(pool)))
            if pool.spec.ejection.stall_s > 0:
                self._tasks.append(asyncio.create_task(self._stall_loop(pool)))

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._asking]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    async def _probe_loop(self, pool: Pool) -> None:
        while True:
            await asyncio.sleep(pool.health.interval_s)
            await asyncio.gather(*(self.probe(pool, r) for r in list(pool.replicas.values())
                                   if not r.draining))

    async def _scrape_loop(self, pool: Pool) -> None:
        while True:
            await asyncio.sleep(pool.health.metrics_interval_s)
            await asyncio.gather(*(self.scrape(pool, r) for r in list(pool.replicas.values())
                                   if not r.draining))
            # The gateway's own step timing needs no engine metrics, so it is reported even
            # for replicas whose /metrics cannot be read.
            self.listener.step_timing(pool)

    async def _passed_through_loop(self, pool: Pool) -> None:
        while True:
            await asyncio.sleep(pool.health.passed_through_interval_s)
            await asyncio.gather(*(self.read_first_tokens(pool, r)
                                   for r in list(pool.replicas.values())
                                   if not r.draining and pool.load.awaits_unseen(r.name)))

    async def read_first_tokens(self, pool: Pool, r: ReplicaState) -> None:
        """Between scrapes, while requests passed through whole there may still wait for
        their prefill: read the engine's metrics for the counts that end them, and only those.

        Read every `metrics_interval_s` (5 s), the count left those requests queued for
        2.5 s on average after their prefill; read every second, on the slow fleet near
        saturation with half the requests passed through, the mean TTFT went from 4.2 s to
        3.6 s (3.7 s with every request streamed). The other figures of the read are left to
        the scrape: the engine's prefill rate, for one, is worked out between two reads, and
        over a second its histogram's sums reach back past the interval."""
        async with r.scraping:
            read_at = time.time()
            snap = await pool.adapter.read_counts(self.upstream, r.base_url,
                                                  pool.health.timeout_s)
            if snap is None or r.draining or pool.replicas.get(r.name) is not r:
                return
            self._tell_counts(pool, r, snap, read_at)

    @staticmethod
    def _tell_counts(pool: Pool, r: ReplicaState, snap: EngineSnapshot, read_at: float) -> None:
        """The engine's counts that end passed-through prefills, read at `read_at` (the
        clock requests are stamped with as they are sent)."""
        pool.load.engine_first_tokens(r.name, snap.first_tokens)
        pool.load.engine_prefills_waiting(r.name, snap.prefills_waiting, read_at,
                                          snap.prefills_waiting_lag_s or 0.0)

    async def _stall_loop(self, pool: Pool) -> None:
        # Checked several times per stall_s, so a stall is seen soon after it lasted stall_s.
        every = pool.spec.ejection.stall_s / 4
        while True:
            await asyncio.sleep(every)
            self.check_stalls(pool, time.perf_counter())

    def check_stalls(self, pool: Pool, now: float) -> None:
        """Ask the replicas of `pool` that stopped streaming, while the gateway waits to read
        streams that already had content from them, whether they are alive (`_ask`).

        Silence alone does not tell a frozen engine from a busy one: a long prefill holds
        the engine's steps, and so every stream there, for as long as it takes (seconds on a
        CPU engine, or for a huge prompt). An engine's API server answers a health check
        while the engine computes; a frozen or wedged process does not. So a replica silent
        for half its limit is sent one, and again every half limit while the silence lasts
        and it keeps answering."""
        ejection = pool.spec.ejection
        for r in pool.replicas.values():
            if not r.reads or not r.healthy:
                continue
            load = pool.load
            limit = max(ejection.stall_s, 20 * (load.steps.step_s(r.name) or 0.0))
            pending, rate = load.pending_prefill.get(r.name, 0.0), load.steps.rate
            if pending and rate > 0:
                # A prefill the gateway knows to be pending is work, not a stall.
                limit += pending / rate
            silent_since = max(r.last_chunk_at, r.reads_since)
            if now - silent_since < limit / 2:
                continue
            if r.answered_at >= max(silent_since, now - limit / 2):
                continue  # answered lately: busy, not frozen
            if r.stall_check is not None and not r.stall_check.done():
                continue
            r.stall_check = asyncio.create_task(self._ask(pool, r, silent_since, limit))
            self._asking.add(r.stall_check)
            r.stall_check.add_done_callback(self._asking.discard)

    async def _ask(self, pool: Pool, r: ReplicaState, silent_since: float,
                   limit: float) -> None:
        """A health check of a replica that looks stalled. Unanswered (within
        `health.timeout_s`) while the replica stayed silent: it is stalled, and ejected; its
        requests that have sent nothing to their client yet are tried on another replica. A
        pool's last healthy replica is kept: with nowhere else to go, ejecting it would turn
        requests that wait into requests that fail."""
        # The check gets the health timeout the operator set, not a share of the silence
        # allowed: on a saturated host a starved engine answers late, and cutting the wait
        # shorter took such live replicas for frozen ones, every replica a request was
        # tried on in turn (502s). A frozen replica is out after half its limit plus that
        # timeout.
        outcome, why = await pool.adapter.check(self.upstream, r.base_url,
                                                pool.health.timeout_s)
        now = time.perf_counter()
        if outcome is Probe.OK:
            r.answered_at = now
            return
        r.unanswered_at = now
        if not r.healthy or not r.reads or max(r.last_chunk_at, r.reads_since) > silent_since:
            return  # it spoke meanwhile, or nothing waits on it any more
        silent = now - silent_since
        if not any(o.healthy for o in pool.replicas.values() if o is not r):
            log.warning("replica %s/%s sent no byte for %.1f s and answered no health check, "
                        "but is the last healthy replica of its pool: kept in rotation",
                        pool.name, r.name, silent)
            return
        self._eject(pool, r, f"stalled: no byte for {silent:.1f} s with {r.reads} stream(s) "
                    f"waiting, and no answer to a health check ({why or outcome.name})",
                    "stalled")
        for attempt in list(r.holding):
            attempt.interrupt("stalled")

    def request_succeeded(self, pool: Pool, r: ReplicaState) -> None:
        """A live request got its answer: the replica's failures in a row start again."""
        r.live_failures = 0
        if r.ejections and r.healthy:
            r.ejections = 0

    def request_failed(self, pool: Pool, r: ReplicaState, error: str,
                       hard: bool = False) -> None:
        """A live request failed on the replica. `hard` (its connection broke, or it said
        503): eject at once; else after `consecutive_failures` in a row."""
        r.live_failures += 1
        if hard or r.live_failures >= pool.spec.ejection.consecutive_failures:
            self._eject(pool, r, error, "broken" if hard else "consecutive_failures")

    def _eject(self, pool: Pool, r: ReplicaState, error: str, reason: str) -> None:
        if not r.healthy and r.ejected_until > time.monotonic():
            return  # already out
        ejection = pool.spec.ejection
        length = min(ejection.max_s, ejection.base_s * 2 ** r.ejections)
        r.ejections += 1
        r.ejected_until = time.monotonic() + length
        log.warning("replica %s/%s ejected for %.1f s: %s", pool.name, r.name, length, error)
        self.listener.ejected(pool.name, r.name, reason)
        self.mark_failed(pool, r, error)

    async def probe(self, pool: Pool, r: ReplicaState) -> None:
        outcome, why = await pool.adapter.check(self.upstream, r.base_url,
                                                pool.health.timeout_s)
        if r.draining or pool.replicas.get(r.name) is not r:
            return  # left the pool (or was replaced) while the check was out
        if outcome is Probe.OK and r.ejected_until > time.monotonic():
            return  # still ejected: live traffic saw it fail more recently than this probe
        if outcome is Probe.OK:
            r.live_failures = 0
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

    def forget(self, pool: Pool, name: str) -> None:
        """`name` left `pool` (or was replaced): its next health state is logged afresh."""
        self._reported.pop((pool.name, name), None)

    async def check_now(self, pool: Pool, r: ReplicaState) -> None:
        """Probe and scrape a replica that just joined, without waiting for the next round."""
        await asyncio.gather(self.probe(pool, r), self.scrape(pool, r))

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
        async with r.scraping:
            await self._scrape(pool, r)

    async def _scrape(self, pool: Pool, r: ReplicaState) -> None:
        read_at = time.time()  # the clock requests are stamped with as they are sent
        snap = await pool.adapter.scrape(self.upstream, r.base_url, pool.health.timeout_s)
        if snap is None or r.draining or pool.replicas.get(r.name) is not r:
            return
        had_capacity = r.snapshot is not None and r.snapshot.capacity_tokens
        now = time.monotonic()
        r.observe_snapshot(snap, pool.health.hit_ratio_window_s, now)
        pool.load.engines.report(r.name, now, snap.computed_prompt_tokens, snap.prefill_seconds,
                                 snap.prefills)
        self._tell_counts(pool, r, snap, read_at)
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
