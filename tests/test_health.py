"""Health state: failures take replicas out; timeouts alone leave them as a last resort."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from backends.health import HealthMonitor
from backends.pool import HealthTiming, Pool, PoolSpec, ReplicaSpec
from backends.upstream.inprocess import HandlerResponse, InProcessUpstream
from gateway.metrics import GatewayMetrics
from gateway.observe import Observer
from gateway.stats import StatsRecorder
from routing import Router, build_policy

A, B = "http://127.0.0.1:1", "http://127.0.0.1:2"


class ScriptedReplica:
    """Answers /health as scripted: 'ok' (200), 'dead' (503) or 'hang' (never answers)."""

    def __init__(self) -> None:
        self.mode = "ok"

    async def __call__(self, method: str, path: str, headers: Mapping[str, str],
                       body: bytes) -> HandlerResponse:
        if self.mode == "hang":
            await asyncio.Event().wait()
        return HandlerResponse(200 if self.mode == "ok" else 503)


def make_pool() -> tuple[Pool, dict[str, ScriptedReplica], HealthMonitor, GatewayMetrics]:
    spec = PoolSpec("p", "vllm", ("m",), (ReplicaSpec("a", A), ReplicaSpec("b", B)),
                    health=HealthTiming(failure_threshold=2, timeout_s=0.25))
    pool = Pool(spec, Router((), build_policy("least_load")))
    replicas = {A: ScriptedReplica(), B: ScriptedReplica()}
    metrics = GatewayMetrics()
    monitor = HealthMonitor([pool], InProcessUpstream(replicas),
                            Observer(metrics, StatsRecorder()))
    return pool, replicas, monitor, metrics


async def probe_all(monitor: HealthMonitor, pool: Pool) -> None:
    # A probe timeout generous enough that an answering replica never misses it on a busy
    # machine; the replicas are probed together, as the monitor does.
    await asyncio.gather(*(monitor.probe(pool, r) for r in pool.replicas.values()))


def healthy(pool: Pool, model: str = "m") -> list[str]:
    return [v.name for v in pool.healthy_views(model)]


async def test_threshold_then_recovery() -> None:
    pool, replicas, monitor, metrics = make_pool()
    await probe_all(monitor, pool)
    assert healthy(pool) == ["a", "b"]
    assert metrics.registry.get_sample_value("gateway_replica_up",
                                             {"pool": "p", "replica": "b"}) == 1
    replicas[B].mode = "dead"
    await probe_all(monitor, pool)
    assert pool.replicas["b"].healthy  # one failure is below the threshold of 2
    await probe_all(monitor, pool)
    assert healthy(pool) == ["a"]
    assert metrics.registry.get_sample_value("gateway_replica_up",
                                             {"pool": "p", "replica": "b"}) == 0
    replicas[B].mode = "ok"
    await probe_all(monitor, pool)
    assert healthy(pool) == ["a", "b"]
    assert healthy(pool, "other-model") == []


async def test_timeouts_alone_do_not_empty_a_pool() -> None:
    pool, replicas, monitor, _ = make_pool()
    replicas[A].mode = replicas[B].mode = "hang"
    for _ in range(3):
        await probe_all(monitor, pool)
    assert not any(r.healthy for r in pool.replicas.values())
    assert "timed out" in pool.replicas["a"].last_error
    # Every replica is only suspect: the pool still routes to them rather than failing all.
    assert healthy(pool) == ["a", "b"]
    replicas[A].mode = "dead"
    await probe_all(monitor, pool)
    assert healthy(pool) == ["b"]
    # A healthy replica, once there is one, is preferred over suspects.
    replicas[A].mode = "ok"
    await probe_all(monitor, pool)
    assert healthy(pool) == ["a"]
    # A connection failure on the request path is proof, not suspicion.
    monitor.mark_failed(pool, pool.replicas["a"], "refused")
    assert healthy(pool) == ["b"]
    monitor.mark_failed(pool, pool.replicas["b"], "refused")
    assert healthy(pool) == []
