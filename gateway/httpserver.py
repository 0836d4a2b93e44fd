"""The gateway's HTTP/1.1 server protocol: uvicorn's httptools protocol with limits on request
heads, read timeouts, a connection cap that sheds the slowest connections, and OpenAI-shaped
errors for requests the parser rejects."""

from __future__ import annotations

import asyncio
import http
import logging
import resource
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.errors import error_body

log = logging.getLogger("prefix_gateway.server")

# Where a connection is in its current request. Timeouts and shedding apply to all but ACTIVE.
IDLE = 0  # kept alive between requests
HEAD = 1  # a request line and headers are arriving (or a new connection has sent nothing yet)
BODY = 2  # the headers are in, the body is arriving
ACTIVE = 3  # the request is whole; the gateway is answering it

# Descriptors kept free besides two per client connection (one to the client, one to the
# replica answering it): logs, health checks, Redis, the listening socket.
_RESERVED_FDS = 64


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one gateway process accepts from its clients."""

    max_header_bytes: int
    max_headers: int
    header_timeout_s: float
    body_timeout_s: float
    keepalive_timeout_s: float
    max_connections: int


class _Reject(Exception):
    """Raised from a parser callback: answer `status` and close the connection."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def descriptor_cap(configured: int) -> int:
    """`configured`, lowered so that the connections the cap admits (each with one upstream
    connection) never run the process out of file descriptors. Raises the soft descriptor limit
    to the hard one first: past the limit, accept() fails and new clients wait in the kernel's
    backlog behind connections the gateway can no longer shed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    fits = max(16, (soft - _RESERVED_FDS) // 2)
    if fits < configured:
        log.warning("server.max_connections %d lowered to %d: the process may open %d file "
                    "descriptors (raise it with ulimit -n)", configured, fits, soft)
    return min(configured, fits)


def protocol_class(limits: ServerLimits) -> type[LimitedProtocol]:
    """A protocol class for uvicorn's `http=` setting, bound to `limits` (one server each)."""
    return type("GatewayProtocol", (LimitedProtocol,), {"limits": limits, "_sweeper": None})


def _response(status: int, body: bytes, extra: list[tuple[bytes, bytes]]) -> bytes:
    phrase = http.HTTPStatus(status).phrase.encode()
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, phrase)]
    lines += [name + b": " + value + b"\r\n" for name, value in extra]
    lines.append(b"content-type: application/json\r\ncontent-length: %d\r\n"
                 b"connection: close\r\n\r\n" % len(body))
    return b"".join(lines) + body


class LimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, bounded. The per-request work is a few attribute writes;
    timeouts are enforced by one sweep over the connections (at most every second) rather than
    a timer per request, which also replaces uvicorn's keep-alive timer."""

    limits: ClassVar[ServerLimits]
    _sweeper: ClassVar[asyncio.TimerHandle | None]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase = HEAD
        self._since = 0.0
        self._head_bytes = 0
        """Bytes received while a request head was expected (may include its body's start)."""

    # Connection events ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        full = len(self.connections) >= self.limits.max_connections
        super().connection_made(transport)
        self._since = self.loop.time()
        if full and not self._shed():
            self._refuse(503, "The gateway has too many open connections; retry shortly.",
                         "too_many_connections", [(b"retry-after", b"1")])
            return
        cls = type(self)
        if cls._sweeper is None:
            # Bound to the class, not to this connection: it must not keep it alive.
            cls._sweeper = self.loop.call_later(cls._sweep_interval(), cls._sweep,
                                                self.connections, self.loop)

    def data_received(self, data: bytes) -> None:
        # The phase is kept here rather than in the parser's callbacks: a Python call less per
        # callback, on every request.
        phase = self._phase
        if phase <= HEAD:
            if phase == IDLE:  # the first bytes of a new request on a kept-alive connection
                self._phase = HEAD
                self._since = self.loop.time()
            self._head_bytes += len(data)
        elif phase == BODY:
            self._since = self.loop.time()  # the body is still arriving: not silent
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # Upgrades are never accepted (uvicorn runs with ws="none"): the request is served
            # as plain HTTP, as uvicorn does.
            self._unsupported_upgrade_warning()
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, _Reject):
                self._refuse(cause.status, cause.message, cause.code)
            else:
                log.debug("malformed request from %s: %s", self.client, exc)
                self._refuse(400, f"Malformed HTTP request: {exc}.", "malformed_request")
            return
        phase = self._phase
        if phase == BODY:
            if not self.cycle.more_body:  # the request is whole: it is being answered
                self._phase = ACTIVE
        elif phase == HEAD and self._head_bytes > self.limits.max_header_bytes:
            self._refuse(431, self._too_large(), "request_header_fields_too_large")

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, f"Malformed HTTP request: {msg}", "malformed_request")

    # Parser callbacks ----------------------------------------------------------------------

    def on_headers_complete(self) -> None:
        limits = self.limits
        if len(self.headers) > limits.max_headers:
            raise _Reject(431, f"Too many request headers (at most {limits.max_headers}).",
                          "request_header_fields_too_large")
        # Exact size only when the bytes received so far could exceed it (they may include
        # the start of the body).
        if self._head_bytes > limits.max_header_bytes and self._head_size() > \
                limits.max_header_bytes:
            raise _Reject(431, self._too_large(), "request_header_fields_too_large")
        self._head_bytes = 0
        self._phase = BODY
        self._since = self.loop.time()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        # uvicorn's, without its per-response keep-alive timer: the sweep closes idle
        # connections.
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        elif self._phase == ACTIVE:
            self._phase = IDLE
            self._since = self.loop.time()

    # Limits -------------------------------------------------------------------------------

    def _head_size(self) -> int:
        return len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)

    def _too_large(self) -> str:
        return (f"The request line and headers are larger than "
                f"{self.limits.max_header_bytes} bytes.")

    def _refuse(self, status: int, message: str, code: str,
                extra: list[tuple[bytes, bytes]] | None = None) -> None:
        """Answer with an OpenAI-shaped error and close the connection."""
        transport = self.transport
        if transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or not cycle.response_started:
            kind = "server_error" if status >= 500 else "invalid_request_error"
            body = error_body(message, type=kind, code=code)
            transport.write(_response(status, body,
                                      [*self.server_state.default_headers, *(extra or ())]))
        transport.close()

    def _shed(self) -> bool:
        """Close the connection that has waited longest while not being answered (idle, or
        still sending its request), to make room for a new one. False if every connection is
        being answered."""
        victim = None
        for conn in self.connections:
            if conn is self or getattr(conn, "_phase", ACTIVE) == ACTIVE:
                continue
            if victim is None or conn._since < victim._since:
                victim = conn
        if victim is None:
            return False
        if victim._phase == IDLE or (victim._head_bytes == 0 and victim._phase == HEAD):
            victim.transport.close()
        else:
            victim._refuse(503, "The connection was closed to serve others: its request did "
                           "not arrive in time.", "connection_shed")
        return True

    @classmethod
    def _sweep_interval(cls) -> float:
        limits = cls.limits
        shortest = min(limits.header_timeout_s, limits.body_timeout_s,
                       limits.keepalive_timeout_s)
        return min(1.0, max(0.05, shortest / 4))

    @classmethod
    def _sweep(cls, conns: set[Any], loop: asyncio.AbstractEventLoop) -> None:
        """Close the connections past their phase's timeout; runs while any connection is
        open."""
        if not conns:
            cls._sweeper = None
            return
        limits = cls.limits
        now = loop.time()
        for conn in list(conns):
            phase = getattr(conn, "_phase", ACTIVE)
            if phase == ACTIVE:
                continue
            waited = now - conn._since
            if phase == IDLE:
                if waited > limits.keepalive_timeout_s:
                    conn.transport.close()
            elif phase == HEAD:
                if waited > limits.header_timeout_s:
                    if conn._head_bytes == 0:  # never sent a byte: nothing to answer
                        conn.transport.close()
                    else:
                        conn._refuse(408, f"The request headers did not arrive within "
                                     f"{limits.header_timeout_s:g} s.", "request_timeout")
            elif waited > limits.body_timeout_s:
                conn._refuse(408, f"The request body stopped arriving for "
                             f"{limits.body_timeout_s:g} s before its end.", "request_timeout")
        cls._sweeper = loop.call_later(cls._sweep_interval(), cls._sweep, conns, loop)
