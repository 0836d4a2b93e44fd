"""Failover that wastes no request, upstream timeouts and passive ejection, in process.

Each test puts a faulty replica (a few lines of handler) beside simulated ones and checks what
the client gets (through the official openai client) and what the gateway makes of the
replica.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from time import perf_counter
from typing import Any

import orjson
import pytest

from backends.upstream.inprocess import Handler, HandlerResponse
from gateway.config import ConfigError, parse_config
from gateway.exchange import InferenceRequest, Reply
from tests.conftest import eventually
from tests.inprocess import Harness, gateway, replica_answering, sse_replica, two_pools


def config(slow_probes: bool = True, *, timeouts: dict | None = None,
           ejection: dict | None = None, realtime: int = 2) -> dict[str, Any]:
    """Two realtime replicas; probes slow enough (by default) that only live traffic can
    take a replica out of rotation."""
    cfg = two_pools(realtime=realtime, batch=1)
    rt = cfg["pools"][0]
    if slow_probes:
        rt["health"] = {**rt["health"], "interval_s": 30}
    if timeouts:
        rt["timeouts"] = timeouts
    if ejection:
        rt["ejection"] = ejection
    return cfg


def event(content: str | None = None, role: bool = False) -> bytes:
    delta: dict[str, Any] = {"role": "assistant"} if role else {}
    if content is not None:
        delta["content"] = content
    ev = {"id": "c", "object": "chat.completion.chunk", "model": "tiny",
          "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    return b"data: " + orjson.dumps(ev) + b"\n\n"


async def _dies_after_role() -> AsyncIterator[bytes]:
    yield event(role=True)  # vLLM's first chat event: a role, no content yet
    raise ConnectionResetError("replica killed")


async def _error_event() -> AsyncIterator[bytes]:
    yield event(role=True)
    yield b'data: {"error": {"message": "engine dead", "type": "InternalServerError"}}\n\n'


async def _ends_early() -> AsyncIterator[bytes]:
    yield event(role=True)  # and the stream ends: no content, no [DONE]


async def _never_content() -> AsyncIterator[bytes]:
    yield b": keep-alive\n\n"
    await asyncio.Event().wait()
    yield b""  # unreachable; makes this a generator


FAULTS: dict[str, Handler] = {
    "killed_before_content": sse_replica(_dies_after_role),
    "error_event_before_content": sse_replica(_error_event),
    "ended_without_content": sse_replica(_ends_early),
    "garbage": replica_answering(lambda: HandlerResponse(200, b"<html>upstream proxy error</html>",
                                               {"content-type": "text/html"})),
    "never_content": sse_replica(_never_content),
}


async def _until_faulty_tried(gw: Harness, faulty: str, ask) -> list[Any]:
    """Send requests with new prompts until one was routed to `faulty` first; every one of
    them must get a full answer."""
    answers = []
    for i in range(20):
        answers.append(await ask(f"question {i} " * 30))
        if any(faulty in url for _, url in gw.upstream.requests if "/v1/" in url):
            return answers
    raise AssertionError(f"no request was routed to {faulty}")


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize(("stream", "internal_stream"), [(True, False), (False, False),
                                                         (False, True)],
                         ids=["stream", "passthrough", "assembled"])
async def test_a_replica_failing_before_any_content_costs_no_request(
        fault: str, stream: bool, internal_stream: bool) -> None:
    # Passed through (the default), a non-streaming answer is checked whole before it goes
    # out: a 200 that is not a JSON object (an SSE stream here, an HTML page) is tried
    # elsewhere, and first_byte_s bounds the whole answer.
    cfg = config(timeouts={"first_byte_s": 0.5})
    cfg["server"] = {"non_streaming_ttft": internal_stream}
    async with gateway(cfg, handlers={"rt-0": FAULTS[fault]}) as gw:
        c = gw.openai()

        async def ask(prompt: str) -> tuple[str, str]:
            raw = await c.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=4,
                stream=stream)
            if stream:
                text = "".join([ch.choices[0].delta.content or "" async for ch in raw.parse()
                                if ch.choices])
            else:
                text = raw.parse().choices[0].message.content
            return raw.headers["x-gateway-replica"], text

        for served_by, text in await _until_faulty_tried(gw, gw.urls["rt-0"], ask):
            assert served_by == "rt-1" and text  # the whole answer, from the other replica
        samples = await gw.metrics()
        failed = {s.labels["reason"]: s.value for s in samples
                  if s.name == "gateway_tries_failed_total" and s.labels["replica"] == "rt-0"}
        assert sum(failed.values()) >= 1
        if fault == "never_content":
            assert set(failed) == {"first_byte_timeout"}


async def _broken_after_content() -> AsyncIterator[bytes]:
    yield event(role=True)
    yield event("Hello")
    raise ConnectionResetError("replica killed")


async def test_a_stream_broken_after_content_ends_with_an_error_and_ejects_the_replica() -> None:
    async with gateway(config(realtime=1),
                       handlers={"rt-0": sse_replica(_broken_after_content)}) as gw:
        r = await gw.http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True})
        assert r.status_code == 200
        events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
        assert orjson.loads(events[1])["choices"][0]["delta"]["content"] == "Hello"
        assert orjson.loads(events[-1])["error"]["code"] == "upstream_failed"
        replica = gw.app.state.pools[0].replicas["rt-0"]
        assert not replica.healthy  # out of rotation, although its health checks pass
        samples = await gw.metrics()
        assert any(s.name == "gateway_replica_ejections_total" and s.value == 1
                   and s.labels == {"pool": "realtime", "replica": "rt-0", "reason": "broken"}
                   for s in samples)
        # With it out, the pool has no replica left: a clear 503, not a try on a dead one.
        again = await gw.http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert again.status_code == 503


async def test_failures_in_a_row_eject_and_probes_bring_the_replica_back_later() -> None:
    answer500 = replica_answering(lambda: HandlerResponse(500, b'{"error": "boom"}'))
    cfg = config(slow_probes=False, realtime=1,
                 ejection={"consecutive_failures": 3, "base_s": 0.5, "max_s": 5})
    async with gateway(cfg, handlers={"rt-0": answer500}) as gw:
        r0 = gw.app.state.pools[0].replicas["rt-0"]
        for _ in range(2):
            r = await gw.http.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
            assert r.status_code == 500
        assert r0.healthy  # two failures are not yet an outlier
        r = await gw.http.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 500 and not r0.healthy and r0.ejections == 1
        # Its probes pass (every 0.1 s), but it stays out until its ejection is over.
        loop = asyncio.get_running_loop()
        ejected_at = loop.time()
        await eventually(lambda: r0.healthy)
        assert loop.time() - ejected_at >= 0.5 - 0.01
        # Ejected again soon after: for twice as long.
        for _ in range(3):
            await gw.http.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert not r0.healthy and r0.ejections == 2


class Freeze:
    """SIGSTOP (`set`) and SIGCONT (`clear`) for a simulated replica."""

    def __init__(self) -> None:
        self._running = asyncio.Event()
        self._running.set()

    def set(self) -> None:
        self._running.clear()

    def clear(self) -> None:
        self._running.set()

    def is_set(self) -> bool:
        return not self._running.is_set()

    async def wait_thawed(self) -> None:
        await self._running.wait()


def freezable(busy: bool = False) -> tuple[Handler, Freeze]:
    """A replica streaming max_tokens tokens, one every 20 ms, until `frozen` is set; from
    then until it is cleared it sends nothing at all, to old and new requests: as a
    SIGSTOPped process (its health checks are not answered either) or, `busy`, as an engine
    held by a long prefill (its API server still answers health checks)."""
    frozen = Freeze()

    async def tokens(n: int) -> AsyncIterator[bytes]:
        await asyncio.sleep(0)
        await frozen.wait_thawed()
        yield event(role=True)
        for i in range(n):
            await asyncio.sleep(0.02)
            await frozen.wait_thawed()
            yield event(f"t{i} ")
        yield b"data: [DONE]\n\n"

    async def handle(method: str, target: str, headers: Mapping[str, str],
                     body: bytes) -> HandlerResponse:
        if target == "/health":
            if not busy:
                await frozen.wait_thawed()
            return HandlerResponse(200)
        if target == "/metrics":
            return HandlerResponse(404)
        n = orjson.loads(body).get("max_tokens") or 10_000
        return HandlerResponse(200, tokens(n), {"content-type": "text/event-stream"})

    return handle, frozen


LONG_CHAT = {"model": "tiny", "stream": True,
             "messages": [{"role": "user", "content": "a shared prompt " * 50}]}


async def through_core(gw: Harness, **extra: Any) -> Reply:
    """A streaming chat request read through the request core (the in-process HTTP client
    would wait for the stream's end)."""
    payload = {**LONG_CHAT, **extra}
    return await gw.app.core.handle(InferenceRequest(
        "/v1/chat/completions", True, payload, orjson.dumps(payload), "tiny", True))


async def silenced_under_a_stream(gw: Harness, frozen: Freeze
                                  ) -> tuple[Reply, asyncio.Future[bytes], asyncio.Task[Reply]]:
    """A stream decoding on the pool's one replica, which then falls silent (`frozen`): the
    stream's next read waits there, and so does a second request for its first content."""
    first = await through_core(gw)
    assert b"t0" in await anext(first.body)
    reader = asyncio.ensure_future(anext(first.body))
    frozen.set()
    second = asyncio.create_task(through_core(gw, max_tokens=3))
    return first, reader, second


async def both_answered_once_thawed(first: Reply, reader: asyncio.Future[bytes],
                                    second: asyncio.Task[Reply], frozen: Freeze) -> None:
    frozen.clear()  # the prefill is done, or SIGCONT: tokens flow again, to both
    assert (await reader).startswith(b"data: ")
    reply = await second
    assert reply.status == 200 and b"[DONE]" in b"".join([c async for c in reply.body])
    await first.body.aclose()


async def test_a_frozen_replica_is_ejected_and_its_waiting_requests_go_elsewhere() -> None:
    h0, f0 = freezable()
    h1, f1 = freezable()
    frozen_flags = {"rt-0": f0, "rt-1": f1}
    cfg = config(ejection={"stall_s": 0.5})
    async with gateway(cfg, handlers={"rt-0": h0, "rt-1": h1}) as gw:
        first = await through_core(gw)
        home = dict(first.headers)[b"x-gateway-replica"].decode()
        other = ({"rt-0", "rt-1"} - {home}).pop()
        assert b"t0" in await anext(first.body)  # it is streaming from its home

        async def read_on() -> None:  # as its client does
            async for _ in first.body:
                pass

        reader = asyncio.create_task(read_on())
        frozen_flags[home].set()
        # Same prompt, same home: this one waits there for content that never comes, until
        # the stall watch sees the home silent with a stream decoding and fails it over.
        second = await gw.openai().chat.completions.with_raw_response.create(
            model="tiny", messages=LONG_CHAT["messages"], stream=True, max_tokens=3)
        assert second.headers["x-gateway-replica"] == other
        assert len([ch async for ch in second.parse()]) == 4
        replica = gw.app.state.pools[0].replicas[home]
        assert not replica.healthy
        samples = await gw.metrics()
        assert any(s.name == "gateway_replica_ejections_total" and s.labels["reason"] ==
                   "stalled" and s.labels["replica"] == home and s.value == 1 for s in samples)
        assert any(s.name == "gateway_tries_failed_total" and s.labels["reason"] == "stalled"
                   and s.value == 1 for s in samples)
        reader.cancel()
        await first.body.aclose()


async def test_a_busy_replica_is_not_taken_for_a_frozen_one() -> None:
    """A long prefill holds every stream of an engine for seconds, but its API server answers
    health checks meanwhile: the stall watch asks, and leaves it (and the requests waiting
    there) alone. Before, silence alone ejected it, and a request waiting for its first
    token there failed over (or got a 502, with no other replica)."""
    h0, f0 = freezable(busy=True)
    async with gateway(config(ejection={"stall_s": 0.2}, realtime=1),
                       handlers={"rt-0": h0}) as gw:
        first, reader, second = await silenced_under_a_stream(gw, f0)
        replica = gw.app.state.pools[0].replicas["rt-0"]
        # Silent for ten stall limits, asked over and over, answering every time.
        await eventually(lambda: replica.answered_at > 0 and replica.reads == 1)
        asked_at = replica.answered_at
        await eventually(lambda: replica.answered_at > asked_at + 10 * 0.2)
        assert replica.healthy and replica.ejections == 0
        assert not second.done() and not reader.done()
        await both_answered_once_thawed(first, reader, second, f0)
        samples = await gw.metrics()
        assert not any(s.name == "gateway_replica_ejections_total" and s.value for s in samples)


async def test_a_lone_frozen_replica_is_kept_and_its_waiting_requests_wait_on() -> None:
    """With nowhere else to go, ejecting the pool's last healthy replica would fail the
    requests waiting there (and answer new ones 503): it stays, and they are answered when it
    comes back."""
    h0, f0 = freezable()
    async with gateway(config(ejection={"stall_s": 0.2}, realtime=1),
                       handlers={"rt-0": h0}) as gw:
        first, reader, second = await silenced_under_a_stream(gw, f0)
        replica = gw.app.state.pools[0].replicas["rt-0"]
        # Seen stalled (a health check went unanswered), twice, and kept.
        await eventually(lambda: replica.unanswered_at > 0)
        seen = replica.unanswered_at
        await eventually(lambda: replica.unanswered_at > seen)
        assert replica.healthy and replica.ejections == 0 and replica.answered_at == 0
        assert not second.done()
        await both_answered_once_thawed(first, reader, second, f0)


async def _slow_tokens() -> AsyncIterator[bytes]:
    yield event(role=True)
    yield event("first ")
    await asyncio.sleep(30)  # far beyond the limits under test
    yield event("late")


@pytest.mark.parametrize("limit", [{"total_s": 0.3}, {"between_chunks_s": 0.3}])
async def test_pool_timeouts_cut_a_silent_stream_with_an_error_event(
        limit: dict, caplog: pytest.LogCaptureFixture) -> None:
    cfg = config(realtime=1, timeouts=limit)
    async with gateway(cfg, handlers={"rt-0": sse_replica(_slow_tokens)}) as gw:
        r = await gw.http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True})
        events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
        assert orjson.loads(events[1])["choices"][0]["delta"]["content"] == "first "
        assert orjson.loads(events[-1])["error"]["code"] == "upstream_failed"
        assert "TimeoutError" in caplog.text  # the cause is logged, not told to the client


async def test_a_client_leaving_before_headers_drops_the_replicas_request() -> None:
    answered = asyncio.Event()
    dropped = asyncio.Event()

    async def silent() -> HandlerResponse:
        answered.set()
        try:
            await asyncio.Event().wait()  # an engine that answers only when done
        finally:
            dropped.set()
        raise AssertionError("unreachable")

    async with gateway(config(realtime=1), handlers={"rt-0": replica_answering(silent)}) as gw:
        app = gw.app
        sent: list[dict] = []
        left = asyncio.Event()
        body = orjson.dumps({"model": "tiny", "prompt": "x"})
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if messages:
                return messages.pop(0)
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(msg: dict) -> None:
            sent.append(msg)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
        handling = asyncio.create_task(app(scope, receive, send))
        await answered.wait()
        left.set()
        await asyncio.wait_for(dropped.wait(), 10)
        await handling
        assert gw.app.state.pools[0].load.inflight == {"rt-0": 0}
        samples = await gw.metrics()
        assert any(s.name == "gateway_requests_total" and s.labels["status"] == "499"
                   and s.value == 1 for s in samples)


def test_pool_timeouts_default_to_the_servers_and_null_means_no_limit() -> None:
    cfg = two_pools(realtime=1, batch=1)
    cfg["server"] = {"connect_timeout_s": 2.5, "request_timeout_s": 100}
    cfg["pools"][1]["timeouts"] = {"connect_s": None, "first_byte_s": 5, "total_s": 60}
    parsed = parse_config(cfg)
    rt, bt = (p.timeouts_for(parsed.server) for p in parsed.pools)
    assert (rt.connect, rt.read, rt.first_byte, rt.total) == (2.5, 100, None, None)
    assert (bt.connect, bt.read, bt.first_byte, bt.total) == (None, 100, 5, 60)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("ejection", {"base_s": 10, "max_s": 1}, "above max_s"),
    ("ejection", {"consecutive_failures": 0}, "greater than or equal to 1"),
    ("timeouts", {"first_byte_s": 0}, "greater than 0"),
    ("timeouts", {"read_s": 1}, "unknown key"),
])
def test_bad_timeouts_and_ejection_settings_are_rejected(key: str, value: dict,
                                                         message: str) -> None:
    cfg = two_pools(realtime=1, batch=1)
    cfg["pools"][0][key] = value
    with pytest.raises(ConfigError, match=message):
        parse_config(cfg)


async def test_only_a_wait_for_the_replica_counts_as_its_silence() -> None:
    h0, f0 = freezable()
    async with gateway(config(ejection={"stall_s": 0.5}), handlers={"rt-0": h0}) as gw:
        f0.set()  # from now on its health checks are not answered
        pool = gw.app.state.pools[0]
        r0 = pool.replicas["rt-0"]
        monitor = gw.app.state.monitor
        now = perf_counter()
        r0.last_chunk_at = now - 60  # silent for a minute...
        monitor.check_stalls(pool, now)
        # ...but nothing waited for it (a stream whose client reads slowly is not read).
        assert r0.healthy
        r0.reads, r0.reads_since = 1, now - 0.2  # a read waiting for 0.2 s: not yet
        monitor.check_stalls(pool, now)
        assert r0.healthy
        r0.reads_since = now - 0.6
        monitor.check_stalls(pool, now)  # asks it; unanswered, it is ejected
        await eventually(lambda: not r0.healthy)
        assert "stalled" in r0.last_error and r0.answered_at == 0
        r0.reads = 0
