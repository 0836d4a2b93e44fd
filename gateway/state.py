"""Everything a running gateway holds: config, pools, classifier, HTTP client, observers."""

from __future__ import annotations

import aiohttp

from backends.health import HealthMonitor
from backends.pool import Pool
from gateway.classify import Classifier
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.observe import Observer
from gateway.stats import StatsRecorder


class GatewayState:
    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics | None = None) -> None:
        self.config = config
        self.pools = [Pool(p, config.routing_for(p)) for p in config.pools]
        self.pool_by_name = {p.name: p for p in self.pools}
        self.pool_for_class = {c.name: self.pool_by_name[c.pool] for c in config.traffic_classes}
        self.classifier = Classifier(config.classification, set(self.pool_for_class))
        self.metrics = metrics or GatewayMetrics()
        self.stats = StatsRecorder()
        self.observer = Observer(self.metrics, self.stats)
        self.models = sorted({m for p in self.pools for m in p.models})
        self.http: aiohttp.ClientSession | None = None
        self.http_fresh: aiohttp.ClientSession | None = None
        self.monitor: HealthMonitor | None = None

    async def start(self) -> None:
        # One pooled client for every replica: keep-alive connections, no per-host cap (the
        # engines queue themselves; a cap here would only add a second, invisible queue).
        self.http = _upstream_session(aiohttp.TCPConnector(
            limit=0, limit_per_host=0, enable_cleanup_closed=True,
            keepalive_timeout=self.config.server.upstream_keepalive_s))
        # For the one resend after a kept-alive connection turned out closed: a new connection
        # for certain, not another idle one that may be closing too.
        self.http_fresh = _upstream_session(aiohttp.TCPConnector(limit=0, force_close=True))
        self.monitor = HealthMonitor(self.pools, self.http, self.metrics)
        for pool in self.pools:
            self.metrics.chars_per_token.labels(pool.name).set(pool.router.chars_per_token)
            for r in pool.replicas.values():
                self.metrics.replica_up.labels(pool.name, r.name).set(0)
                self.metrics.inflight.labels(pool.name, r.name).set(0)
        await self.monitor.check_all()
        self.monitor.start()

    async def stop(self) -> None:
        if self.monitor is not None:
            await self.monitor.stop()
        for session in (self.http, self.http_fresh):
            if session is not None:
                await session.close()

    def ready(self) -> tuple[bool, dict[str, int]]:
        healthy = {p.name: sum(r.healthy for r in p.replicas.values()) for p in self.pools}
        return all(healthy.values()), healthy


def _upstream_session(connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
    # Bodies pass through as the engine sent them, and the engine sees no client name of ours.
    return aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                 skip_auto_headers=("User-Agent",))
