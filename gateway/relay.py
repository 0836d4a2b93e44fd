"""Relaying a replica's response to the client, one function per response mode."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from time import perf_counter

import orjson

from backends.upstream import ReadFailed, UpstreamResponse
from gateway.attempt import Attempt
from gateway.errors import error_body
from gateway.exchange import JSON_HEADERS, SSE_HEADERS, ClientLink, Reply
from gateway.outcome import Outcome
from gateway.sse import assemble

log = logging.getLogger("prefix_gateway.relay")

DEFAULT_MAX_RESPONSE = 64 * 1024 * 1024
"""server.max_response_bytes' default."""


class ReadFailure(Exception):
    """The body could not be read before anything reached the client: try elsewhere."""

    def __init__(self, detail: str, broken: bool = False) -> None:
        super().__init__(detail)
        self.detail = detail
        self.broken = broken
        """The connection broke (not a timeout, not a bad answer): the replica is likely gone."""


def _length(data: bytes) -> tuple[bytes, bytes]:
    return (b"content-length", str(len(data)).encode())


async def relay_error_status(resp: UpstreamResponse, attempt: Attempt, link: ClientLink,
                             extra: list[tuple[bytes, bytes]],
                             limit: int = DEFAULT_MAX_RESPONSE) -> Reply:
    """A replica's own 4xx/5xx. A 4xx with OpenAI's error object is passed through as the
    replica sent it (it explains what is wrong with the request); anything else is answered in
    OpenAI's error shape with the replica's status, its body only logged: an engine's 5xx body
    or a proxy's HTML page is no use to the client and may name internal hosts."""
    reply = await _relay_whole(resp, attempt, link, extra, limit)
    if reply.status != resp.status or (resp.status < 500 and _openai_error(resp, reply.body)):
        # Passed through, or the client left (499), or the body was too large (502).
        return reply
    log.warning("replica %s answered HTTP %d: %r", attempt.replica.name, resp.status,
                reply.body[:500])
    body = error_body(
        f"The model replica {'failed to answer' if resp.status >= 500 else 'refused the request'}"
        f" (HTTP {resp.status}).", type="upstream_error" if resp.status >= 500
        else "invalid_request_error", code="upstream_error")
    return Reply(resp.status, [*JSON_HEADERS, _length(body), *extra], body)


def _openai_error(resp: UpstreamResponse, body: bytes) -> bool:
    """Whether `body` is OpenAI's error object (other JSON, such as a framework's
    `{"detail": ...}`, is no error an OpenAI client can read)."""
    if not resp.content_type.startswith("application/json"):
        return False
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("error"), dict) and isinstance(
        obj["error"].get("message"), str)


async def relay_passthrough(resp: UpstreamResponse, attempt: Attempt, link: ClientLink,
                            extra: list[tuple[bytes, bytes]],
                            limit: int = DEFAULT_MAX_RESPONSE) -> Reply:
    """A non-streaming answer, relayed whole and untouched (its usage read on the side). A
    2xx answer that is not a JSON object raises ReadFailure: it is tried elsewhere."""
    return await _relay_whole(resp, attempt, link, extra, limit, usage=True)


async def relay_assembled(resp: UpstreamResponse, attempt: Attempt, link: ClientLink,
                          extra: list[tuple[bytes, bytes]], chat: bool,
                          limit: int = DEFAULT_MAX_RESPONSE) -> Reply:
    """A non-streaming request the gateway streamed from the replica (to time it): the JSON
    response is rebuilt from the stream's events, which are held until then: at most `limit`
    bytes of them."""
    last = b""
    size = 0
    replica = attempt.replica
    chunks = resp.chunks()
    try:
        while True:
            # After the first content, a wait for the next chunk is one the stall watch sees.
            waiting = attempt.saw_first
            if waiting:
                if not replica.reads:
                    replica.reads_since = perf_counter()
                replica.reads += 1
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            finally:
                if waiting:
                    replica.reads -= 1
            size += len(chunk)
            if size > limit:
                return _too_large(resp, attempt, extra, limit)
            attempt.observe(chunk)
            last = chunk
    except ReadFailed as exc:
        if link.gone:
            attempt.end(Outcome.CLIENT_GONE)
            return Reply(499, [], b"")
        raise ReadFailure(str(exc), not exc.timed_out) from None
    watcher = attempt.watcher
    if watcher.first_token_at is None:
        # Nothing generated: a replica that broke (an error event, a stream cut short, not
        # SSE at all) is tried elsewhere; a stream the engine ended with [DONE] is an answer.
        if watcher.error is not None:
            raise ReadFailure("StreamError: the replica sent an error event before any "
                              f"content: {_error_text(watcher.error)}")
        if b"[DONE]" not in last:
            raise ReadFailure("EmptyStream: the stream ended before any content")
    if watcher.error is not None:
        body, status, outcome = orjson.dumps(watcher.error), 502, Outcome.FAILED
    else:
        body, status, outcome = (orjson.dumps(assemble(watcher.events, chat)), resp.status,
                                 Outcome.ANSWERED)
    attempt.end(outcome, status)
    return Reply(status, [*JSON_HEADERS, _length(body), *extra], body)


def _too_large(resp: UpstreamResponse, attempt: Attempt, extra: list[tuple[bytes, bytes]],
               limit: int) -> Reply:
    """The replica's answer outgrew what the gateway buffers: dropped (so the engine stops),
    and a 502 instead. Not retried: another replica would generate as much."""
    resp.abort()
    log.warning("replica %s sent a non-streaming response above server.max_response_bytes "
                "(%d); answered 502", attempt.replica.name, limit)
    attempt.end(Outcome.FAILED, 502)
    body = error_body(f"The response is larger than the gateway relays without streaming "
                      f"({limit} bytes); ask for fewer tokens or set stream: true.",
                      type="upstream_error", code="response_too_large")
    return Reply(502, [*JSON_HEADERS, _length(body), *extra], body)


HOLD_LIMIT = 1024 * 1024
"""Most bytes of a stream held back while waiting for its first content."""


async def relay_stream(resp: UpstreamResponse, attempt: Attempt, link: ClientLink,
                       extra: list[tuple[bytes, bytes]]) -> Reply:
    """A stream, chunk by chunk as the replica sends it, from its first content on.

    What comes before the first generated content (the role-only first event of vLLM's chat
    streams, keep-alive comments) is held back with the response's headers: until content
    arrives nothing has reached the client, so a replica that fails before it (dies, answers
    garbage, ends the stream without content or with an error event) raises ReadFailure and
    the request is tried on another replica as a non-streaming one would be. Once content has
    gone out, a replica failing mid-stream ends the stream with an SSE error event.
    """
    chunks = resp.chunks()
    watcher = attempt.watcher
    held: list[bytes] = []  # what came before the chunk with content (most often nothing)
    size = 0
    try:
        while True:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                # Ended without content: fine if the engine said so ([DONE]), else it broke.
                if b"[DONE]" not in b"".join(held[-2:]):
                    raise ReadFailure("EmptyStream: the stream ended before any content"
                                      ) from None
                chunk = b""
                break
            attempt.observe(chunk)
            if watcher.error is not None:
                raise ReadFailure("StreamError: the replica sent an error event before any "
                                  f"content: {_error_text(watcher.error)}")
            if watcher.first_token_at is not None:
                break
            held.append(chunk)
            size += len(chunk)
            if size > HOLD_LIMIT:
                raise ReadFailure(f"NoContent: no content in the first {HOLD_LIMIT} bytes")
    except ReadFailed as exc:
        if link.gone:
            attempt.end(Outcome.CLIENT_GONE)
            return Reply(499, [], b"")
        raise ReadFailure(str(exc), not exc.timed_out) from None
    if held:
        held.append(chunk)
        chunk = b"".join(held)
    return Reply(resp.status, [*SSE_HEADERS, *extra],
                 StreamBody(resp, attempt, link, chunks, chunk))


def _error_text(error: dict) -> str:
    inner = error.get("error")
    message = inner.get("message") if isinstance(inner, dict) else inner
    return str(message)[:200]


class StreamBody:
    """The replica's stream as the client's body. Whoever consumes it must `aclose()` it (a
    class, not a generator: an unstarted generator's `finally` never runs)."""

    __slots__ = ("_attempt", "_chunks", "_done", "_held", "_link", "_replica", "_resp", "on_end")

    def __init__(self, resp: UpstreamResponse, attempt: Attempt, link: ClientLink,
                 chunks: AsyncIterator[bytes], held: bytes) -> None:
        self._resp = resp
        self._attempt = attempt
        self._replica = attempt.replica
        self._link = link
        self._chunks = chunks
        self._held = held
        """What came before the first content (and the content itself): sent first."""
        self._done = False
        self.on_end: Callable[[], None] | None = None
        """Called once when the stream ends, however it ends (releases its admission slot)."""

    def __aiter__(self) -> StreamBody:
        return self

    async def __anext__(self) -> bytes:
        if self._done:
            raise StopAsyncIteration
        if self._held:
            held, self._held = self._held, b""
            return held
        # A wait the stall watch sees (this stream had content: its replica should send).
        replica = self._replica
        if not replica.reads:
            replica.reads_since = perf_counter()
        replica.reads += 1
        try:
            chunk = await anext(self._chunks)
        except StopAsyncIteration:
            self._finish(Outcome.ANSWERED)
            raise
        except ReadFailed as exc:
            if self._link.gone:
                self._finish(Outcome.CLIENT_GONE)
                raise StopAsyncIteration from None
            self._finish(Outcome.FAILED)
            # What failed, and where, is for the log: an upstream message may name its host.
            log.warning("stream from %s/%s failed mid-way: %s", self._attempt.pool.name,
                        self._attempt.replica.name, exc)
            self._attempt.failed_mid_stream(
                f"{self._attempt.replica.name}: {str(exc).split(':', 1)[0]} mid-stream",
                exc.timed_out)
            return b"data: " + orjson.dumps({"error": {
                "message": f"replica {self._attempt.replica.name} failed mid-stream; retry "
                           "the request",
                "type": "upstream_error", "param": None, "code": "upstream_failed"}}) + b"\n\n"
        finally:
            replica.reads -= 1
        self._attempt.observe(chunk)
        return chunk

    async def aclose(self) -> None:
        """Ends the stream early if it has not ended: the client left."""
        if not self._done:
            self._resp.abort()
            self._finish(Outcome.CLIENT_GONE)

    def _finish(self, outcome: Outcome) -> None:
        self._done = True
        self._link.upstream = None
        self._resp.release()
        self._attempt.end(outcome, self._resp.status)
        if self.on_end is not None:
            self.on_end()


async def _relay_whole(resp: UpstreamResponse, attempt: Attempt, link: ClientLink,
                       extra: list[tuple[bytes, bytes]], limit: int,
                       usage: bool = False) -> Reply:
    """The body read whole (at most `limit` bytes) and relayed as it is, as JSON with `extra`
    headers and its length; with `usage`, the usage of a 2xx answer is noted first."""
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in resp.chunks():
            size += len(chunk)
            if size > limit:
                return _too_large(resp, attempt, extra, limit)
            chunks.append(chunk)
    except ReadFailed as exc:
        if not link.gone:
            raise ReadFailure(str(exc), not exc.timed_out) from None
        chunks = []
    data = b"".join(chunks) if len(chunks) != 1 else chunks[0]
    if usage and resp.status < 300 and not link.gone and not attempt.watcher.whole(data):
        # An HTML page from a proxy, a truncated body: nothing has reached the client, so
        # another replica may still answer.
        raise ReadFailure("NotJSON: the replica's answer is not a JSON object")
    attempt.end(Outcome.CLIENT_GONE if link.gone else Outcome.ANSWERED, resp.status)
    return Reply(resp.status, [*JSON_HEADERS, *extra, _length(data)], data)
