"""The values a request and its reply travel as between the edge and the request core."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Protocol

from backends.upstream import UpstreamResponse
from gateway.auth import ClientKey

JSON_HEADERS = ((b"content-type", b"application/json"),)
SSE_HEADERS = ((b"content-type", b"text/event-stream; charset=utf-8"),
               (b"cache-control", b"no-cache"))


@dataclass(slots=True)
class InferenceRequest:
    """A parsed chat or completions request, whoever sent it (the HTTP edge, a batch runner)."""

    path: str
    """`/v1/chat/completions` or `/v1/completions`: where the replica gets it."""
    chat: bool
    payload: dict[str, Any]
    body: bytes
    """The body as the client sent it: forwarded unchanged unless the gateway must change it."""
    model: str
    stream: bool
    headers: Mapping[bytes, bytes] = field(default_factory=dict)
    """The client's headers, lower-case names."""
    traffic_class: str | None = None
    """Already known (e.g. a batch runner's); None: classified from headers and body."""
    received_at: float = field(default_factory=perf_counter)
    priority: int | None = None
    """Its priority within its class, when already known; None: from headers (see
    `classification.priority_header`), else 0."""
    client: ClientKey | None = None
    """The authenticated client key (None: the gateway has no client keys, or an internal
    caller such as the batch runner)."""


class ReplyStream(Protocol):
    """A streamed body. Its consumer must `aclose()` it, read to the end or not."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def __anext__(self) -> bytes: ...

    async def aclose(self) -> None: ...


@dataclass(slots=True)
class Reply:
    """What the client gets: a status, headers, and the body whole or as a stream."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes | ReplyStream


class ClientLink:
    """The request's tie to its client: tells the core when the client has gone away.

    The edge calls `client_gone()` on a disconnect; the core attaches the upstream response
    being read, so that it is dropped at once and the engine stops generating, and while the
    request waits for admission, it registers what drops it from the queue.
    """

    __slots__ = ("gone", "on_gone", "upstream")

    def __init__(self) -> None:
        self.gone = False
        self.upstream: UpstreamResponse | None = None
        self.on_gone: Callable[[], None] | None = None

    def watch(self) -> None:
        """An upstream response is now attached (maybe again, on a retry), or the request
        waits in an admission queue: a subclass starts listening for its client here. Not
        sooner: until then a disconnect has nothing to drop, and most requests end before a
        listener would ever run."""

    def client_gone(self) -> None:
        self.gone = True
        if self.upstream is not None:
            self.upstream.abort()
        if self.on_gone is not None:
            on_gone, self.on_gone = self.on_gone, None
            on_gone()

    def queued(self, on_gone: Callable[[], None] | None) -> None:
        """The request waits in an admission queue: `on_gone` drops it from there if the
        client leaves (called at once if it already has). None: it left the queue."""
        self._until_gone(on_gone, self.watch)

    def interrupt(self, on_gone: Callable[[], None] | None) -> None:
        """While a replica has not answered yet: `on_gone` interrupts the wait if the client
        leaves (called at once if it already has). None: the wait is over."""
        self._until_gone(on_gone, self.watch_soon)

    def _until_gone(self, on_gone: Callable[[], None] | None,
                    listen: Callable[[], None]) -> None:
        self.on_gone = on_gone
        if on_gone is None:
            return
        if self.gone:
            self.client_gone()
        else:
            listen()

    def watch_soon(self) -> None:
        """Like `watch`, for a wait that most often ends within moments (a replica's answer):
        a subclass may start listening a little later, once the wait has lasted."""
        self.watch()

    def attach(self, upstream: UpstreamResponse) -> None:
        """The response now being read; dropped at once if the client has already left.
        Listening starts soon rather than now: most answers are relayed within moments."""
        self.upstream = upstream
        if self.gone:
            upstream.abort()
        else:
            self.watch_soon()
