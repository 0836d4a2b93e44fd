"""Clients that leave: nothing stays behind in the gateway, and the engine stops generating.

The gateway runs in this process (so its live objects can be counted) under uvicorn on a real
socket, with each production transport (`server.upstream_client`), in front of a simulated
replica process; the clients are raw sockets that send a request and close before the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
from collections.abc import AsyncIterator, Iterator

import aiohttp
import httpx
import orjson
import pytest
import uvicorn

from backends.upstream.httptools_client import HttptoolsResponse
from gateway import processes
from gateway.app import GatewayApp
from gateway.attempt import Attempt
from gateway.config import parse_config
from tests.conftest import eventually


@pytest.fixture(scope="module")
def slow_replica(tmp_path_factory) -> Iterator[str]:
    """A simulated vLLM replica at real speed: a long answer takes seconds, time enough to
    leave in the middle of it."""
    tmp = tmp_path_factory.mktemp("disconnects")
    port = processes.free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    proc = processes.spawn([sys.executable, "-m", "backends.sim", "--port", str(port),
                            "--time-scale", "1", "--name", "slow"], str(tmp / "sim.log"))
    try:
        processes.wait_healthy([url], [proc], deadline_s=30)
        yield url
    finally:
        processes.stop_all([proc])


@contextlib.asynccontextmanager
async def served(replica: str, **server) -> AsyncIterator[tuple[GatewayApp, int]]:
    """The gateway app under uvicorn on a free port, in this event loop."""
    port = processes.free_ports(1)[0]
    cfg = parse_config({
        "server": {"port": port, **server},
        "pools": [{"name": "p", "engine": "vllm", "models": ["tiny"],
                   "replicas": [{"name": "slow", "url": replica}],
                   "health": {"interval_s": 0.2, "metrics_interval_s": 0.2}}],
        "traffic_classes": [{"name": "c", "pool": "p"}],
        "classification": {"default_class": "c"}})
    app = GatewayApp(cfg)
    # No lifespan: it would gc.freeze() this test process. The state is started here instead.
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http="httptools",
                                        log_level="warning", lifespan="off"))
    await app.state.start()
    task = asyncio.create_task(srv.serve())
    try:
        await eventually(lambda: srv.started)
        yield app, port
    finally:
        srv.should_exit = True
        await task
        await app.state.stop()


def _request(stream: bool, max_tokens: int = 2000) -> bytes:
    body = orjson.dumps({"model": "tiny", "prompt": "tell a long story " * 20,
                         "max_tokens": max_tokens, "stream": stream})
    return (b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\n\r\n" % len(body)) + body


def _inflight(app: GatewayApp) -> int:
    return sum(app.state.pools[0].load.inflight.values())


async def _abandon(app: GatewayApp, port: int, stream: bool) -> None:
    """Send a request, wait until the gateway is reading the replica's answer, and leave."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_request(stream))
    await writer.drain()
    if stream:
        await reader.readuntil(b"data: ")  # the stream has started
    else:
        await eventually(lambda: _inflight(app) > 0)
    writer.close()
    await writer.wait_closed()


def _live(kind: type) -> int:
    return sum(isinstance(o, kind) for o in gc.get_objects())


CLIENTS = ["httptools", "aiohttp"]


def _responses() -> int:
    """Upstream responses alive, of either transport."""
    return _live(aiohttp.ClientResponse) + _live(HttptoolsResponse)


@pytest.mark.parametrize("client", CLIENTS)
async def test_abandoned_requests_leave_nothing_behind(slow_replica: str, client: str) -> None:
    # The counts are of the whole process: under pytest-xdist a worker may still hold objects
    # of the tests it ran before this one, which are not this gateway's to free.
    gc.collect()
    readers_before, responses_before = _live(aiohttp.StreamReader), _responses()
    async with served(slow_replica, upstream_client=client) as (app, port):
        for i in range(20):
            await _abandon(app, port, stream=i % 2 == 0)
        await eventually(lambda: _inflight(app) == 0)

        def collected() -> bool:
            gc.collect()
            # Those of health checks and scrapes (every 0.2 s) may be alive at any moment.
            return (_live(aiohttp.StreamReader) <= readers_before + 2
                    and _responses() <= responses_before + 2)

        # Before the fix, each abandoned response's reader (with its buffer) and the frames
        # that read it stayed alive for good: 20 of them here.
        await eventually(collected)
        assert _live(Attempt) == 0
        # The abandoned requests' connections were dropped, not kept: at most the health
        # checks' and scrapes' remain.
        if client == "httptools":
            await eventually(lambda: app.state.upstream.connections() <= 2)


def _aborted(replica: str) -> int:
    return httpx.get(replica + "/sim/state").json()["request_aborted"]


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize(("stream", "non_streaming_ttft"),
                         [(True, True), (False, True), (False, False)])
async def test_a_client_that_leaves_aborts_the_engine_request(
        slow_replica: str, stream: bool, non_streaming_ttft: bool, client: str) -> None:
    async with served(slow_replica, non_streaming_ttft=non_streaming_ttft,
                      upstream_client=client) as (app, port):
        before = await asyncio.to_thread(_aborted, slow_replica)
        for _ in range(3):
            await _abandon(app, port, stream)
        # The replica sees its connection dropped and aborts the request in its engine. With
        # non_streaming_ttft off the replica sends nothing until its answer is whole: the
        # gateway must drop the request while still waiting for the response's headers.
        await eventually(lambda: _aborted_since(slow_replica, before, 3))
        await eventually(lambda: _inflight(app) == 0)
        gc.collect()
        assert _live(Attempt) == 0 and _responses() <= 2


async def _aborted_since(replica: str, before: int, n: int) -> bool:
    return await asyncio.to_thread(_aborted, replica) - before >= n
