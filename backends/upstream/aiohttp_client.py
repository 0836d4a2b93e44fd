"""The production transport: pooled keep-alive connections to replicas over aiohttp."""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp

from backends.upstream.base import (
    NO_TIMEOUTS,
    ConnectFailed,
    ConnectionDropped,
    ReadFailed,
    Timeouts,
)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".rstrip(": ")


def _read_failed(exc: BaseException) -> ReadFailed:
    """`exc` as a ReadFailed, its traceback dropped.

    aiohttp raises one module-level exception object (`Connection closed`) for every response
    closed while its body is read (the client left and the stream was aborted). Each raise
    adds the frames it passes through to that one object's traceback, so without this every
    abandoned response's reader, buffer and caller frames stay alive for good (aiohttp 3.14).
    """
    failed = ReadFailed(_describe(exc), timed_out=isinstance(exc, TimeoutError))
    exc.__traceback__ = None
    return failed


def _dropped_under_us(exc: BaseException) -> bool:
    """The connection was dropped before any answer; not a refused connect, not a timeout."""
    if isinstance(exc, TimeoutError | aiohttp.ClientConnectorError):
        return False
    return isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError
                      | ConnectionResetError)


class _Chunks:
    """The body as the replica streams it (a class, not a generator: one per request)."""

    __slots__ = ("_content",)

    def __init__(self, content: aiohttp.StreamReader) -> None:
        self._content = content

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await self._content.readany()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _read_failed(exc) from None
        if not chunk:
            raise StopAsyncIteration
        return chunk


class AiohttpResponse:
    """An aiohttp response behind the UpstreamResponse protocol."""

    __slots__ = ("_resp", "status")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status

    @property
    def content_type(self) -> str:
        # Read only when needed (a replica's error passed through), not on every request.
        return self._resp.headers.get("Content-Type", "application/json")

    def chunks(self) -> _Chunks:
        return _Chunks(self._resp.content)

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _read_failed(exc) from None

    def abort(self) -> None:
        self._resp.close()

    def release(self) -> None:
        self._resp.release()


class AiohttpUpstream:
    """One pooled client for every replica, plus one that never reuses a connection.

    No per-host cap: the engines queue requests themselves, and a cap here would only add a
    second, invisible queue. Idle connections are kept `keepalive_s`, which should stay below
    the engines' own idle timeout (5 s in vLLM and trtllm-serve).
    """

    def __init__(self, keepalive_s: float = 4.0) -> None:
        self._keepalive_s = keepalive_s
        self._pooled: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None
        self._timeouts: dict[Timeouts, aiohttp.ClientTimeout] = {}
        self._last: tuple[Timeouts | None, aiohttp.ClientTimeout | None] = (None, None)

    def _open(self) -> None:
        # Created on first use, inside the running event loop, as aiohttp requires.
        self._pooled = _session(aiohttp.TCPConnector(
            limit=0, limit_per_host=0, enable_cleanup_closed=True,
            keepalive_timeout=self._keepalive_s))
        self._fresh = _session(aiohttp.TCPConnector(limit=0, force_close=True))

    def _client_timeout(self, t: Timeouts) -> aiohttp.ClientTimeout:
        if t is self._last[0]:  # callers pass the same Timeouts each time: skip hashing it
            return self._last[1]
        ct = self._timeouts.get(t)
        if ct is None:
            ct = self._timeouts[t] = aiohttp.ClientTimeout(
                total=t.total, sock_connect=t.connect, sock_read=t.read)
        self._last = (t, ct)
        return ct

    async def request(self, method: str, url: str, *, body: bytes | None = None,
                      headers: Mapping[str, str] | None = None,
                      timeouts: Timeouts = NO_TIMEOUTS,
                      fresh_connection: bool = False) -> AiohttpResponse:
        session = self._fresh if fresh_connection else self._pooled
        if session is None:
            self._open()
            session = self._fresh if fresh_connection else self._pooled
        try:
            resp = await session.request(method, url, data=body, headers=headers,
                                         timeout=self._client_timeout(timeouts))
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            if _dropped_under_us(exc):
                raise ConnectionDropped(_describe(exc)) from None
            raise ConnectFailed(_describe(exc), timed_out=isinstance(exc, TimeoutError),
                                never_sent=isinstance(exc, aiohttp.ConnectionTimeoutError)
                                ) from None
        return AiohttpResponse(resp)

    async def aclose(self) -> None:
        for session in (self._pooled, self._fresh):
            if session is not None:
                await session.close()
        self._pooled = self._fresh = None


def _session(connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
    # Bodies pass through as the engine sent them, and the engine sees no client name of ours.
    return aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                 skip_auto_headers=("User-Agent",))
