"""The simulated replica in-process: `SimApp.handle` without sockets, and the same over HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from backends.sim.app import SimApp
from backends.sim.replica import SimReplicaSpec
from backends.sim.server import start_sims

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 3}


@pytest.fixture
async def sim() -> AsyncIterator[SimApp]:
    app = SimApp.from_spec(SimReplicaSpec(name="mem", kind="vllm", time_scale=0.01))
    try:
        yield app
    finally:
        app.close()


async def _post(sim: SimApp, path: str, body: object) -> tuple[int, dict[str, str], bytes]:
    resp = await sim.handle("POST", path, {}, orjson.dumps(body))
    data = b"".join([chunk async for chunk in resp.chunks()])
    return resp.status, resp.headers, data


async def _state(sim: SimApp) -> dict:
    resp = await sim.handle("GET", "/sim/state", {}, b"")
    return orjson.loads(resp.body)


async def test_whole_reply_in_process(sim: SimApp) -> None:
    status, headers, body = await _post(sim, "/v1/chat/completions", CHAT)
    assert status == 200 and headers["Content-Type"] == "application/json"
    reply = orjson.loads(body)
    assert reply["object"] == "chat.completion"
    assert reply["usage"]["completion_tokens"] == 3
    assert reply["choices"][0]["finish_reason"] == "length"


async def test_stream_in_process_is_sse_chunk_by_chunk(sim: SimApp) -> None:
    resp = await sim.handle(
        "POST",
        "/v1/completions",
        {},
        orjson.dumps({"prompt": "x" * 400, "max_tokens": 4, "stream": True}),
    )
    assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
    assert resp.stream is not None and resp.body == b""
    chunks = [chunk async for chunk in resp.chunks()]
    events = [e for chunk in chunks for e in chunk.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    texts = [orjson.loads(e[len(b"data: ") :])["choices"][0]["text"] for e in events[:-1]]
    assert len(texts) == 4
    state = await _state(sim)
    assert state["request_success"] == 1 and state["running"] == 0


async def test_closing_an_unread_stream_aborts_the_request(sim: SimApp) -> None:
    body = {**CHAT, "max_tokens": 100_000, "stream": True}
    resp = await sim.handle("POST", "/v1/chat/completions", {}, orjson.dumps(body))
    queued = await _state(sim)
    assert queued["running"] + queued["waiting"] == 1
    assert resp.stream is not None
    await resp.stream.aclose()
    state = await _state(sim)
    assert state["request_aborted"] == 1 and state["running"] == 0 and state["used_blocks"] == 0


async def test_routes_faults_and_errors_in_process(sim: SimApp) -> None:
    assert (await sim.handle("GET", "/nowhere", {}, b"")).status == 404
    wrong = await sim.handle("GET", "/v1/completions", {}, b"")
    assert wrong.status == 405 and wrong.headers["Allow"] == "POST"
    status, _, body = await _post(sim, "/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404 and orjson.loads(body)["error"]["type"] == "NotFoundError"
    assert (await _post(sim, "/sim/fail", {}))[0] == 200
    assert (await sim.handle("GET", "/health", {}, b"")).status == 503
    assert (await _post(sim, "/v1/chat/completions", CHAT))[0] == 503
    await _post(sim, "/sim/recover", {})
    assert (await sim.handle("GET", "/health", {}, b"")).status == 200
    assert (await _post(sim, "/sim/drop_reused", {"count": 2}))[0] == 200
    assert (await _state(sim))["drop_reused"] == 2
    state = await sim.handle("GET", "/sim/state?hashes=1", {}, b"")
    assert "block_hashes" in orjson.loads(state.body)


async def test_socket_server_sends_what_handle_returns() -> None:
    """The aiohttp server is a front for `SimApp.handle`: same status, type and body."""
    spec = SimReplicaSpec(name="wire", kind="trtllm", time_scale=0.01)
    local = SimApp.from_spec(spec)
    cluster = await start_sims([spec])
    calls = [
        ("GET", "/version", b""),
        ("GET", "/health", b""),
        ("POST", "/v1/completions", b"{oops"),
        ("POST", "/v1/completions", orjson.dumps({"prompt": "x", "n": 2})),
        ("POST", "/tokenize", b"{}"),
        ("POST", "/health", b""),
    ]
    try:
        async with aiohttp.ClientSession() as http:
            for method, path, body in calls:
                here = await local.handle(method, path, {}, body)
                async with http.request(method, cluster.urls[0] + path, data=body) as resp:
                    wire = (resp.status, resp.headers.get("Content-Type"), await resp.read())
                assert wire == (here.status, here.headers.get("Content-Type"), here.body), path
    finally:
        local.close()
        await cluster.stop()


@pytest.mark.parametrize("prompt", [[1, 2**32], [-1], [[5, 40_000]]])
async def test_token_ids_out_of_vocabulary_are_a_400(sim: SimApp, prompt: list) -> None:
    """As vLLM answers; the simulated replica crashed with a 500 on ids past 32 bits (found by
    the fuzzer)."""
    status, _, body = await _post(sim, "/v1/completions", {"model": "tiny", "prompt": prompt})
    assert status == 400
    assert "out of vocabulary" in orjson.loads(body)["error"]["message"]


async def _crowd(spec: SimReplicaSpec) -> tuple[list[dict], dict, bytes]:
    """Six 21-token prompts (one full block of 16 each) asking 56 tokens each, 5 blocks a
    request in all, at once on a 24-block cache: the replies, then /sim/state and /metrics
    once all have ended."""
    app = SimApp.from_spec(spec)
    try:
        bodies = [{"prompt": f"{i} " + "x " * 40, "max_tokens": 56} for i in range(6)]
        replies = await asyncio.gather(*(_post(app, "/v1/completions", b) for b in bodies))
        metrics = await app.handle("GET", "/metrics", {}, b"")
        return [orjson.loads(body) for _, _, body in replies], await _state(app), metrics.body
    finally:
        app.close()


async def test_lazy_kv_replica_preempts_under_pressure_and_delivers_every_token() -> None:
    spec = SimReplicaSpec(name="lazy", kind="vllm", time_scale=0.01, kv_capacity_tokens=384,
                          lazy_kv=True, cache_outputs=True)
    replies, state, metrics = await _crowd(spec)
    assert [r["usage"]["completion_tokens"] for r in replies] == [56] * 6
    # The six prompts' 12 blocks fit at admission, their 30 blocks in all do not: a sequence
    # finds no block mid-decode and the newest running request is preempted.
    assert state["lazy_kv"] and state["preemptions"] > 0
    preempted = [line for line in metrics.splitlines()
                 if line.startswith(b"vllm:num_preemptions_total")]
    assert preempted and float(preempted[0].rsplit(b" ", 1)[1]) == state["preemptions"]
    assert state["running"] == state["waiting"] == state["used_blocks"] == 0
    # Kept outputs: more resident than the six prompts' full blocks alone.
    assert state["resident_blocks"] > 6


async def test_reserving_replica_never_preempts_on_the_same_crowd() -> None:
    spec = SimReplicaSpec(name="reserve", kind="vllm", time_scale=0.01, kv_capacity_tokens=384)
    replies, state, _ = await _crowd(spec)
    assert [r["usage"]["completion_tokens"] for r in replies] == [56] * 6
    assert not state["lazy_kv"] and state["preemptions"] == 0
    assert state["resident_blocks"] == 6  # each prompt's full block; outputs freed
