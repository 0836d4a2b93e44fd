"""The simulated replica's /v1/chat/completions and /v1/completions: whole replies and SSE."""

from __future__ import annotations

import time
import uuid
from typing import Any

from backends.sim import shapes
from backends.sim.messages import (
    BadRequest,
    SimRequest,
    SimResponse,
    error_response,
    json_response,
    read_json,
)
from backends.sim.prompt import PromptError, chat_prompt, completion_prompt, filler
from backends.sim.replica import RequestHandle, SimReplica

DEFAULT_MAX_TOKENS = 16
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class CompletionStream:
    """The SSE body of a streaming completion, produced as the engine emits tokens.

    Each chunk is what the real engine writes after one engine step. Ending early with
    `aclose()` aborts the request in the engine, as a client disconnect does; it is safe to
    call after the stream ended, and needed even if the stream was never read.
    """

    def __init__(
        self,
        replica: SimReplica,
        handle: RequestHandle,
        rid: str,
        created: int,
        model: str,
        chat: bool,
        include_usage: bool,
    ) -> None:
        self._replica = replica
        self._handle = handle
        self._rid = rid
        self._created = created
        self._model = model
        self._chat = chat
        self._include_usage = include_usage
        self._sent = 0
        self._done = False

    def __aiter__(self) -> CompletionStream:
        return self

    async def __anext__(self) -> bytes:
        if self._done:
            raise StopAsyncIteration
        h, sent = self._handle, self._sent
        while h.tokens == sent and not h.finished:
            await h.wait_change()
        rid, created, model, chat = self._rid, self._created, self._model, self._chat
        out = bytearray()
        if chat and sent == 0 and h.tokens:
            # vLLM opens every chat stream with the assistant role and empty content.
            out += shapes.chat_chunk(rid, created, model, {"role": "assistant", "content": ""})
        last = h.tokens - 1
        for i, word in enumerate(filler(sent, h.tokens - sent), start=sent):
            reason = h.finish_reason if h.finished and i == last else None
            if chat:
                out += shapes.chat_chunk(rid, created, model, {"content": word}, reason)
            else:
                out += shapes.completion_chunk(rid, created, model, word, reason)
        self._sent = h.tokens
        if h.finished:
            if self._include_usage:
                use = shapes.usage(h.prompt_tokens, h.tokens, h.cached_tokens)
                out += shapes.usage_chunk(rid, created, model, chat, use)
            out += shapes.SSE_DONE
            self._done = True
        return bytes(out)

    async def aclose(self) -> None:
        self._done = True
        self._replica.abort(self._handle)  # a no-op once the request finished


async def complete(replica: SimReplica, request: SimRequest, chat: bool) -> SimResponse:
    """Run one completion; a streaming one returns at once with its body still to come."""
    body = read_json(request)
    model = check_model(replica, body)
    max_tokens = _max_tokens(body)
    if body.get("n", 1) not in (1, None):
        return error_response(400, "The simulated replica supports n=1 only.", "BadRequestError")
    build = chat_prompt if chat else completion_prompt
    try:
        prompt = build(body, replica.block_tokens)
    except PromptError as exc:
        return error_response(400, str(exc), "BadRequestError")
    try:
        handle = replica.submit(prompt.block_hashes, prompt.prompt_tokens, max_tokens)
    except ValueError as exc:
        return error_response(400, str(exc), "BadRequestError")
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    if body.get("stream"):
        opts = body.get("stream_options") or {}
        include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        stream = CompletionStream(replica, handle, rid, created, model, chat, include_usage)
        return SimResponse(200, dict(SSE_HEADERS), stream=stream)
    try:
        while not handle.finished:
            await handle.wait_change()
    finally:
        # The client went away (or we failed) before the end: free the engine's slot.
        replica.abort(handle)
    use = shapes.usage(handle.prompt_tokens, handle.tokens, handle.cached_tokens)
    text = "".join(filler(0, handle.tokens))
    make = shapes.chat_response if chat else shapes.completion_response
    return json_response(make(rid, created, model, text, handle.finish_reason, use))


def check_model(replica: SimReplica, body: dict[str, Any]) -> str:
    """The served model the request names (the first one if it names none)."""
    model = body.get("model")
    models = replica.spec.models
    if model is None:
        return models[0]
    if model not in models:
        raise BadRequest(
            error_response(
                404,
                f"The model `{model}` does not exist. Served models: {', '.join(models)}.",
                "NotFoundError",
            )
        )
    return str(model)


def _max_tokens(body: dict[str, Any]) -> int:
    value = body.get("max_completion_tokens")
    if value is None:
        value = body.get("max_tokens")
    if value is None:
        return DEFAULT_MAX_TOKENS
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(
            error_response(400, "max_tokens must be a positive integer.", "BadRequestError")
        )
    return value
