"""Everything a running gateway holds: config, pools, classifier, admission, upstream,
observers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from backends.health import HealthMonitor
from backends.pool import Pool, ReplicaState
from backends.upstream import Upstream
from backends.upstream.aiohttp_client import AiohttpUpstream
from backends.upstream.httptools_client import HttptoolsUpstream
from gateway.admission import Admission
from gateway.auth import Authenticator
from gateway.classify import Classifier
from gateway.config import GatewayConfig
from gateway.experiments.live import Experiments
from gateway.history import History
from gateway.metrics import GatewayMetrics
from gateway.observe import Observer
from gateway.ratelimit import RateLimiter
from gateway.redis_link import connect
from gateway.shared_routing import SharedRouting
from gateway.stats import StatsRecorder
from gateway.wiring import build_pools

if TYPE_CHECKING:
    from gateway.tracing import Tracing


class GatewayState:
    """Built from the config; `upstream` is the transport to the replicas (the one
    `server.upstream_client` names, unless a test passes an in-process one)."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics | None = None,
                 upstream: Upstream | None = None, tracing: Tracing | None = None) -> None:
        self.config = config
        self.pools = build_pools(config)
        self.pool_by_name = {p.name: p for p in self.pools}
        self.pool_for_class = {c.name: self.pool_by_name[c.pool] for c in config.traffic_classes}
        self.classifier = Classifier(config.classification, set(self.pool_for_class))
        self.metrics = metrics or GatewayMetrics()
        self.stats = StatsRecorder(config.history.decisions)
        self.history = History(config.history, self.metrics, self.stats, self.pools)
        self.tracing = tracing
        """OpenTelemetry (gateway/tracing.py), imported only when tracing is enabled."""
        if tracing is None and config.tracing.enabled:
            from gateway.tracing import Tracing

            self.tracing = Tracing(config.tracing)
        if self.tracing is None:
            self.observer = Observer(self.metrics, self.stats)
            self.admission = Admission(config, self.pool_by_name, self.observer)
        else:
            # The same observer and admission, which also annotate the request's span.
            self.observer = self.tracing.observer(self.metrics, self.stats)
            self.admission = self.tracing.admission(config, self.pool_by_name, self.observer)
        self.auth = Authenticator(config)
        self.redis = connect(config.redis) if config.redis is not None else None
        """The one Redis client (and connection pool) of the gateway, when configured."""
        self.shared: SharedRouting | None = None
        """Routing state shared with the other gateways using the same Redis."""
        if config.redis is not None and config.redis.shared_routing.enabled:
            self.shared = SharedRouting(config.redis, self.pools, self.observer, self.redis)
        self.limiter = RateLimiter(config, self.redis)
        self.models = sorted({m for p in self.pools for m in p.models})
        self.experiments = Experiments(config, self.pool_by_name, self.metrics)
        """Engine A/B experiments (their copies are sent by the request core's mirror)."""
        self.upstream: Upstream = upstream or new_upstream(config)
        self.monitor = HealthMonitor(self.pools, self.upstream,
                                     HealthEvents(self.observer, self.admission))

    async def start(self) -> None:
        """Probe every replica once, then keep probing in the background."""
        self.observer.pools_started(self.pools)
        await self.monitor.check_all()
        self.admission.started()
        self.monitor.start()
        if self.shared is not None:
            self.shared.start()
        self.history.start()

    async def stop(self) -> None:
        await self.history.stop()
        await self.monitor.stop()
        if self.experiments.mirror is not None:
            await self.experiments.mirror.stop()
        if self.shared is not None:
            await self.shared.stop()
        await self.upstream.aclose()
        await self.limiter.aclose()
        if self.redis is not None:
            await self.redis.aclose()
        if self.tracing is not None:
            await self.tracing.shutdown()

    def ready(self) -> tuple[bool, dict[str, int]]:
        healthy = {p.name: sum(r.healthy for r in p.replicas.values()) for p in self.pools}
        return all(healthy.values()), healthy


def new_upstream(config: GatewayConfig) -> Upstream:
    """The transport `server.upstream_client` names."""
    server = config.server
    if server.upstream_client == "aiohttp":
        return AiohttpUpstream(keepalive_s=server.upstream_keepalive_s)
    return HttptoolsUpstream(keepalive_s=server.upstream_keepalive_s)


class HealthEvents:
    """What health checks find, told to the observer (metrics) and to admission control (a
    pool's capacity follows its healthy replicas)."""

    def __init__(self, observer: Observer, admission: Admission) -> None:
        self.observer = observer
        self.admission = admission

    def replica_up(self, pool: str, replica: str, up: bool) -> None:
        self.observer.replica_up(pool, replica, up)
        self.admission.health_changed(pool)

    def engine_state(self, pool: str, replica: ReplicaState) -> None:
        self.observer.engine_state(pool, replica)

    def step_timing(self, pool: Pool) -> None:
        self.observer.step_timing(pool)

    def ejected(self, pool: str, replica: str, reason: str) -> None:
        self.observer.ejected(pool, replica, reason)
