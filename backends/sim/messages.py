"""Requests and responses as the simulated replica's handlers see them, free of any HTTP server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from backends.sim import shapes

JSON = "application/json"
TEXT = "text/plain; charset=utf-8"


@dataclass(slots=True)
class SimRequest:
    """One request: method, path, decoded query, headers and the raw body."""

    method: str
    path: str
    query: dict[str, str]
    headers: Mapping[str, str]
    body: bytes


class BodyStream(Protocol):
    """A body produced while the engine works; `aclose()` ends it early and frees the engine."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


@dataclass(slots=True)
class SimResponse:
    """One answer: status, headers, and either a complete body or a `stream`."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    stream: BodyStream | None = None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as the server writes it: one chunk, or the stream's (closed at the end)."""
        if self.stream is None:
            if self.body:
                yield self.body
            return
        try:
            async for chunk in self.stream:
                yield chunk
        finally:
            await self.stream.aclose()


def json_response(obj: Any, status: int = 200) -> SimResponse:
    return SimResponse(status, {"Content-Type": JSON}, orjson.dumps(obj))


def error_response(status: int, message: str, type_: str) -> SimResponse:
    """OpenAI's error object, as current vLLM returns it."""
    return SimResponse(status, {"Content-Type": JSON}, shapes.error_body(message, type_, status))


def text_response(status: int, text: str) -> SimResponse:
    return SimResponse(status, {"Content-Type": TEXT}, text.encode())


class BadRequest(Exception):
    """A request the replica refuses; `response` is what it answers."""

    def __init__(self, response: SimResponse) -> None:
        self.response = response


def read_json(request: SimRequest) -> dict[str, Any]:
    """The body as a JSON object, or BadRequest with the error vLLM would send."""
    try:
        body = orjson.loads(request.body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(
            error_response(
                400,
                f"Request body is not valid JSON ({exc}); send a JSON object.",
                "BadRequestError",
            )
        ) from None
    if not isinstance(body, dict):
        raise BadRequest(
            error_response(400, "Request body must be a JSON object.", "BadRequestError")
        )
    return body
