"""A gateway in the test's event loop, with the production transport (aiohttp) to simulated
replicas that are processes on loopback addresses, for the discovery tests: DNS
(tests/test_discovery.py) and Kubernetes (tests/test_discovery_kubernetes.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import GatewayApp
from gateway.config import parse_config
from gateway.discovery import Resolver
from gateway.state import GatewayState
from tests.conftest import Sims, eventually, start_sims
from tests.inprocess import FAST_HEALTH, GATEWAY


def one_pool(discovery: dict[str, Any], replicas: list[dict[str, str]] | None = None,
             ) -> dict[str, Any]:
    return {
        # The held streams are silent on purpose (their replica is stopped): no stall watch.
        "pools": [{"name": "rt", "engine": "vllm", "models": ["tiny"],
                   "replicas": replicas or [], "discovery": discovery,
                   "health": FAST_HEALTH, "ejection": {"stall_s": 0}}],
        "traffic_classes": [{"name": "realtime", "pool": "rt"}],
        "classification": {"default_class": "realtime"},
    }


@dataclass
class Running:
    app: GatewayApp
    http: httpx.AsyncClient

    async def listed(self) -> dict[str, dict[str, Any]]:
        r = await self.http.get("/admin/replicas")
        assert r.status_code == 200
        return {rep["name"]: rep for p in r.json()["pools"] for rep in p["replicas"]}

    async def healthy(self, name: str) -> bool:
        rep = (await self.listed()).get(name)
        return bool(rep and rep["healthy"] and not rep["draining"])

    async def sample(self, name: str, **labels: str) -> float | None:
        text = (await self.http.get("/metrics")).text
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return None

    def inflight(self, name: str) -> int:
        return self.app.state.pool_by_name["rt"].load.inflight.get(name, 0)

    async def complete(self, prompt: str) -> str:
        """A short completion; the replica that answered it."""
        r = await self.http.post("/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200, r.text
        return r.headers["x-gateway-replica"]

    async def serves(self, name: str, tries: int = 8) -> bool:
        """Whether one of `tries` cold prompts went to `name`."""
        for i in range(tries):
            if await self.complete(f"spread {name} {i} {os.urandom(4).hex()} " * 40) == name:
                return True
        return False

    async def stream(self, prompt: str, max_tokens: int = 400) -> tuple[int, str, str]:
        """A streamed completion read to its end: status, replica, body."""
        async with self.http.stream("POST", "/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                "stream": True}) as r:
            body = (await r.aread()).decode()
            return r.status_code, r.headers.get("x-gateway-replica", ""), body

    async def hold_streams_on(self, name: str, proc: subprocess.Popen
                              ) -> list[asyncio.Task[tuple[int, str, str]]]:
        """Streams in flight on replica `name`, whose process is then stopped (SIGSTOP; the
        caller continues it), so that they stay in flight as long as the test needs."""
        tasks: list[asyncio.Task[tuple[int, str, str]]] = []
        for i in range(100):
            tasks.append(asyncio.create_task(self.stream(f"held {i} {os.urandom(4).hex()} "
                                                         * 40)))
            # Every stream routed (in flight somewhere) or done.
            await eventually(lambda: sum(self.app.state.pool_by_name["rt"].load.inflight
                                         .values()) + sum(t.done() for t in tasks)
                             >= len(tasks))
            if self.inflight(name):
                os.kill(proc.pid, signal.SIGSTOP)
                if self.inflight(name):
                    return tasks
                os.kill(proc.pid, signal.SIGCONT)  # it finished just before: again
        raise AssertionError(f"no stream stayed on {name}")


def complete_stream(result: tuple[int, str, str]) -> bool:
    status, _, body = result
    return status == 200 and body.rstrip().endswith("data: [DONE]") and '"error"' not in body


@asynccontextmanager
async def running(config: dict[str, Any], resolver: Resolver | None = None
                  ) -> AsyncIterator[Running]:
    """The gateway on `config`, started as `serve` starts it (health checks, then discovery's
    first round), until the block ends."""
    cfg = parse_config(config)
    state = GatewayState(cfg)
    app = GatewayApp(cfg, state, resolver=resolver)
    await state.start()
    await app.discovery.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=GATEWAY,
                                     timeout=60) as http:
            yield Running(app, http)
    finally:
        await app.discovery.stop()
        await app.fleet.stop()
        await state.stop()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


class FakeResolver:
    """DNS as the test says: each name's addresses, changed by the test; a name it does not
    know fails as the system's resolver does (socket.gaierror); `error` makes every
    resolution fail with it, `hang` makes every resolution wait forever."""

    def __init__(self, answers: dict[str, set[str]]) -> None:
        self.answers = {k: set(v) for k, v in answers.items()}
        self.error: OSError | None = None
        self.hang = False
        self.calls = 0

    async def resolve(self, name: str, port: int, family: str) -> set[str]:
        self.calls += 1
        if self.hang:
            await asyncio.Event().wait()
        if self.error is not None:
            raise self.error
        if name not in self.answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return set(self.answers[name])

    async def rounds(self, n: int = 2) -> None:
        """Wait until `n` more resolutions have been asked for."""
        target = self.calls + n
        await eventually(lambda: self.calls >= target)


def three_addresses(tmp_path_factory) -> Iterator[Sims]:
    """For a module fixture: three simulated engines behind one name, on one port, an
    address each (127.0.0.2-4), as DNS or EndpointSlices would list them."""
    s = start_sims(["vllm"] * 3, tmp_path_factory.mktemp("sims"), time_scale=0.2,
                   hosts=["127.0.0.2", "127.0.0.3", "127.0.0.4"])
    yield s
    s.stop()
