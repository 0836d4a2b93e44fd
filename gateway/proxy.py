"""The inference hot path: parse, classify, route, forward, relay, observe (raw ASGI)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import aiohttp
import orjson

from backends.pool import Pool, ReplicaState
from gateway.errors import GatewayError, bad_request, model_not_found, no_replica, upstream_failed
from gateway.sse import StreamWatcher, assemble
from gateway.state import GatewayState
from gateway.tokens import engine_token_request
from routing.prompt import render_chat, render_completion
from routing.types import Decision, RoutingRequest

log = logging.getLogger("prefix_gateway.proxy")

_RETRYABLE = frozenset((502, 503, 504))
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
_FORWARD_HEADERS = (b"x-request-id", b"traceparent", b"openai-organization", b"openai-project")


async def read_body(receive, limit: int) -> bytes:
    chunks = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise asyncio.CancelledError
        body = msg.get("body", b"")
        size += len(body)
        if size > limit:
            raise GatewayError(413, f"Request body is larger than {limit} bytes.",
                               code="request_too_large")
        chunks.append(body)
        if not msg.get("more_body"):
            return b"".join(chunks)


async def send_error(send, err: GatewayError, extra: list | None = None) -> None:
    body = err.body()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [*_JSON, (b"content-length", str(len(body)).encode()), *(extra or ())]})
    await send({"type": "http.response.body", "body": body})


def _validate(payload: Any, chat: bool) -> tuple[str, bool]:
    if not isinstance(payload, dict):
        raise bad_request("The request body must be a JSON object.")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("you must provide a model parameter (a non-empty string)", "model",
                          "missing_required_parameter" if model is None else "invalid_type")
    stream = payload.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", "stream", "invalid_type")
    if chat:
        messages = payload.get("messages")
        if messages is None:
            raise bad_request("Missing required parameter: 'messages'.", "messages",
                              "missing_required_parameter")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty array of message objects.",
                              "messages", "invalid_value")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad_request(f"messages[{i}] must be an object with a string 'role'.",
                                  f"messages[{i}]", "invalid_value")
    else:
        prompt = payload.get("prompt")
        if prompt is None:
            raise bad_request("Missing required parameter: 'prompt'.", "prompt",
                              "missing_required_parameter")
        if not isinstance(prompt, str | list) or (isinstance(prompt, list) and not prompt):
            raise bad_request("'prompt' must be a string, an array of strings or of tokens.",
                              "prompt", "invalid_type")
    return model, bool(stream)


@dataclass(slots=True)
class _Call:
    """One client request on its way through the attempts."""

    t0: float
    pool: Pool
    cls: str
    request: RoutingRequest
    body: bytes
    headers: dict[str, str]
    client_auth: str | None
    stream: bool
    aggregate: bool
    decision: Decision | None = None


@dataclass(slots=True)
class _Failure:
    """Why one try failed before the client got a byte."""

    detail: str
    never_connected: bool = False  # the connect itself timed out: the request never left


class InferenceEndpoint:
    """POST /v1/chat/completions or /v1/completions."""

    def __init__(self, state: GatewayState, path: str, chat: bool) -> None:
        self.state = state
        self.path = path
        self.chat = chat
        cfg = state.config.server
        # No total timeout: a long generation that keeps streaming must not be cut. A replica
        # that goes silent for request_timeout_s is given up on.
        self.timeout = aiohttp.ClientTimeout(total=None, sock_read=cfg.request_timeout_s,
                                             sock_connect=cfg.connect_timeout_s)
        self.max_attempts = cfg.max_attempts
        self.max_body = cfg.max_body_bytes
        self.route_headers = cfg.response_headers
        self.explain_headers = cfg.explain_headers
        self.internal_stream = cfg.non_streaming_ttft

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self._handle(scope, receive, send)
        except Exception:
            # A bug must still answer in OpenAI's shape (and be logged), never hang the client.
            # If the response had already started, the server refuses a second start: ignore.
            log.exception("unhandled error on %s", self.path)
            with contextlib.suppress(Exception):
                await send_error(send, GatewayError(500, "The gateway failed to handle this "
                                                   "request; it has been logged.",
                                                   type="internal_error", code="internal_error"))

    async def _handle(self, scope, receive, send) -> None:
        t0 = perf_counter()
        if scope["method"] != "POST":
            await send_error(send, GatewayError(405, f"Use POST for {self.path}.",
                                                code="method_not_allowed"))
            return
        state = self.state
        try:
            body = await read_body(receive, self.max_body)
            try:
                payload = orjson.loads(body)
            except orjson.JSONDecodeError as exc:
                raise bad_request(f"We could not parse the JSON body of your request ({exc}). "
                                  "Send a JSON object with Content-Type: application/json.",
                                  code="invalid_json") from None
            model, stream = _validate(payload, self.chat)
            headers = dict(scope["headers"])
            cls = state.classifier.classify(headers, payload.get("service_tier"))
            pool = state.pool_for_class[cls]
            if model not in pool.models:
                others = [p.name for p in state.pools if model in p.models]
                hint = (f" It is served by pool(s) {others}, not by pool {pool.name!r} of "
                        f"traffic class {cls!r}." if others else
                        f" Available models: {state.models}.")
                raise model_not_found(model, hint)
            request = None
            if pool.settings.hashing == "engine_tokens":
                request = await engine_token_request(state.http, pool, payload, self.chat, model,
                                                     cls)
            if request is None:
                text = render_chat(payload) if self.chat else render_completion(payload)
                request = pool.router.request_from_text(text, cls)
        except GatewayError as err:
            await send_error(send, err)
            return
        except asyncio.CancelledError:
            return

        upstream_body = body
        aggregate = False
        if not stream and self.internal_stream:
            payload["stream"] = True
            opts = payload.get("stream_options")
            payload["stream_options"] = {**(opts if isinstance(opts, dict) else {}),
                                         "include_usage": True}
            upstream_body = orjson.dumps(payload)
            aggregate = True
        fwd_headers = {"Content-Type": "application/json"}
        for h in _FORWARD_HEADERS:
            if h in headers:
                fwd_headers[h.decode()] = headers[h].decode("latin-1")
        auth = headers.get(b"authorization")
        call = _Call(t0, pool, cls, request, upstream_body, fwd_headers,
                     auth.decode("latin-1") if auth else None, stream, aggregate)
        await self._forward(receive, send, call, model)

    async def _forward(self, receive, send, call: _Call, model: str) -> None:
        state = self.state
        obs = state.observer
        pool, cls, t0, request = call.pool, call.cls, call.t0, call.request
        views = pool.healthy_views(model)
        if not views:
            await send_error(send, no_replica(pool.name))
            obs.finished(pool.name, "none", cls, "503", perf_counter() - t0, None, 0, 0.0)
            return
        decision = call.decision = pool.router.route(request, views)
        obs.decided(pool.name, pool.policy_name, cls, decision)
        candidates = [decision.replica, *decision.fallbacks]
        last_error = ""
        tried = 0
        again: set[str] = set()
        for i, name in enumerate(candidates):
            if tried == self.max_attempts:
                break
            replica = pool.replicas[name]
            if tried:
                # Skip fallbacks that failed meanwhile; they do not use up an attempt.
                if not (replica.healthy or replica.suspect):
                    continue
                pool.router.record(name, request.hashes)
                obs.retried(pool.name, name)
                uncached = max(0.0, request.prompt_tokens - pool.router.matched_blocks(
                    name, request.hashes) * request.block_tokens)
            else:
                uncached = decision.uncached_tokens
            tried += 1
            final = tried == self.max_attempts or i == len(candidates) - 1
            outcome = await self._attempt(receive, send, call, replica, uncached, final)
            if outcome is None:
                return
            last_error = outcome.detail
            if outcome.never_connected and i == len(candidates) - 1 and name not in again:
                # Nothing else to try, and the request never left: a connect that timed out
                # is as often this machine's CPU starved as the replica gone, so try it again.
                again.add(name)
                candidates.append(name)
        err = upstream_failed(pool.name, last_error or "no healthy replica left to try")
        await send_error(send, err)
        obs.finished(pool.name, decision.replica, cls, "502", perf_counter() - t0, None, 0, 0.0)

    async def _attempt(self, receive, send, call: _Call, replica: ReplicaState, uncached: float,
                       final: bool) -> _Failure | None:
        """One try on one replica. Returns None when the client got its answer, else what failed
        (nothing was sent to the client, so the caller may try elsewhere)."""
        pool, cls, t0, decision = call.pool, call.cls, call.t0, call.decision
        stream, aggregate, upstream_body = call.stream, call.aggregate, call.body
        state = self.state
        obs = state.observer
        load = pool.load
        name = replica.name
        load.dispatched(name, uncached)
        sent_at = perf_counter()
        obs.inflight(pool.name, name, 1)
        saw_first = False
        status = "error"
        watcher = StreamWatcher(keep=aggregate)

        def observe(chunk: bytes) -> None:
            # Every chunk ends an engine step there (step timing); the first with content
            # ends this request's prefill.
            nonlocal saw_first
            now = perf_counter()
            watcher.feed(chunk, now)
            load.chunk(name, now)
            if not saw_first and watcher.first_token_at is not None:
                saw_first = True
                load.first_token(name, uncached, now, sent_at)

        headers = call.headers
        auth = replica.auth or call.client_auth
        if auth:
            headers = {**headers, "Authorization": auth}
        disconnect: asyncio.Task | None = None
        resp: aiohttp.ClientResponse | None = None
        started = False
        try:
            try:
                url = replica.base_url + self.path
                try:
                    resp = await state.http.post(url, data=upstream_body, headers=headers,
                                                 timeout=self.timeout)
                except Exception as exc:
                    if not _closed_under_us(exc):
                        raise
                    # A kept-alive connection closed under the request (the engine's idle
                    # timeout firing as it was reused): nothing was answered and the replica
                    # is fine, so send it once more on a connection that is new for certain.
                    log.info("resending to %s/%s on a new connection: %s: %s", pool.name, name,
                             type(exc).__name__, exc)
                    obs.resent(pool.name, name)
                    resp = await state.http_fresh.post(url, data=upstream_body, headers=headers,
                                                       timeout=self.timeout)
            except (TimeoutError, aiohttp.ClientConnectionError, OSError) as exc:
                detail = f"{name}: {type(exc).__name__}: {exc}".rstrip(": ")
                state.monitor.mark_failed(pool, replica, detail,
                                          suspect=isinstance(exc, TimeoutError))
                return _Failure(detail, isinstance(exc, aiohttp.ConnectionTimeoutError))
            if resp.status in _RETRYABLE and not final:
                detail = f"{name}: HTTP {resp.status}"
                if resp.status == 503:
                    state.monitor.mark_failed(pool, replica, detail)
                resp.release()
                return _Failure(detail)
            status = str(resp.status)
            extra = self._route_headers(pool, replica, decision)
            disconnect = asyncio.create_task(_abort_on_disconnect(receive, resp))
            if resp.status >= 400:
                data = await resp.read()
                ctype = resp.headers.get("Content-Type", "application/json").encode()
                await send({"type": "http.response.start", "status": resp.status,
                            "headers": [(b"content-type", ctype),
                                        (b"content-length", str(len(data)).encode()), *extra]})
                await send({"type": "http.response.body", "body": data})
                return None
            if stream:
                started = True
                await send({"type": "http.response.start", "status": resp.status,
                            "headers": [*_SSE, *extra]})
                async for chunk in resp.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    observe(chunk)
                await send({"type": "http.response.body", "body": b""})
            elif aggregate:
                async for chunk in resp.content.iter_any():
                    observe(chunk)
                if watcher.error is not None:
                    status = "502"
                    body = orjson.dumps(watcher.error)
                    code = 502
                else:
                    body = orjson.dumps(assemble(watcher.events, self.chat))
                    code = resp.status
                await send({"type": "http.response.start", "status": code,
                            "headers": [*_JSON, (b"content-length", str(len(body)).encode()),
                                        *extra]})
                await send({"type": "http.response.body", "body": body})
            else:
                data = await resp.read()
                await send({"type": "http.response.start", "status": resp.status,
                            "headers": [*_JSON, (b"content-length", str(len(data)).encode()),
                                        *extra]})
                await send({"type": "http.response.body", "body": data})
            return None
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            detail = f"{name}: {type(exc).__name__} while reading the response"
            if disconnect is not None and disconnect.done():
                status = "499"  # the client went away; the upstream was closed on purpose
                return None
            if not started:
                # Nothing reached the client yet: another replica may still answer.
                state.monitor.mark_failed(pool, replica, detail)
                status = "error"
                if not final:
                    return _Failure(detail)
                await send_error(send, upstream_failed(pool.name, detail))
                status = "502"
                return None
            # Headers are out; a started stream cannot be replayed elsewhere, so end it with an
            # error event the client can see.
            status = "502"
            err = orjson.dumps({"error": {"message": f"replica {name} failed mid-stream: "
                                          f"{type(exc).__name__}", "type": "upstream_error",
                                          "param": None, "code": "upstream_failed"}})
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body",
                            "body": b"data: " + err + b"\n\n", "more_body": False})
            return None
        finally:
            if disconnect is not None:
                disconnect.cancel()
            if resp is not None:
                resp.release()
            load.finished(name, uncached, saw_first)
            obs.inflight(pool.name, name, -1)
            if watcher.usage and call.request.prompt_chars:
                tokens = watcher.usage.get("prompt_tokens")
                if isinstance(tokens, int):
                    pool.observe_prompt_tokens(call.request.prompt_chars, tokens)
                    obs.chars_per_token(pool.name, pool.router.chars_per_token)
            if status != "error":
                now = perf_counter()
                ttft = watcher.first_token_at - t0 if watcher.first_token_at else None
                decode = (watcher.last_token_at - watcher.first_token_at) if ttft else 0.0
                obs.finished(pool.name, name, cls, status, now - t0, ttft,
                             watcher.completion_tokens(), decode)

    def _route_headers(self, pool: Pool, replica: ReplicaState,
                       decision: Decision) -> list[tuple[bytes, bytes]]:
        out = []
        if self.route_headers:
            out.append((b"x-gateway-replica", replica.name.encode()))
            out.append((b"x-gateway-pool", pool.name.encode()))
        if self.explain_headers:
            out.append((b"x-gateway-route-reason", decision.reason.encode()))
            out.append((b"x-gateway-prefix-match", f"{decision.matched_fraction:.3f}".encode()))
        return out


def _closed_under_us(exc: BaseException) -> bool:
    """The connection was dropped before any answer; not a refused connect, not a timeout."""
    if isinstance(exc, TimeoutError | aiohttp.ClientConnectorError):
        return False
    return isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError
                      | ConnectionResetError)


async def _abort_on_disconnect(receive, resp: aiohttp.ClientResponse) -> None:
    """Close the upstream response when the client goes away, so the engine stops generating."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            resp.close()
            return
