"""The default transport: HTTP/1.1 to replicas over asyncio protocols, parsed by httptools.

It does what the gateway needs and nothing else (no cookies, redirects, compression, proxies
or multidict headers), which makes a request a few Python calls: one write, one parser feed
per read, and a future for the headers. Connections are kept alive per host (most recently
used first), closed after `keepalive_s` idle, at most `max_idle_per_host` of them kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Mapping
from urllib.parse import urlsplit

import httptools

from backends.upstream.base import (
    NO_TIMEOUTS,
    ConnectFailed,
    ConnectionDropped,
    ReadFailed,
    Timeouts,
    UpstreamError,
)

_PAUSE_AT = 1 << 20
"""Bytes of a body held unread before the connection stops reading (the client is slow)."""

# Where a response is. Each step only moves forward.
_WAITING = 0  # sent, no byte of the answer yet
_HEAD = 1  # the status line or headers are arriving
_BODY = 2  # the headers are in
_DONE = 3  # the body is whole
_FAILED = 4  # broken, timed out or aborted: `_error` says which


class _Target:
    """A URL split once: the pool it belongs to and the start of its request head."""

    __slots__ = ("head", "host", "key", "pool", "port", "tls")
    pool: _HostPool
    """The connections to its host, shared by every URL there (set by the upstream)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConnectFailed(f"InvalidURL: {url}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.key = (self.tls, self.host, self.port)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.head = f" {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"


class HttptoolsResponse:
    """One replica's answer behind the UpstreamResponse protocol; the body is buffered as it
    arrives and handed out by `chunks()` (everything received since the last read, at once)."""

    __slots__ = ("_buffered", "_chunks", "_conn", "_ctype", "_deadline", "_error", "_head",
                 "_last", "_read", "_released", "_timer", "_waiter", "state", "status")

    def __init__(self, conn: _Conn, read: float | None, deadline: float | None) -> None:
        self._conn: _Conn | None = conn
        self.state = _WAITING
        self.status = 0
        self._ctype: bytes | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._waiter: asyncio.Future | None = None
        """Set while a read waits; resolved when body bytes or the end arrive."""
        self._error: UpstreamError | None = None
        self._released = False
        self._read = read
        self._deadline = deadline
        self._last = 0.0
        """loop.time() of the last byte received (of the request's sending, before)."""
        self._timer: asyncio.TimerHandle | None = None
        self._head: asyncio.Future | None = None
        """Resolved when the headers are in, failed when the exchange ends before them."""

    @property
    def content_type(self) -> str:
        return self._ctype.decode("latin-1") if self._ctype else "application/json"

    # The body --------------------------------------------------------------------------

    def chunks(self) -> HttptoolsResponse:
        return self

    def __aiter__(self) -> HttptoolsResponse:
        return self

    async def __anext__(self) -> bytes:
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                self._chunks = []
                if self._buffered > _PAUSE_AT:
                    self._resume()
                self._buffered = 0
                return data
            state = self.state
            if state == _DONE:
                raise StopAsyncIteration
            if state == _FAILED:
                raise self._failure()
            waiter = self._waiter = self._conn.loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self])

    def _failure(self) -> UpstreamError:
        error = self._error
        if error is None:
            return ReadFailed("ClientConnectionError: connection closed")
        error.__traceback__ = None  # raised again on each read: keep no frames alive
        return error

    def _resume(self) -> None:
        conn = self._conn
        if conn is not None and conn.resp is self and conn.paused:
            conn.paused = False
            conn.transport.resume_reading()
            self._last = conn.loop.time()

    # The end ---------------------------------------------------------------------------

    def abort(self) -> None:
        """Drop the connection (the replica sees it close and stops generating); a read in
        progress raises ReadFailed."""
        if self.state < _DONE:
            self._fail(None)
        conn = self._conn
        if conn is not None and conn.resp is self:
            conn.drop()

    def release(self) -> None:
        """Done with it. A response not read to its end drops its connection: what is left
        of the body would otherwise arrive ahead of the next request's answer."""
        if self._released:
            return
        self._released = True
        if self.state < _DONE:
            self.abort()
        self._chunks = []

    # Called by the connection -----------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamError | None) -> None:
        """The exchange ends without its answer; `error` (None: aborted) is what reads raise,
        or what the request raises when no header had come yet."""
        if self.state >= _DONE:
            return
        self.state = _FAILED
        self._error = error
        self._stop_timer()
        head = self._head
        if head is not None:
            self._head = None
            if not head.done():
                head.set_exception(error or ConnectFailed("ClientConnectionError: aborted"))
        self._wake()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _start_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        self._last = now = loop.time()
        at = self._due(now)
        if at is not None:
            self._timer = loop.call_at(at, self._on_timer)

    def _due(self, now: float) -> float | None:
        """When the next timeout falls, from the last byte and the deadline."""
        at = None if self._read is None else self._last + self._read
        if self._deadline is not None and (at is None or self._deadline < at):
            at = self._deadline
        return at

    def _on_timer(self) -> None:
        # One timer per request, moved on lazily: each read only notes its time.
        self._timer = None
        conn = self._conn
        if conn is None or self.state >= _DONE:
            return
        loop = conn.loop
        now = loop.time()
        if conn.paused and conn.resp is self:
            self._last = now  # the silence is the client's, not the replica's
        at = self._due(now)
        if at is not None and at > now + 0.001:
            self._timer = loop.call_at(at, self._on_timer)
            return
        what = ("the exchange outlasted its total timeout"
                if self._deadline is not None and now >= self._deadline - 0.001
                else "no byte within the read timeout")
        if self.state < _BODY:
            self._fail(ConnectFailed(f"ServerTimeoutError: {what}", timed_out=True))
        else:
            self._fail(ReadFailed(f"TimeoutError: {what}", timed_out=True))
        conn.drop()


class _Conn(asyncio.Protocol):
    """One keep-alive connection to a replica; `resp` is the response it is receiving."""

    __slots__ = (
        "_framed",
        "idle_since",
        "loop",
        "parser",
        "paused",
        "pool",
        "resp",
        "reused",
        "transport",
    )

    def __init__(self, pool: _HostPool | None, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        """Where it goes back when its response is whole (None: used once, then closed)."""
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: HttptoolsResponse | None = None
        self.reused = False
        self.paused = False
        self.idle_since = 0.0
        self._framed = False
        """The current response has a Content-Length or is chunked (else: it ends at EOF)."""

    # asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        # Registered here, not when create_connection returns: the connection may be lost
        # before the awaiting task resumes, and connection_lost must find it to forget it.
        if self.pool is not None:
            self.pool.all.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None or resp.state >= _DONE:
            self.drop()  # bytes nobody asked for: the connection cannot be trusted
            return
        resp._last = self.loop.time()
        if resp.state == _WAITING:
            resp.state = _HEAD
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.resp is resp:
                resp._fail(_bad_answer(resp, exc))
            self.drop()

    def eof_received(self) -> bool:
        return False  # close: the replica has nothing more to say on this connection

    def connection_lost(self, exc: Exception | None) -> None:
        pool = self.pool
        if pool is not None:
            pool.forget(self)
        resp = self.resp
        self.resp = None
        if resp is None or resp.state >= _DONE:
            return
        if resp.state == _BODY and exc is None and not self._framed:
            self._complete(resp)  # a body without length or chunks ends with the connection
            return
        if resp.state == _WAITING and self.reused:
            resp._fail(ConnectionDropped("ServerDisconnectedError: the kept-alive connection "
                                         "was closed before any answer"))
        elif resp.state < _BODY:
            resp._fail(ConnectFailed("ServerDisconnectedError: the connection closed before "
                                     f"the answer's headers{_why(exc)}"))
        else:
            resp._fail(ReadFailed("ClientPayloadError: the connection closed before the end "
                                  f"of the body{_why(exc)}"))

    def pause_writing(self) -> None:
        pass  # request bodies are written whole; the transport buffers them

    def resume_writing(self) -> None:
        pass

    # httptools callbacks --------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        n = len(name)
        if n == 12:
            if name.lower() == b"content-type":
                self.resp._ctype = value
        elif (n == 14 or n == 17) and name.lower() in (b"content-length",
                                                       b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        resp = self.resp
        status = self.parser.get_status_code()
        if status < 200:
            return  # 1xx: the real answer follows
        resp.status = status
        resp.state = _BODY
        head = resp._head
        if head is not None:
            resp._head = None
            if not head.done():
                head.set_result(None)

    def on_body(self, body: bytes) -> None:
        resp = self.resp
        resp._chunks.append(body)
        resp._buffered += len(body)
        if resp._buffered > _PAUSE_AT and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        resp._wake()

    def on_message_complete(self) -> None:
        resp = self.resp
        if resp.status < 200:  # 1xx: the real answer follows
            resp.state = _HEAD
            self._framed = False
            return
        self._complete(resp)

    # Requests -------------------------------------------------------------------------

    def _complete(self, resp: HttptoolsResponse) -> None:
        resp.state = _DONE
        resp._stop_timer()
        resp._conn = None
        resp._wake()
        self.resp = None
        self._framed = False
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
        if self.pool is not None and self.parser.should_keep_alive():
            self.reused = True
            self.pool.put(self)
        else:
            self.drop()

    def send(self, head: bytes, body: bytes | None, read: float | None,
             deadline: float | None) -> HttptoolsResponse:
        resp = self.resp = HttptoolsResponse(self, read, deadline)
        transport = self.transport
        if body:
            transport.write(head + body)
        else:
            transport.write(head)
        if read is not None or deadline is not None:
            resp._start_timer(self.loop)
        return resp

    def drop(self) -> None:
        """Close at once; the replica sees the connection go."""
        pool = self.pool
        if pool is not None:
            pool.forget(self)
            self.pool = None
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.close()
        resp = self.resp
        if resp is not None and resp.state < _DONE:
            resp._fail(None)

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()


def _why(exc: BaseException | None) -> str:
    return f" ({type(exc).__name__}: {exc})" if exc is not None else ""


def _bad_answer(resp: HttptoolsResponse, exc: Exception) -> UpstreamError:
    detail = f"ClientPayloadError: unreadable answer ({type(exc).__name__}: {exc})"
    if resp.state < _BODY:
        return ConnectFailed(detail)
    return ReadFailed(detail)


class _HostPool:
    """The connections to one replica: `all` of them, and the idle ones, most recently used
    last."""

    __slots__ = ("all", "idle", "max_idle", "upstream")

    def __init__(self, upstream: HttptoolsUpstream, max_idle: int) -> None:
        self.upstream = upstream
        self.idle: list[_Conn] = []
        self.all: set[_Conn] = set()
        self.max_idle = max_idle

    def take(self, now: float, keepalive: float) -> _Conn | None:
        idle = self.idle
        while idle:
            conn = idle.pop()
            if conn.usable and now - conn.idle_since < keepalive:
                return conn
            conn.drop()
        return None

    def put(self, conn: _Conn) -> None:
        if len(self.idle) >= self.max_idle:
            conn.drop()
            return
        conn.idle_since = conn.loop.time()
        self.idle.append(conn)
        self.upstream.idle_added()

    def forget(self, conn: _Conn) -> None:
        self.all.discard(conn)
        with contextlib.suppress(ValueError):
            self.idle.remove(conn)

    def sweep(self, now: float, keepalive: float) -> None:
        """Close the connections idle for longer than `keepalive` (the oldest are first)."""
        idle = self.idle
        stale = 0
        while stale < len(idle) and now - idle[stale].idle_since >= keepalive:
            stale += 1
        if stale:
            old, self.idle = idle[:stale], idle[stale:]
            for conn in old:
                conn.drop()


class HttptoolsUpstream:
    """Pooled keep-alive connections to every replica, plus connections used once.

    No cap on connections in use: the engines queue requests themselves, and a cap here would
    only add a second, invisible queue. Idle connections are kept `keepalive_s`, which should
    stay below the engines' own idle timeout (5 s in vLLM and trtllm-serve).
    """

    def __init__(self, keepalive_s: float = 4.0, max_idle_per_host: int = 1024) -> None:
        self._keepalive = keepalive_s
        self._max_idle = max_idle_per_host
        self._pools: dict[tuple[bool, str, int], _HostPool] = {}
        self._targets: dict[str, _Target] = {}
        self._once = _HostPool(self, 0)
        """Connections opened for one request (fresh_connection): no idle room, so each is
        closed when its answer ends."""
        self._sweeper: asyncio.TimerHandle | None = None
        self._tls: ssl.SSLContext | None = None
        self._closed = False

    def _new_target(self, url: str) -> _Target:
        target = _Target(url)
        pool = self._pools.get(target.key)
        if pool is None:
            pool = self._pools[target.key] = _HostPool(self, self._max_idle)
        target.pool = pool
        if len(self._targets) >= 4096:  # URLs come from the config: this is never hit
            self._targets.clear()
        self._targets[url] = target
        return target

    async def request(self, method: str, url: str, *, body: bytes | None = None,
                      headers: Mapping[str, str] | None = None,
                      timeouts: Timeouts = NO_TIMEOUTS,
                      fresh_connection: bool = False) -> HttptoolsResponse:
        target = self._targets.get(url) or self._new_target(url)
        pool = target.pool
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadline = None if timeouts.total is None else now + timeouts.total
        conn = None if fresh_connection else pool.take(now, self._keepalive)
        if conn is None:
            conn = await self._connect(target, self._once if fresh_connection else pool, loop,
                                       timeouts, deadline)
        lines = [method, target.head]
        if headers:
            lines += [f"{k}: {v}\r\n" for k, v in headers.items()]
        lines.append(f"Content-Length: {len(body)}\r\n\r\n" if body is not None else "\r\n")
        head = "".join(lines).encode("latin-1")
        resp = conn.send(head, body, timeouts.read, deadline)
        if resp.state < _BODY:
            fut = resp._head = loop.create_future()
            try:
                await fut
            except asyncio.CancelledError:
                # The caller gave up (its client left, a first-byte limit): drop the request
                # so that the replica stops working on it.
                resp.abort()
                raise
        return resp

    async def _connect(self, target: _Target, pool: _HostPool,
                       loop: asyncio.AbstractEventLoop, timeouts: Timeouts,
                       deadline: float | None) -> _Conn:
        limit = timeouts.connect
        if deadline is not None:
            left = max(0.0, deadline - loop.time())
            limit = left if limit is None else min(limit, left)
        tls = None
        if target.tls:
            tls = self._tls = self._tls or ssl.create_default_context()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(
                lambda: _Conn(pool, loop), target.host, target.port, ssl=tls), limit)
        except TimeoutError:
            raise ConnectFailed(f"ConnectionTimeoutError: no connection to {target.host}:"
                                f"{target.port} within {limit} s", timed_out=True,
                                never_sent=True) from None
        except (OSError, ssl.SSLError, UnicodeError) as exc:
            raise ConnectFailed(f"ClientConnectorError: cannot connect to {target.host}:"
                                f"{target.port}: {exc}") from None
        if not conn.usable:
            # Lost between the handshake and now (the replica closed it at once): nothing was
            # sent, so the request may go elsewhere without waiting for a read timeout.
            raise ConnectFailed(f"ServerDisconnectedError: {target.host}:{target.port} closed "
                                "the connection before the request was sent", never_sent=True)
        return conn

    def idle_added(self) -> None:
        if self._sweeper is None and not self._closed:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.call_later(self._keepalive, self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        for pool in self._pools.values():
            pool.sweep(now, self._keepalive)
        if any(pool.idle for pool in self._pools.values()):
            self._sweeper = loop.call_later(self._keepalive / 2, self._sweep)

    def connections(self) -> int:
        """Connections open now, idle or in use (for tests and leak checks)."""
        return sum(len(p.all) for p in self._pools.values()) + len(self._once.all)

    async def aclose(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        conns = [c for p in self._pools.values() for c in p.all] + list(self._once.all)
        for conn in conns:
            conn.drop()
        self._pools.clear()
        self._targets.clear()

