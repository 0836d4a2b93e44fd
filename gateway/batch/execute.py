"""One batch line through the request core, as the HTTP edge would send it: the response
rebuilt whole from the engine's stream, and what is waited out or tried again."""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Protocol

import orjson

from gateway.core import RequestCore
from gateway.exchange import InferenceRequest, Reply
from gateway.observe import Observer
from gateway.sse import StreamWatcher, assemble

# Statuses that mean "not now": admission control's full queue (429), no healthy replica or
# an overloaded one (503). The line keeps its lease and is tried again, for as long as the
# batch's completion window lasts: capacity comes back.
WAIT = frozenset((429, 503))
# Replicas that failed before answering (502, 504) or broke off mid-stream: tried again a
# few times, then written to the error file with the status.
TRANSIENT = frozenset((502, 504))
TRANSIENT_TRIES = 5


class Sent(Protocol):
    sent: bool
    """True while a request of the line is at a replica."""


@dataclass(slots=True)
class Answer:
    """What a line's response file entry says."""

    status: int
    """The HTTP status (a stream that kept breaking off counts as 502)."""
    request_id: str
    body: Any
    usage: tuple[int, int, int] = (0, 0, 0)
    """Prompt, cached prompt and completion tokens (2xx only)."""

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


class LineExecutor:
    def __init__(self, core: RequestCore, traffic_class: str, observer: Observer) -> None:
        self.core = core
        self.traffic_class = traffic_class
        self.observer = observer

    async def answer(self, path: str, chat: bool, body: dict[str, Any],
                     gate: asyncio.Event | None, line: Sent) -> Answer:
        """Tries until the line has a response to write: waits out "not now" answers for as
        long as it takes, tries again a few times after failures. `gate` is set once the
        first token arrives (the prompt's prefix is then in the engine's cache)."""
        backoff = 0.25
        failures = 0
        while True:
            line.sent = True
            status, a, retry_after = await self._try(path, chat, body, gate)
            if status is None or status in TRANSIENT:
                failures += 1
                if failures >= TRANSIENT_TRIES:
                    a.status = status or 502
                    return a
            elif status not in WAIT:
                return a
            self.observer.batch_line("retried")
            line.sent = False
            await asyncio.sleep(max(retry_after or 0.0, backoff) * random.uniform(0.8, 1.2))
            backoff = min(backoff * 2, 2.0)

    async def _try(self, path: str, chat: bool, body: dict[str, Any],
                   gate: asyncio.Event | None) -> tuple[int | None, Answer, float | None]:
        """One request through the core: (its status, None if the stream broke off; the
        answer; Retry-After in seconds)."""
        payload = dict(body)
        # Streamed from the replica and rebuilt here: the first token tells the line's prefix
        # group that the prefix is now cached, and usage comes with the last event.
        payload["stream"] = True
        opts = payload.get("stream_options")
        payload["stream_options"] = {**(opts if isinstance(opts, dict) else {}),
                                     "include_usage": True}
        rid = "req_" + secrets.token_hex(12)
        request = InferenceRequest(path, chat, payload, orjson.dumps(payload),
                                   payload["model"], True, {b"x-request-id": rid.encode()},
                                   traffic_class=self.traffic_class)
        reply = await self.core.handle(request)
        if isinstance(reply.body, bytes):
            return (reply.status, Answer(reply.status, rid, _json_or_text(reply.body)),
                    _retry_after(reply))
        watcher = StreamWatcher(keep=True)
        async with contextlib.aclosing(reply.body) as stream:
            async for chunk in stream:
                watcher.feed(chunk, perf_counter())
                if gate is not None and watcher.first_token_at is not None:
                    gate.set()
        if watcher.error is not None:  # the replica broke off mid-stream
            return None, Answer(502, rid, watcher.error), None
        out = assemble(watcher.events, chat)
        return reply.status, Answer(reply.status, rid, out, _usage(out.get("usage"))), None


def _json_or_text(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return {"error": {"message": body.decode("utf-8", "replace"), "type": "upstream_error",
                          "param": None, "code": None}}


def _retry_after(reply: Reply) -> float | None:
    for k, v in reply.headers:
        if k.lower() == b"retry-after":
            with contextlib.suppress(ValueError):
                return float(v)
    return None


def _usage(usage: Any) -> tuple[int, int, int]:
    if not isinstance(usage, dict):
        return 0, 0, 0
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None

    def n(v: Any) -> int:
        return v if isinstance(v, int) and not isinstance(v, bool) else 0

    return n(usage.get("prompt_tokens")), n(cached), n(usage.get("completion_tokens"))
