"""A gateway and its simulated replicas in one event loop, with no socket between them.

The gateway is the real ASGI application (reached through `httpx.ASGITransport`); its replicas
are the simulated replica's own request handler behind the in-process transport, so tests see
exactly what a client and the engines would, without processes, ports or real-time waits for
start-up.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from backends.sim.app import SimApp
from backends.sim.replica import SimReplicaSpec
from backends.upstream.inprocess import Handler, HandlerResponse, InProcessUpstream
from gateway.app import GatewayApp
from gateway.config import parse_config
from gateway.state import GatewayState

GATEWAY = "http://gateway"
FAST_HEALTH = {"interval_s": 0.1, "timeout_s": 1, "failure_threshold": 1,
               "metrics_interval_s": 0.1}


def sim_handler(sim: SimApp) -> Handler:
    """The simulated replica's handler, as the in-process transport calls it."""

    async def handle(method: str, target: str, headers: Mapping[str, str],
                     body: bytes) -> HandlerResponse:
        answer = await sim.handle(method, target, headers, body)
        return HandlerResponse(answer.status, answer.chunks(), answer.headers)

    return handle


@dataclass
class Harness:
    """A running in-process gateway: its app, an HTTP client to it, and its replicas."""

    app: GatewayApp
    http: httpx.AsyncClient
    upstream: InProcessUpstream
    sims: dict[str, SimApp] = field(default_factory=dict)
    """Replica name -> its simulated engine."""
    urls: dict[str, str] = field(default_factory=dict)
    """Replica name -> its URL in the config."""

    def openai(self, **kw: Any) -> openai.AsyncOpenAI:
        kw.setdefault("api_key", "sk-test")
        return openai.AsyncOpenAI(base_url=GATEWAY + "/v1", http_client=self.http,
                                  max_retries=0, **kw)

    async def metrics(self) -> list:
        text = (await self.http.get("/metrics")).text
        return [s for fam in text_string_to_metric_families(text) for s in fam.samples]

    async def stats(self) -> dict[str, Any]:
        return (await self.http.get("/admin/stats")).json()


def two_pools(realtime: int = 3, batch: int = 2, **routing: Any) -> dict[str, Any]:
    """Realtime replicas with vLLM's surface, batch replicas with trtllm-serve's."""
    def replicas(prefix: str, n: int) -> list[dict[str, str]]:
        return [{"name": f"{prefix}-{i}", "url": f"http://{prefix}-{i}.test:8000"}
                for i in range(n)]

    return {
        "routing": {"policy": "prefix_affinity", **routing},
        "pools": [
            {"name": "realtime", "engine": "vllm", "models": ["tiny"],
             "replicas": replicas("rt", realtime), "health": FAST_HEALTH},
            {"name": "batch", "engine": "trtllm", "models": ["tiny"],
             "replicas": replicas("bt", batch), "health": FAST_HEALTH},
        ],
        "traffic_classes": [{"name": "realtime", "pool": "realtime"},
                            {"name": "batch", "pool": "batch"}],
        "classification": {"header": "x-traffic-class", "service_tier": {"flex": "batch"},
                           "api_keys": {"sk-batch-key": "batch"},
                           "default_class": "realtime"},
    }


@asynccontextmanager
async def gateway(config: dict[str, Any], *, time_scale: float = 0.02,
                  profile: str = "llama-8b-h200",
                  handlers: Mapping[str, Handler] | None = None,
                  tracing: Any = None) -> AsyncIterator[Harness]:
    """Run the gateway on `config`, each replica a simulated engine of its pool's kind (or the
    handler given for its name), until the block ends. `tracing`: a gateway.tracing.Tracing
    (e.g. with an in-memory exporter)."""
    cfg = parse_config(config)
    upstream = InProcessUpstream()
    harness_sims: dict[str, SimApp] = {}
    urls: dict[str, str] = {}
    for pool in cfg.pools:
        for r in pool.replicas:
            urls[r.name] = r.base_url
            if handlers and r.name in handlers:
                upstream.mount(r.base_url, handlers[r.name])
                continue
            sim = SimApp.from_spec(SimReplicaSpec(
                name=r.name, kind=pool.engine, models=tuple(pool.models), profile=profile,
                time_scale=time_scale))
            harness_sims[r.name] = sim
            upstream.mount(r.base_url, sim_handler(sim))
    state = GatewayState(cfg, upstream=upstream, tracing=tracing)
    app = GatewayApp(cfg, state)
    await state.start()
    await app.discovery.start()  # what the app's lifespan starts (ASGITransport runs none)
    if app.batch is not None:
        await app.batch.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=GATEWAY,
                                     timeout=30) as http:
            yield Harness(app, http, upstream, harness_sims, urls)
    finally:
        if app.batch is not None:
            await app.batch.stop()
        await app.discovery.stop()
        await app.fleet.stop()
        await state.stop()
        for sim in harness_sims.values():
            sim.close()


def replica_answering(
        answer: Callable[[], HandlerResponse | Awaitable[HandlerResponse]]) -> Handler:
    """A replica healthy to probes, with no metrics, that answers every other request with
    `answer()`, awaited if it is a coroutine (a faulty or scripted replica beside simulated
    ones)."""

    async def handle(method: str, target: str, headers: Mapping[str, str],
                     body: bytes) -> HandlerResponse:
        if target == "/health":
            return HandlerResponse(200)
        if target == "/metrics":
            return HandlerResponse(404)
        reply = answer()
        return await reply if inspect.isawaitable(reply) else reply

    return handle


def sse_replica(stream: Callable[[], AsyncIterator[bytes]]) -> Handler:
    """A replica healthy to probes, with no metrics, that answers every other request with
    the event stream `stream()`."""
    return replica_answering(
        lambda: HandlerResponse(200, stream(), {"content-type": "text/event-stream"}))
