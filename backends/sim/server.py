"""Simulated replicas over real sockets: an aiohttp front for `SimApp`, and the runner hosting them.

Every request goes to `SimApp.handle`, the same handler in-process callers use; this module
adds only what needs a socket: writing streamed chunks as they come, TCP_NODELAY, cancelling
a handler whose client went away, and /sim/drop_reused's closing of kept-alive connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from aiohttp import web

from backends.sim.app import SimApp
from backends.sim.replica import SimReplica, SimReplicaSpec

__all__ = ["SimCluster", "SimReplicaSpec", "build_app", "run_sim", "serve_sims", "start_sims"]

SIM_APP: web.AppKey[SimApp] = web.AppKey("sim_app", SimApp)
# Connections that already served a request: the ones /sim/drop_reused may close.
SERVED: web.AppKey[weakref.WeakSet] = web.AppKey("served", weakref.WeakSet)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _keepalive_faults(request: web.Request, handler: Handler) -> web.StreamResponse:
    sim, served = request.app[SIM_APP], request.app[SERVED]
    connection = request.transport
    if connection is None:
        return await handler(request)
    if sim.drop_reused and connection in served and request.path.startswith("/v1/"):
        sim.drop_reused -= 1
        # Closed before a byte of the answer: what a client racing an idle timeout sees.
        connection.close()
        raise web.HTTPServiceUnavailable()
    served.add(connection)
    return await handler(request)


async def _serve(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    answer = await request.app[SIM_APP].handle(
        request.method, request.path_qs, request.headers, body
    )
    if answer.stream is None:
        return web.Response(status=answer.status, headers=answer.headers, body=answer.body)
    try:
        resp = web.StreamResponse(status=answer.status, headers=answer.headers)
        await resp.prepare(request)
        _set_nodelay(request)
        async for chunk in answer.stream:
            await resp.write(chunk)
        await resp.write_eof()
        return resp
    finally:
        # Also when the client went away mid-stream (the handler is cancelled): free the slot.
        await answer.stream.aclose()


def _set_nodelay(request: web.Request) -> None:
    # Small SSE writes must not wait for delayed ACKs (Nagle); aiohttp sets it too, but the
    # streaming TTFT a gateway measures depends on it, so make sure.
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def build_app(sim: SimApp) -> web.Application:
    """The aiohttp application of one replica: every path goes to `sim.handle`."""
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[_keepalive_faults])
    app[SIM_APP] = sim
    app[SERVED] = weakref.WeakSet()
    app.router.add_route("*", "/{path:.*}", _serve)
    return app


@dataclass
class SimCluster:
    """Running replicas: their models (ports resolved) and how to stop them."""

    host: str
    replicas: list[SimReplica]
    _runners: list[web.AppRunner] = field(default_factory=list, repr=False)

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.host}:{r.port}" for r in self.replicas]

    def by_name(self, name: str) -> SimReplica:
        for r in self.replicas:
            if r.spec.name == name:
                return r
        raise KeyError(name)

    async def stop(self) -> None:
        for r in self.replicas:
            r.close()
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()


async def start_sims(specs: Sequence[SimReplicaSpec], host: str = "127.0.0.1") -> SimCluster:
    """Start every replica on its port in this event loop; port 0 picks a free one."""
    cluster = SimCluster(host, [])
    try:
        for spec in specs:
            sim = SimApp.from_spec(spec)
            # Cancel handlers whose client went away, so the engine aborts the request as
            # vLLM and trtllm-serve do, instead of generating for nobody.
            runner = web.AppRunner(build_app(sim), access_log=None, handler_cancellation=True)
            await runner.setup()
            cluster._runners.append(runner)
            site = web.TCPSite(runner, host, spec.port)
            await site.start()
            server = site._server
            assert server is not None
            sim.replica.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            cluster.replicas.append(sim.replica)
    except BaseException:
        await cluster.stop()
        raise
    return cluster


async def run_sim(replicas: Sequence[SimReplicaSpec], host: str = "127.0.0.1") -> None:
    """Serve the replicas until cancelled."""
    cluster = await start_sims(replicas, host)
    try:
        for r in cluster.replicas:
            print(
                f"sim replica {r.spec.name} ({r.spec.kind}, {r.model.profile.name}, "
                f"models {','.join(r.spec.models)}) on http://{host}:{r.port}",
                flush=True,
            )
        await asyncio.Event().wait()
    finally:
        await cluster.stop()


def serve_sims(replicas: Sequence[SimReplicaSpec], host: str = "127.0.0.1") -> None:
    """Blocking: serve the replicas until Ctrl-C."""
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run_sim(replicas, host))
