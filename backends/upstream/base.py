"""The transport seam: one request to one replica, and what can go wrong on the way."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Timeouts:
    """How long to wait for a replica, each limit in seconds (None: no limit)."""

    connect: float | None = None
    read: float | None = None
    """Longest silence between two bytes of the response (headers included)."""
    total: float | None = None
    """Longest time for the whole exchange, from sending to the last byte."""
    first_byte: float | None = None
    """Longest wait for the response's first content. Not a transport limit: the caller
    enforces it (it knows what counts as content, e.g. the first generated token of a
    stream), so it holds whatever the transport."""


NO_TIMEOUTS = Timeouts()


class UpstreamError(Exception):
    """The replica could not be reached, or its response could not be read."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class ConnectFailed(UpstreamError):
    """No response at all: the connection was refused, reset or timed out before headers.

    `never_sent` means the request certainly never left (the connect itself timed out), so
    sending it again cannot run it twice.
    """

    def __init__(self, message: str, *, timed_out: bool = False,
                 never_sent: bool = False) -> None:
        super().__init__(message, timed_out=timed_out)
        self.never_sent = never_sent


class ConnectionDropped(ConnectFailed):
    """A kept-alive connection was closed under the request before any answer (the replica's
    idle timeout firing as the connection was reused): the replica itself is fine."""


class ReadFailed(UpstreamError):
    """The response started but its body could not be read to the end."""


class UpstreamResponse(Protocol):
    """A replica's answer: status and content type at once, the body as it arrives."""

    status: int
    content_type: str

    def chunks(self) -> AsyncIterator[bytes]:
        """The body, chunk by chunk as the replica sends it; raises ReadFailed."""
        ...

    async def read(self) -> bytes:
        """The whole body; raises ReadFailed."""
        ...

    def abort(self) -> None:
        """Stop reading and drop the connection, so the replica stops generating."""
        ...

    def release(self) -> None:
        """Done with the response (idempotent; a connection read to the end is reused)."""
        ...


class Upstream(Protocol):
    """Sends HTTP requests to replicas: httptools_client by default (aiohttp on request),
    an in-process one in tests."""

    async def request(self, method: str, url: str, *, body: bytes | None = None,
                      headers: Mapping[str, str] | None = None,
                      timeouts: Timeouts = NO_TIMEOUTS,
                      fresh_connection: bool = False) -> UpstreamResponse:
        """Send one request; returns once the status line and headers arrived.

        Raises ConnectFailed (or ConnectionDropped) when no response came. With
        `fresh_connection`, the request goes over a connection opened for it alone.
        """
        ...

    async def aclose(self) -> None:
        """Close every connection."""
        ...


async def fetch_text(upstream: Upstream, url: str, timeout: float) -> tuple[int, str]:
    """GET `url` as text: (status, body), or (0, "") when it cannot be fetched in time."""
    try:
        resp = await upstream.request("GET", url, timeouts=Timeouts(total=timeout))
    except UpstreamError:
        return 0, ""
    try:
        return resp.status, (await resp.read()).decode()
    except (UpstreamError, UnicodeDecodeError):
        return 0, ""
    finally:
        resp.release()
