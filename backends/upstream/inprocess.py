"""An in-process transport: requests go to Python handlers, with no socket (for tests).

As httpx's MockTransport does for httpx, this lets the gateway's behaviour be tested exactly
and fast: a handler can be the simulated replica's own request handler, or a few lines that
answer 503, stall, or break a stream after its first chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from backends.upstream.base import (
    NO_TIMEOUTS,
    ConnectFailed,
    ReadFailed,
    Timeouts,
    UpstreamError,
)


@dataclass(slots=True)
class HandlerResponse:
    """What a handler answers: a status, headers, and a body given whole or as chunks."""

    status: int
    body: bytes | AsyncIterable[bytes] = b""
    headers: Mapping[str, str] = field(default_factory=dict)


Handler = Callable[[str, str, Mapping[str, str], bytes], Awaitable[HandlerResponse]]
"""(method, path with query, headers, body) -> the response."""


class InProcessResponse:
    """A handler's answer behind the UpstreamResponse protocol, with the transport's timeouts."""

    def __init__(self, answer: HandlerResponse, read_timeout: float | None,
                 deadline: float | None = None) -> None:
        self.status = answer.status
        headers = {k.lower(): v for k, v in answer.headers.items()}
        self.content_type = headers.get("content-type", "application/json")
        self._body = answer.body
        self._read_timeout = read_timeout
        self._deadline = deadline
        """loop.time() by which the whole body must have arrived (Timeouts.total)."""
        self._aborted = False
        self._iter: AsyncIterator[bytes] | None = None
        self._reading: asyncio.Future[bytes] | None = None

    async def _chunks(self) -> AsyncIterator[bytes]:
        if isinstance(self._body, bytes):
            if self._body:
                yield self._body
            return
        self._iter = aiter(self._body)
        while True:
            if self._aborted:
                raise ReadFailed("ClientConnectionError: connection closed")
            # A task per read, so that abort() can interrupt a handler that is waiting.
            self._reading = asyncio.ensure_future(
                asyncio.wait_for(anext(self._iter), _limit(self._read_timeout, self._deadline)))
            try:
                chunk = await self._reading
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if self._aborted:
                    raise ReadFailed("ClientConnectionError: connection closed") from None
                raise
            except TimeoutError:
                raise ReadFailed("TimeoutError: no byte within the read timeout",
                                 timed_out=True) from None
            except UpstreamError:
                raise
            except Exception as exc:  # a handler that breaks mid-body is a broken connection
                raise ReadFailed(f"ClientPayloadError: {type(exc).__name__}: {exc}") from None
            finally:
                self._reading = None
            yield chunk

    def chunks(self) -> AsyncIterator[bytes]:
        return self._chunks()

    async def read(self) -> bytes:
        return b"".join([c async for c in self._chunks()])

    def abort(self) -> None:
        """Drop the connection: a read in progress fails, the handler's body is closed."""
        self._aborted = True
        if self._reading is not None:
            self._reading.cancel()  # runs the handler's `finally`, as a dropped socket would
        else:
            self._close_body()

    def release(self) -> None:
        if self._reading is None:
            self._close_body()

    def _close_body(self) -> None:
        closer = getattr(self._iter, "aclose", None) or getattr(self._body, "aclose", None)
        if closer is not None:
            task = asyncio.ensure_future(closer())
            task.add_done_callback(_ignore_result)


def _limit(read: float | None, deadline: float | None) -> float | None:
    """The wait allowed for the next byte: the read timeout, or less if the total's
    deadline comes first."""
    if deadline is None:
        return read
    left = max(0.0, deadline - asyncio.get_running_loop().time())
    return left if read is None else min(read, left)


def _ignore_result(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


class InProcessUpstream:
    """Routes each request to the handler registered for its URL's scheme://host:port.

    A URL with no handler is a refused connection, as a stopped replica is. `requests` records
    (method, url) of every request, for tests that check what reached a replica.
    """

    def __init__(self, handlers: Mapping[str, Handler] | None = None) -> None:
        self.handlers: dict[str, Handler] = dict(handlers or {})
        self.requests: list[tuple[str, str]] = []

    def mount(self, base_url: str, handler: Handler) -> None:
        self.handlers[base_url.rstrip("/")] = handler

    def unmount(self, base_url: str) -> None:
        self.handlers.pop(base_url.rstrip("/"), None)

    async def request(self, method: str, url: str, *, body: bytes | None = None,
                      headers: Mapping[str, str] | None = None,
                      timeouts: Timeouts = NO_TIMEOUTS,
                      fresh_connection: bool = False) -> InProcessResponse:
        parts = urlsplit(url)
        handler = self.handlers.get(f"{parts.scheme}://{parts.netloc}")
        self.requests.append((method, url))
        if handler is None:
            raise ConnectFailed("ClientConnectorError: connection refused")
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        deadline = None
        if timeouts.total is not None:
            deadline = asyncio.get_running_loop().time() + timeouts.total
        try:
            answer = await asyncio.wait_for(handler(method, path, dict(headers or {}),
                                                    body or b""),
                                            _limit(timeouts.read, deadline))
        except TimeoutError:
            raise ConnectFailed("TimeoutError: no response within the timeout",
                                timed_out=True) from None
        except ConnectFailed:
            raise
        except Exception as exc:
            raise ConnectFailed(f"ServerDisconnectedError: {type(exc).__name__}: {exc}"
                                ) from None
        return InProcessResponse(answer, timeouts.read, deadline)

    async def aclose(self) -> None:
        return None
