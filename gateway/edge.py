"""The HTTP edge of the inference path: raw ASGI in, the request core, raw ASGI out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from time import perf_counter

from gateway.auth import CLIENT_SCOPE
from gateway.core import RequestCore, error_reply
from gateway.errors import GatewayError
from gateway.exchange import ClientLink, InferenceRequest, Reply
from gateway.parse import parse_body

log = logging.getLogger("prefix_gateway.edge")


class ClientLeft(Exception):
    """The client disconnected while its request body was still arriving."""


async def read_body(receive, limit: int) -> bytes:
    chunks = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientLeft
        body = msg.get("body", b"")
        size += len(body)
        if size > limit:
            raise GatewayError(413, f"Request body is larger than {limit} bytes.",
                               code="request_too_large")
        chunks.append(body)
        if not msg.get("more_body"):
            return b"".join(chunks)


async def send_reply(send, reply: Reply) -> None:
    """Send a reply whose body is whole (an error, or a non-streaming answer)."""
    await send({"type": "http.response.start", "status": reply.status,
                "headers": reply.headers})
    await send({"type": "http.response.body", "body": reply.body})


class InferenceEndpoint:
    """POST /v1/chat/completions or /v1/completions."""

    def __init__(self, core: RequestCore, path: str, chat: bool, max_body: int) -> None:
        self.core = core
        self.path = path
        self.chat = chat
        self.max_body = max_body

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self._handle(scope, receive, send)
        except Exception:
            # A bug must still answer in OpenAI's shape (and be logged), never hang the client.
            # If the response had already started, the server refuses a second start: ignore.
            log.exception("unhandled error on %s", self.path)
            with contextlib.suppress(Exception):
                await send_reply(send, error_reply(GatewayError(
                    500, "The gateway failed to handle this request; it has been logged.",
                    type="internal_error", code="internal_error")))

    async def _handle(self, scope, receive, send) -> None:
        received_at = perf_counter()
        if scope["method"] != "POST":
            # RFC 9110: a 405 lists the methods the route takes.
            await send_reply(send, error_reply(GatewayError(
                405, f"Use POST for {self.path}.", code="method_not_allowed",
                headers=[(b"allow", b"POST")])))
            return
        try:
            body = await read_body(receive, self.max_body)
            payload, model, stream = parse_body(body, self.chat)
        except GatewayError as err:
            await send_reply(send, error_reply(err))
            return
        except ClientLeft:
            return
        request = InferenceRequest(self.path, self.chat, payload, body, model, stream,
                                   dict(scope["headers"]), received_at=received_at,
                                   client=scope.get(CLIENT_SCOPE))
        link = EdgeLink(receive)
        try:
            reply = await self.core.handle(request, link)
            if link.gone:
                if not isinstance(reply.body, bytes):
                    await reply.body.aclose()
                return
            body = reply.body
            if isinstance(body, bytes):
                await send_reply(send, reply)
                return
            # Relayed here, not in a helper: a coroutine less to pass through for every chunk.
            async with contextlib.aclosing(body):  # the stream's attempt ends, whatever happens
                await send({"type": "http.response.start", "status": reply.status,
                            "headers": reply.headers})
                async for chunk in body:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            link.stop()


WATCH_AFTER_S = 0.05
"""How long a try waits for its replica's answer, or relays it, before the client's disconnect
is listened for (see `EdgeLink.watch_soon`)."""


class EdgeLink(ClientLink):
    """A ClientLink that listens for the ASGI client's disconnect, from the moment the core
    queues the request for admission or registers an upstream response, until the reply is
    sent."""

    __slots__ = ("_receive", "_soon", "_watcher")

    def __init__(self, receive) -> None:
        super().__init__()
        self._receive = receive
        self._watcher: asyncio.Task | None = None
        self._soon: asyncio.TimerHandle | None = None

    def watch(self) -> None:
        if self._watcher is None:
            self._watcher = asyncio.create_task(self._listen())

    def watch_soon(self) -> None:
        # Most replicas answer (their headers, a short body) within a millisecond or two: a
        # listener task started at once would run, and be torn down, for nearly every request,
        # for nothing. One that starts WATCH_AFTER_S into the wait (or into the relay of a
        # stream) still drops a request whose client left long before its answer.
        if self._watcher is None and self._soon is None:
            self._soon = asyncio.get_running_loop().call_later(WATCH_AFTER_S, self.watch)

    def stop(self) -> None:
        if self._soon is not None:
            self._soon.cancel()
        if self._watcher is not None:
            self._watcher.cancel()

    async def _listen(self) -> None:
        """Tell the core when the client goes away, so the engine stops generating for
        nobody."""
        while True:
            msg = await self._receive()
            if msg["type"] == "http.disconnect":
                self.client_gone()
                return
