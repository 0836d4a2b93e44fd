"""The httptools transport against real loopback servers: keep-alive reuse, bodies in both
framings, a connection closed under a request, timeouts, aborts reaching the server, and no
connection or response left behind by requests given up on."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from backends.upstream import (
    ConnectFailed,
    ConnectionDropped,
    ReadFailed,
    Timeouts,
    fetch_text,
)
from backends.upstream.httptools_client import HttptoolsResponse, HttptoolsUpstream, _Conn
from tests.conftest import eventually

Respond = Callable[[bytes, bytes, asyncio.StreamWriter, "Server"], Awaitable[bool]]
"""(request head, body, writer, server) -> keep the connection open for another request."""


class Server:
    """A loopback HTTP/1.1 server whose answers each test scripts; it counts connections and
    notes which ones the client closed."""

    def __init__(self, respond: Respond) -> None:
        self.respond = respond
        self.accepted = 0
        self.open = 0
        self.requests: list[bytes] = []
        self.closed_by_client = asyncio.Event()
        self.reader: asyncio.StreamReader | None = None
        """The connection of the request being answered (to wait for the client to close)."""
        self.url = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.open += 1
        self.reader = reader
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.closed_by_client.set()
                    return
                self.requests.append(head)
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length) if length else b""
                try:
                    if not await self.respond(head, body, writer, self):
                        break
                except (ConnectionError, asyncio.CancelledError):
                    self.closed_by_client.set()
                    return
        finally:
            self.open -= 1
            writer.close()


@contextlib.asynccontextmanager
async def serving(respond: Respond, **kwargs) -> AsyncIterator[tuple[Server,
                                                                       HttptoolsUpstream]]:
    server = Server(respond)
    await server.start()
    upstream = HttptoolsUpstream(**kwargs)
    try:
        yield server, upstream
    finally:
        await upstream.aclose()
        await server.stop()


def fixed(status: int, body: bytes, ctype: bytes = b"application/json",
          keep: bool = True) -> Respond:
    async def respond(head: bytes, req: bytes, w: asyncio.StreamWriter, s: Server) -> bool:
        w.write(b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                % (status, ctype, len(body), body))
        await w.drain()
        return keep
    return respond


def chunked(parts: list[bytes]) -> Respond:
    async def respond(head: bytes, req: bytes, w: asyncio.StreamWriter, s: Server) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n")
        for part in parts:
            w.write(b"%x\r\n%s\r\n" % (len(part), part))
            await w.drain()
        w.write(b"0\r\n\r\n")
        await w.drain()
        return True
    return respond


async def endless(head: bytes, req: bytes, w: asyncio.StreamWriter, s: Server) -> bool:
    """Streams until the client closes the connection: a generation that never ends."""
    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
    while True:
        w.write(b"6\r\ndata: \r\n")
        await w.drain()
        await asyncio.sleep(0.01)


async def silent(head: bytes, req: bytes, w: asyncio.StreamWriter, s: Server) -> bool:
    """Never answers: the client has to give up."""
    await until_closed(s)
    return False


async def until_closed(s: Server) -> None:
    assert s.reader is not None
    while await s.reader.read(1024):
        pass
    s.closed_by_client.set()


CONNECT = Timeouts(connect=5)


async def post(upstream: HttptoolsUpstream, server: Server, body: bytes = b"{}",
               timeouts: Timeouts = CONNECT, **kw) -> HttptoolsResponse:
    return await upstream.request("POST", server.url + "/v1/completions", body=body,
                                  headers={"Content-Type": "application/json"},
                                  timeouts=timeouts, **kw)


async def test_a_kept_alive_connection_carries_the_next_request() -> None:
    async with serving(fixed(200, b'{"ok":1}')) as (server, upstream):
        for i in range(5):
            resp = await post(upstream, server, body=b'{"i":%d}' % i)
            assert (resp.status, await resp.read()) == (200, b'{"ok":1}')
            resp.release()
        assert server.accepted == 1
        assert upstream.connections() == 1
        # The request head: what the engine gets, no client name of ours, the body's length.
        assert server.requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert b"Content-Length: 7\r\n" in server.requests[0]
        assert b"user-agent" not in server.requests[0].lower()


async def test_an_idle_connection_is_closed_after_the_keepalive_time() -> None:
    async with serving(fixed(200, b"{}"), keepalive_s=0.1) as (server, upstream):
        resp = await post(upstream, server)
        assert await resp.read() == b"{}"
        resp.release()
        assert upstream.connections() == 1
        # Closed by the gateway's side, unused, before the engine's own idle timeout would.
        await eventually(lambda: server.closed_by_client.is_set())
        await eventually(lambda: upstream.connections() == 0)
        resp = await post(upstream, server)
        assert await resp.read() == b"{}"
        assert server.accepted == 2


async def test_a_fresh_connection_is_used_once() -> None:
    async with serving(fixed(200, b"{}")) as (server, upstream):
        for _ in range(3):
            resp = await post(upstream, server, fresh_connection=True)
            assert await resp.read() == b"{}"
            resp.release()
        assert server.accepted == 3
        await eventually(lambda: server.open == 0)
        assert upstream.connections() == 0


async def test_content_length_and_chunked_bodies_arrive_whole() -> None:
    parts = [b"data: %d\n\n" % i for i in range(50)]
    async with serving(chunked(parts)) as (server, upstream):
        resp = await post(upstream, server)
        assert resp.content_type == "text/event-stream"
        got = [c async for c in resp.chunks()]
        assert b"".join(got) == b"".join(parts)
        resp.release()
        again = await post(upstream, server)  # the chunked answer ended cleanly: reused
        assert await again.read() == b"".join(parts)
        assert server.accepted == 1
    big = bytes(range(256)) * 8000  # 2 MB: arrives in many reads, pauses the connection
    async with serving(fixed(200, big, b"application/octet-stream")) as (server, upstream):
        for _ in range(2):
            resp = await post(upstream, server)
            assert await resp.read() == big
            resp.release()
        assert server.accepted == 1


async def test_a_body_that_ends_with_the_connection() -> None:
    async def respond(head: bytes, req: bytes, w: asyncio.StreamWriter, s: Server) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{\"a\":")
        await w.drain()
        w.write(b"1}")
        return False  # closes: no length, no chunks, the end of the connection ends it
    async with serving(respond) as (server, upstream):
        resp = await post(upstream, server)
        assert await resp.read() == b'{"a":1}'
        resp.release()


async def test_health_checks_read_text() -> None:
    async with serving(fixed(200, b"ready", b"text/plain")) as (server, upstream):
        assert await fetch_text(upstream, server.url + "/health", 5) == (200, "ready")
        assert server.requests[0].startswith(b"GET /health HTTP/1.1\r\n")
        assert b"content-length" not in server.requests[0].lower()


async def test_an_idle_connection_closed_by_the_server_is_not_reused() -> None:
    async with serving(fixed(200, b"{}", keep=False)) as (server, upstream):
        resp = await post(upstream, server)
        assert await resp.read() == b"{}"
        resp.release()
        await eventually(lambda: upstream.connections() == 0)
        resp = await post(upstream, server)  # on a new connection: no error
        assert await resp.read() == b"{}"
        assert server.accepted == 2


async def test_a_kept_alive_connection_closed_under_a_request_is_dropped() -> None:
    async def respond(head: bytes, req: bytes, w: asyncio.StreamWriter, s: Server) -> bool:
        if len(s.requests) == 2:
            return False  # the idle timeout fires as the request arrives: closed, no answer
        return await fixed(200, b"{}")(head, req, w, s)
    async with serving(respond) as (server, upstream):
        resp = await post(upstream, server)
        assert await resp.read() == b"{}"
        resp.release()
        with pytest.raises(ConnectionDropped):
            await post(upstream, server)
        # A request on a connection of its own is answered (what the core resends on).
        resp = await post(upstream, server, fresh_connection=True)
        assert await resp.read() == b"{}"


@pytest.mark.parametrize("answer", [b"", b"SSH-2.0-OpenSSH_9.6\r\n\r\n"],
                         ids=["closed", "garbage"])
async def test_a_fresh_connection_that_gives_no_http_answer_is_a_connect_failure(
        answer: bytes) -> None:
    """Closed before any answer, or answered with something that is not HTTP (the server
    keeps that one open: the client must drop it)."""
    async def respond(head: bytes, req: bytes, w: asyncio.StreamWriter, s: Server) -> bool:
        if answer:
            w.write(answer)
            await w.drain()
        return bool(answer)
    async with serving(respond) as (server, upstream):
        with pytest.raises(ConnectFailed) as caught:
            await post(upstream, server)
        assert not isinstance(caught.value, ConnectionDropped)
        assert not caught.value.timed_out
        if answer:
            await eventually(lambda: server.closed_by_client.is_set())


async def test_a_connection_broken_mid_body_fails_the_read() -> None:
    async def respond(head: bytes, req: bytes, w: asyncio.StreamWriter, s: Server) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nhalf")
        await w.drain()
        return False
    async with serving(respond) as (server, upstream):
        resp = await post(upstream, server)
        assert resp.status == 200
        with pytest.raises(ReadFailed) as caught:
            await resp.read()
        assert not caught.value.timed_out


class _Watched(_Conn):
    """A connection that says when it is lost."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.lost = asyncio.Event()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.lost.set()


@pytest.mark.parametrize("fresh", [False, True])
async def test_a_connection_lost_before_the_request_is_sent_fails_at_once(
        monkeypatch: pytest.MonkeyPatch, fresh: bool) -> None:
    # The replica closes the connection right after the handshake, and the loss is handled
    # before the connecting task resumes: the request must fail as never sent (so it may go
    # elsewhere), not be written into the closed connection to wait for an answer forever, and
    # the connection must not stay registered.
    async with serving(fixed(200, b"{}")) as (server, upstream):
        loop = asyncio.get_running_loop()
        real = loop.create_connection

        async def closed_at_once(factory, *args, **kwargs):
            def watched() -> _Watched:
                made = factory()
                return _Watched(made.pool, made.loop)
            transport, conn = await real(watched, *args, **kwargs)
            transport.close()
            await conn.lost.wait()
            return transport, conn

        monkeypatch.setattr(loop, "create_connection", closed_at_once)
        with pytest.raises(ConnectFailed) as caught:
            # No read timeout: before the fix this waited for an answer that never comes (the
            # outer limit only keeps a failing run from hanging).
            await asyncio.wait_for(post(upstream, server, fresh_connection=fresh), 30)
        assert caught.value.never_sent and not caught.value.timed_out
        assert upstream.connections() == 0
        monkeypatch.undo()
        resp = await post(upstream, server, fresh_connection=fresh)
        assert (resp.status, await resp.read()) == (200, b"{}")
        if fresh:
            await eventually(lambda: upstream.connections() == 0)
        else:
            assert upstream.connections() == 1


async def test_refused_and_timed_out_connects() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    upstream = HttptoolsUpstream()
    try:
        with pytest.raises(ConnectFailed) as refused:
            await upstream.request("GET", f"http://127.0.0.1:{port}/health",
                                   timeouts=Timeouts(connect=5))
        assert not refused.value.never_sent and not refused.value.timed_out
        # A listener whose backlog is full: the SYN is never answered.
        with socket.socket() as full:
            full.bind(("127.0.0.1", 0))
            full.listen(0)
            filler = socket.create_connection(full.getsockname())
            try:
                with pytest.raises(ConnectFailed) as stalled:
                    await upstream.request("GET", f"http://127.0.0.1:{full.getsockname()[1]}/",
                                           timeouts=Timeouts(connect=0.2))
            finally:
                filler.close()
        assert stalled.value.never_sent and stalled.value.timed_out
        assert "ConnectionTimeoutError" in str(stalled.value)
    finally:
        await upstream.aclose()


async def test_silence_before_the_headers_times_out() -> None:
    async with serving(silent) as (server, upstream):
        with pytest.raises(ConnectFailed) as caught:
            await post(upstream, server, timeouts=Timeouts(connect=5, read=0.2))
        assert caught.value.timed_out and not caught.value.never_sent
        await eventually(lambda: server.closed_by_client.is_set())


async def test_silence_between_chunks_times_out_and_drops_the_connection() -> None:
    async def respond(head: bytes, req: bytes, w: asyncio.StreamWriter, s: Server) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\nabcd\r\n")
        await w.drain()
        await until_closed(s)
        return False
    async with serving(respond) as (server, upstream):
        resp = await post(upstream, server, timeouts=Timeouts(connect=5, read=0.2))
        chunks = resp.chunks()
        assert await anext(chunks) == b"abcd"
        with pytest.raises(ReadFailed) as caught:
            await anext(chunks)
        assert caught.value.timed_out
        await eventually(lambda: server.closed_by_client.is_set())


async def test_a_stream_that_keeps_sending_is_not_cut_by_the_read_timeout() -> None:
    async def respond(head: bytes, req: bytes, w: asyncio.StreamWriter, s: Server) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(10):
            w.write(b"1\r\nx\r\n")
            await w.drain()
            await asyncio.sleep(0.05)  # the stream's pace, well within the read timeout
        w.write(b"0\r\n\r\n")
        return True
    async with serving(respond) as (server, upstream):
        # The read timeout is 10 s: a failure here would be a timer that never moves on, not
        # a slow machine.
        resp = await post(upstream, server, timeouts=Timeouts(connect=5, read=10))
        assert await resp.read() == b"x" * 10


async def test_the_total_timeout_ends_a_stream_that_never_ends() -> None:
    async with serving(endless) as (server, upstream):
        resp = await post(upstream, server, timeouts=Timeouts(connect=5, read=10, total=0.3))
        with pytest.raises(ReadFailed) as caught:
            async for _ in resp.chunks():
                pass
        assert caught.value.timed_out
        await eventually(lambda: server.closed_by_client.is_set())


async def test_abort_closes_the_connection_so_the_server_stops() -> None:
    async with serving(endless) as (server, upstream):
        resp = await post(upstream, server)
        chunks = resp.chunks()
        await anext(chunks)
        reading = asyncio.ensure_future(anext(chunks))  # a read waiting when abort comes
        resp.abort()
        with pytest.raises(ReadFailed):
            while True:
                await reading
                reading = asyncio.ensure_future(anext(chunks))
        resp.release()
        await eventually(lambda: server.closed_by_client.is_set())
        await eventually(lambda: upstream.connections() == 0)


async def test_a_request_cancelled_before_its_headers_drops_the_connection() -> None:
    async with serving(silent) as (server, upstream):
        task = asyncio.ensure_future(post(upstream, server))
        await eventually(lambda: server.requests)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await eventually(lambda: server.closed_by_client.is_set())
        await eventually(lambda: upstream.connections() == 0)


async def test_a_response_released_unread_is_not_reused() -> None:
    async with serving(endless) as (server, upstream):
        resp = await post(upstream, server)
        resp.release()  # the rest of the body would come before the next answer
        await eventually(lambda: server.closed_by_client.is_set())
        assert upstream.connections() == 0


def _live(kind: type) -> int:
    return sum(isinstance(o, kind) for o in gc.get_objects())


async def test_many_requests_given_up_on_leave_nothing_behind() -> None:
    async with serving(endless) as (server, upstream):
        async def leave(i: int) -> None:
            resp = await post(upstream, server)
            chunks = resp.chunks()
            await anext(chunks)
            if i % 3 == 0:
                resp.abort()
            elif i % 3 == 1:  # the reader is cancelled mid-read, then the response dropped
                reading = asyncio.ensure_future(anext(chunks))
                await asyncio.sleep(0)
                reading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reading
                resp.abort()
            resp.release()

        await asyncio.gather(*(leave(i) for i in range(60)))
        await eventually(lambda: server.open == 0)
        await eventually(lambda: upstream.connections() == 0)
        gc.collect()
        assert _live(HttptoolsResponse) == 0
