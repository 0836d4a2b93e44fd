"""Replica health is logged once per change, with the reason, from the first probe on."""

from __future__ import annotations

import logging

import pytest

from backends.health import HealthMonitor
from backends.pool import HealthTiming, Pool, PoolSpec, ReplicaSpec
from backends.upstream.inprocess import HandlerResponse, InProcessUpstream
from gateway.metrics import GatewayMetrics
from gateway.observe import Observer
from gateway.stats import StatsRecorder
from routing import Router, build_policy

URL = "http://10.0.0.7:8000"


async def answer_ok(method: str, path: str, headers, body: bytes) -> HandlerResponse:
    return HandlerResponse(200)


async def answer_503(method: str, path: str, headers, body: bytes) -> HandlerResponse:
    return HandlerResponse(503)


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "prefix_gateway.health"]


async def test_an_unreachable_replica_is_logged_once_per_change_with_the_reason(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="prefix_gateway.health")
    spec = PoolSpec("p", "vllm", ("m",), (ReplicaSpec("a", URL),),
                    health=HealthTiming(failure_threshold=2, timeout_s=0.5))
    pool = Pool(spec, Router((), build_policy("least_load")))
    upstream = InProcessUpstream()  # nothing mounted: connections are refused
    monitor = HealthMonitor([pool], upstream, Observer(GatewayMetrics(), StatsRecorder()))
    replica = pool.replicas["a"]
    for _ in range(3):
        await monitor.probe(pool, replica)
    assert lines(caplog) == [f"replica p/a ({URL}) is down: health check /health failed: "
                             "ClientConnectorError: connection refused"]
    upstream.mount(URL, answer_ok)
    for _ in range(2):
        await monitor.probe(pool, replica)
    assert lines(caplog)[1:] == [f"replica p/a ({URL}) is up"]
    upstream.mount(URL, answer_503)
    for _ in range(3):
        await monitor.probe(pool, replica)
    assert lines(caplog)[2:] == [f"replica p/a ({URL}) is down: health check /health failed: "
                                 "/health answered HTTP 503"]
    monitor.mark_failed(pool, replica, "a: connection reset")  # already down: not again
    assert len(lines(caplog)) == 3
