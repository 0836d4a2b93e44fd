"""Health state: failures take replicas out; timeouts alone leave them as a last resort."""

from __future__ import annotations

from backends.adapters import EngineAdapter, EngineSnapshot, Probe
from backends.health import HealthMonitor
from backends.pool import Pool
from gateway.config import PoolConfig, RoutingSettings
from gateway.metrics import GatewayMetrics


class ScriptedAdapter(EngineAdapter):
    """Answers probes from a script per replica URL, no network."""

    kind = "scripted"

    def __init__(self) -> None:
        self.outcomes: dict[str, Probe] = {}

    async def probe(self, http, base_url: str, timeout: float) -> Probe:
        return self.outcomes[base_url]

    async def scrape(self, http, base_url: str, timeout: float) -> EngineSnapshot | None:
        return None


def make_pool() -> tuple[Pool, ScriptedAdapter, HealthMonitor]:
    cfg = PoolConfig(name="p", engine="vllm", models=["m"], replicas=[
        {"name": "a", "url": "http://127.0.0.1:1"}, {"name": "b", "url": "http://127.0.0.1:2"}],
        health={"failure_threshold": 2})
    pool = Pool(cfg, RoutingSettings())
    adapter = ScriptedAdapter()
    pool.adapter = adapter
    return pool, adapter, HealthMonitor([pool], http=None, metrics=GatewayMetrics())


async def probe_all(monitor: HealthMonitor, pool: Pool) -> None:
    for r in pool.replicas.values():
        await monitor._probe(pool, r)


async def test_threshold_then_recovery() -> None:
    pool, adapter, monitor = make_pool()
    adapter.outcomes = {"http://127.0.0.1:1": Probe.OK, "http://127.0.0.1:2": Probe.OK}
    await probe_all(monitor, pool)
    assert [v.name for v in pool.healthy_views("m")] == ["a", "b"]
    adapter.outcomes["http://127.0.0.1:2"] = Probe.DEAD
    await probe_all(monitor, pool)
    assert pool.replicas["b"].healthy  # one failure is below the threshold of 2
    await probe_all(monitor, pool)
    assert [v.name for v in pool.healthy_views("m")] == ["a"]
    adapter.outcomes["http://127.0.0.1:2"] = Probe.OK
    await probe_all(monitor, pool)
    assert [v.name for v in pool.healthy_views("m")] == ["a", "b"]
    assert pool.healthy_views("other-model") == []


async def test_timeouts_alone_do_not_empty_a_pool() -> None:
    pool, adapter, monitor = make_pool()
    adapter.outcomes = {"http://127.0.0.1:1": Probe.TIMEOUT, "http://127.0.0.1:2": Probe.TIMEOUT}
    for _ in range(3):
        await probe_all(monitor, pool)
    assert not any(r.healthy for r in pool.replicas.values())
    assert "timed out" in pool.replicas["a"].last_error
    # Every replica is only suspect: the pool still routes to them rather than failing all.
    assert [v.name for v in pool.healthy_views("m")] == ["a", "b"]
    adapter.outcomes["http://127.0.0.1:1"] = Probe.DEAD
    await probe_all(monitor, pool)
    assert [v.name for v in pool.healthy_views("m")] == ["b"]
    # A healthy replica, once there is one, is preferred over suspects.
    adapter.outcomes["http://127.0.0.1:1"] = Probe.OK
    await probe_all(monitor, pool)
    assert [v.name for v in pool.healthy_views("m")] == ["a"]
    # A connection failure on the request path is proof, not suspicion.
    monitor.mark_failed(pool, pool.replicas["a"], "refused")
    assert [v.name for v in pool.healthy_views("m")] == ["b"]
    monitor.mark_failed(pool, pool.replicas["b"], "refused")
    assert pool.healthy_views("m") == []
