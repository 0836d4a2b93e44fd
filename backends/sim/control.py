"""The /sim/ test controls of a simulated replica: fail, recover, drop reused connections,
answer garbage, state.

/sim/drop_reused makes the next N inference requests that arrive on a kept-alive connection
find it closed, as when an engine's idle timeout fires the moment a client reuses the
connection; only the socket server (backends/sim/server.py) has connections to drop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from backends.sim.messages import (
    SimRequest,
    SimResponse,
    error_response,
    json_response,
    read_json,
)

if TYPE_CHECKING:
    from backends.sim.app import SimApp


def unavailable() -> SimResponse:
    """What an inference request gets while the replica is set to fail."""
    return error_response(
        503,
        "The simulated replica is set to fail (POST /sim/recover to heal it).",
        "ServiceUnavailableError",
    )


async def fail(app: SimApp, request: SimRequest) -> SimResponse:
    app.failing = True
    return json_response({"failing": True})


async def recover(app: SimApp, request: SimRequest) -> SimResponse:
    app.failing = False
    return json_response({"failing": False})


async def drop_reused(app: SimApp, request: SimRequest) -> SimResponse:
    count = read_json(request).get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        return error_response(400, "count must be a non-negative integer.", "BadRequestError")
    app.drop_reused = count
    return json_response({"drop_reused": count})


GARBAGE = {
    # A proxy's error page where an engine's answer should be.
    "html": ("text/html", b"<html><body>502 upstream gone</body></html>"),
    # An event stream that is not one: an event that is not JSON, then a cut-off [DONE].
    "malformed_sse": ("text/event-stream", b'data: {"choices": [{"delta": \n\ndata: [DON'),
}


def garbage_response(mode: str) -> SimResponse:
    content_type, body = GARBAGE[mode]
    return SimResponse(200, {"Content-Type": content_type}, body)


async def garbage(app: SimApp, request: SimRequest) -> SimResponse:
    """Inference requests get `mode`'s garbage (html, malformed_sse) with a 200; off: heal."""
    mode = read_json(request).get("mode", "html")
    if mode != "off" and mode not in GARBAGE:
        return error_response(400, f"mode must be off or one of {sorted(GARBAGE)}.",
                              "BadRequestError")
    app.garbage = None if mode == "off" else mode
    return json_response({"garbage": mode})


async def state(app: SimApp, request: SimRequest) -> SimResponse:
    r = app.replica
    s = r.model.stats()
    body: dict[str, Any] = {
        "name": r.spec.name,
        "kind": r.spec.kind,
        "port": r.port,
        "models": list(r.spec.models),
        "profile": r.spec.profile,
        "time_scale": r.spec.time_scale,
        "lazy_kv": r.spec.lazy_kv,
        "cache_outputs": r.spec.cache_outputs,
        "failing": app.failing,
        "drop_reused": app.drop_reused,
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
        "preemptions": s.preemptions,
    }
    if request.query.get("hashes"):
        # Block hashes as strings: JSON readers often lose precision on 64-bit integers.
        body["block_hashes"] = [str(h) for h in r.model.cache.hashes()]
    return json_response(body)
