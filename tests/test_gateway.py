"""The gateway's behaviour, in-process: the official openai client through httpx.ASGITransport
to the real ASGI app, simulated replicas behind the in-process transport."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import openai
import orjson
import pytest

from backends.upstream.inprocess import Handler, HandlerResponse
from gateway.stats import render_table
from tests.conftest import eventually, tenant_prompt
from tests.inprocess import (
    Harness,
    gateway,
    replica_answering,
    sim_handler,
    sse_replica,
    two_pools,
)

T = TypeVar("T")


@pytest.fixture
async def gw():
    async with gateway(two_pools()) as harness:
        yield harness


@pytest.fixture
async def timed():
    """A gateway that streams non-streaming requests internally, to time them."""
    async with gateway({**two_pools(), "server": {"non_streaming_ttft": True}}) as harness:
        yield harness


async def test_shared_prefixes_stay_home_and_spread_over_replicas(gw: Harness) -> None:
    c = gw.openai()
    served: dict[int, set[str]] = defaultdict(set)
    for i in range(8):
        system = tenant_prompt(i)
        for u in range(6):
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": f"User {u} asks question number {u * 7}."}]
            if u % 2:
                raw = await c.chat.completions.with_raw_response.create(
                    model="tiny", messages=messages, max_tokens=4)
                completion = raw.parse()
                assert completion.choices[0].message.content
                assert completion.usage is not None and completion.usage.completion_tokens == 4
            else:
                raw = await c.chat.completions.with_raw_response.create(
                    model="tiny", messages=messages, max_tokens=4, stream=True)
                chunks = [ch async for ch in raw.parse()]
                assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert raw.headers["x-gateway-pool"] == "realtime"
            if u:
                assert raw.headers["x-gateway-route-reason"] == "affinity"
                assert float(raw.headers["x-gateway-prefix-match"]) > 0.5
            served[i].add(raw.headers["x-gateway-replica"])
    # Sequential requests never load a replica: each tenant stays on its first replica, and
    # the eight tenants' cold prefixes spread over all three.
    assert all(len(replicas) == 1 for replicas in served.values()), served
    assert set().union(*served.values()) == {"rt-0", "rt-1", "rt-2"}


async def test_batch_class_is_served_only_by_batch_replicas(gw: Harness) -> None:
    by_header = gw.openai(default_headers={"x-traffic-class": "batch"})
    by_key = gw.openai(api_key="sk-batch-key")
    seen = set()
    for i in range(4):
        for c in (by_header, by_key):
            raw = await c.completions.with_raw_response.create(
                model="tiny", prompt=tenant_prompt(50 + i % 2) + f" job {i}", max_tokens=3,
                stream=bool(i % 2))
            if i % 2:
                assert [ch async for ch in raw.parse()]
            assert raw.headers["x-gateway-pool"] == "batch"
            seen.add(raw.headers["x-gateway-replica"])
    raw = await gw.openai().chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], service_tier="flex",
        max_tokens=2)
    assert raw.headers["x-gateway-pool"] == "batch"
    seen.add(raw.headers["x-gateway-replica"])
    assert seen <= {"bt-0", "bt-1"} and seen
    stats = await gw.stats()
    classes = {p["name"]: p["traffic_classes"] for p in stats["pools"]}
    assert classes == {"batch": {"batch": 9}, "realtime": {}}


def sample(samples: list, name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name
               and all(s.labels.get(k) == v for k, v in labels.items()))


async def test_metrics_have_ttft_for_both_pools_and_estimated_hits(timed: Harness) -> None:
    gw = timed
    c = gw.openai()
    system = tenant_prompt(99)
    served: set[str] = set()
    for u in range(3):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": str(u)}]
        raw = await c.chat.completions.with_raw_response.create(
            model="tiny", max_tokens=8, messages=messages)
        served.add(raw.headers["x-gateway-replica"])
    raw = await gw.openai(default_headers={"x-traffic-class": "batch"}).completions \
        .with_raw_response.create(model="tiny", prompt=system, max_tokens=3)
    served.add(raw.headers["x-gateway-replica"])
    samples = await gw.metrics()
    assert sample(samples, "gateway_time_to_first_token_seconds_count", pool="realtime") == 3
    assert sample(samples, "gateway_time_to_first_token_seconds_count", pool="batch") == 1
    assert sample(samples, "gateway_requests_total", pool="realtime", status="200") == 3
    # The second and third requests hit the blocks the first one left (all but its last).
    hits = sample(samples, "gateway_prefix_blocks_total", pool="realtime", result="hit")
    blocks = len(system) // 256
    assert hits >= 2 * (blocks - 1)
    assert sample(samples, "gateway_time_per_output_token_seconds_count") == 4
    assert sample(samples, "gateway_routing_decisions_total", reason="affinity") == 2
    assert sample(samples, "gateway_routing_decisions_total", reason="cold") == 2
    assert sample(samples, "gateway_inflight_requests") == 0
    up = {s.labels["replica"]: s.value for s in samples if s.name == "gateway_replica_up"}
    assert up == {"rt-0": 1, "rt-1": 1, "rt-2": 1, "bt-0": 1, "bt-1": 1}

    async def engine_hits() -> set[str]:
        return {s.labels["replica"] for s in await gw.metrics()
                if s.name == "gateway_engine_prefix_cache_hit_ratio" and s.value > 0}

    # The engines' own hit ratio, read from their metrics: only realtime replicas had a
    # prompt twice.
    assert await eventually(engine_hits) <= {"rt-0", "rt-1", "rt-2"}

    async def stepped() -> set[str]:
        found = {s.labels["replica"] for s in await gw.metrics()
                 if s.name == "gateway_engine_step_seconds" and s.value > 0}
        return found if found & {"rt-0", "rt-1", "rt-2"} else set()

    # Engine step times, from the gaps between the chunks the replicas streamed: those that
    # served a request (with non_streaming_ttft the batch request streams internally too, so
    # its replica may be timed as well), and at least one realtime replica.
    assert await eventually(stepped) <= served


async def test_chars_per_token_is_learned_from_the_engines_usage(gw: Harness) -> None:
    c = gw.openai()
    for i in range(10):
        await c.completions.create(model="tiny", prompt=tenant_prompt(i, 800), max_tokens=1)
    samples = await gw.metrics()
    cpt = {s.labels["pool"]: s.value for s in samples if s.name == "gateway_chars_per_token"}
    # The simulated engines count one token per 4 bytes; the realtime pool learns that.
    assert set(cpt) == {"realtime", "batch"} and 3.5 < cpt["realtime"] < 4.5


async def test_admin_stats_and_its_table_agree(timed: Harness) -> None:
    gw = timed
    c = gw.openai()
    served = set()
    for u in range(4):
        raw = await c.completions.with_raw_response.create(
            model="tiny", prompt=tenant_prompt(7) + str(u), max_tokens=6)
        served.add(raw.headers["x-gateway-replica"])
    stats = await gw.stats()
    pools = {p["name"]: p for p in stats["pools"]}
    assert set(pools) == {"realtime", "batch"}
    rt = pools["realtime"]
    assert sum(r["requests"] for r in rt["replicas"]) == 4
    assert rt["decisions_by_reason"] == {"cold": 1, "affinity": 3}
    assert all(r["healthy"] for r in rt["replicas"])
    assert all(r["url"] == gw.urls[r["name"]] for r in rt["replicas"])
    busy = [r for r in rt["replicas"] if r["name"] in served]
    assert all(r["ttft_p50_s"] > 0 for r in busy)

    # A step is timed from the gap between two of its replica's chunks; on a starved machine a
    # short answer's chunks can reach the gateway in one read, so ask again until one is.
    async def step_timed() -> dict | None:
        await c.completions.create(model="tiny", prompt=tenant_prompt(7), max_tokens=6)
        s = await gw.stats()
        rt = next(p for p in s["pools"] if p["name"] == "realtime")
        return s if any((r["engine_step_s"] or 0) > 0 for r in rt["replicas"]) else None

    stats = await eventually(step_timed)
    # With no rate configured, each pool learns its engines' prefill rate and says so.
    assert next(p for p in stats["pools"] if p["name"] == "realtime")[
        "prefill_rate_learned"] is True
    table = render_table(stats)
    assert "pool realtime" in table and "pool batch" in table
    assert table.count("(learned)") == 2
    rows = {line.split()[0]: line.split() for line in table.splitlines()
            if line.strip().startswith(("rt-", "bt-"))}
    assert {name: int(row[3]) for name, row in rows.items()} == {
        r["name"]: r["requests"] for p in stats["pools"] for r in p["replicas"]}
    # The last column: the speed each replica's queue is priced at.
    assert {name: row[-1] for name, row in rows.items()} == {
        r["name"]: f"{r['speed']:.2f}" for p in stats["pools"] for r in p["replicas"]}


@pytest.mark.parametrize(("path", "body", "status", "code"), [
    ("/v1/chat/completions", b"{not json", 400, "invalid_json"),
    ("/v1/chat/completions", b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}',
     404, "model_not_found"),
    ("/v1/chat/completions", b'{"model": "tiny"}', 400, "missing_required_parameter"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": []}', 400, "invalid_value"),
    ("/v1/completions", b'{"model": "tiny"}', 400, "missing_required_parameter"),
    ("/v1/completions", b'[1, 2]', 400, None),
    ("/v1/completions", b'{"prompt": "x"}', 400, "missing_required_parameter"),
])
async def test_bad_requests_get_openai_errors(gw: Harness, path, body, status, code) -> None:
    r = await gw.http.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    assert err["code"] == code


async def test_openai_client_sees_typed_errors(gw: Harness) -> None:
    c = gw.openai()
    with pytest.raises(openai.NotFoundError):
        await c.chat.completions.create(model="nope",
                                        messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        await c.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.BadRequestError, match="Unknown traffic class"):
        await gw.openai(default_headers={"x-traffic-class": "bulk"}).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}])


async def test_a_deeply_nested_body_is_a_400_not_a_500(timed: Harness) -> None:
    # 300 levels parse, but the JSON encoder stops at 254: re-serialising a non-streaming body
    # for the replica (streamed internally, to time it) must answer with a 400 in OpenAI's
    # shape. (A body passed through is forwarded as sent: the engine judges it.)
    gw = timed
    nested = "[" * 300 + "]" * 300
    body = (b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "extra": ' + nested.encode()
            + b"}")
    r = await gw.http.post("/v1/completions", content=body,
                           headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "nested_too_deep"


async def test_replica_errors_pass_through(gw: Harness) -> None:
    # A request the engine itself rejects (its 4xx) reaches the client as the engine sent it.
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "n": 2}
    r = await gw.http.post("/v1/completions", json=body)
    direct = await gw.sims["rt-0"].handle("POST", "/v1/completions", {}, orjson.dumps(body))
    assert direct.status == 400
    assert r.status_code == 400
    assert r.json() == orjson.loads(direct.body)


async def test_models_health_and_ready(gw: Harness) -> None:
    assert (await gw.http.get("/health")).json() == {"status": "ok"}
    ready = await gw.http.get("/ready")
    assert ready.status_code == 200 and ready.json() == {
        "ready": True, "healthy_replicas": {"realtime": 3, "batch": 2}}
    models = await gw.openai().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    page = await gw.http.get("/admin")
    assert page.status_code == 200 and "/admin/stats" in page.text
    missing = await gw.http.get("/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


WEIRD_BODIES = [
    b"", b"null", b'""', b"[]", b"\xff\xfe\x00", b"{" * 2000, b'{"model": 5, "messages": []}',
    b'{"model": "tiny", "messages": "hi"}', b'{"model": "tiny", "messages": [1]}',
    b'{"model": "tiny", "messages": [{"content": "no role"}]}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
    b'{"model": "", "messages": [{"role": "user", "content": "x"}]}',
]


@pytest.mark.parametrize("body", WEIRD_BODIES)
async def test_malformed_bodies_never_get_a_5xx(gw: Harness, body) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = await gw.http.post(path, content=body, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (path, body[:40], r.status_code, r.text[:200])
        assert r.json()["error"]["message"]


async def test_wrong_method_and_oversized_body(gw: Harness) -> None:
    r = await gw.http.get("/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    big = b'{"model": "tiny", "prompt": "' + b"x" * (33 * 1024 * 1024) + b'"}'
    r = await gw.http.post("/v1/completions", content=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


# Failover ---------------------------------------------------------------------------------


def replica_up(samples: list) -> dict[str, float]:
    return {s.labels["replica"]: s.value for s in samples if s.name == "gateway_replica_up"}


async def test_failing_home_is_skipped_before_the_first_byte() -> None:
    # Slow probes: the failure must be noticed by the request path itself, not by the prober.
    config = two_pools(realtime=2, batch=1)
    for pool in config["pools"]:
        pool["health"] = {**pool["health"], "interval_s": 30}
    async with gateway(config) as gw:
        c = gw.openai()
        prompt = "A long shared prefix for failover. " * 40
        home = await c.completions.with_raw_response.create(model="tiny", prompt=prompt,
                                                             max_tokens=2)
        home_name = home.headers["x-gateway-replica"]
        other = ({"rt-0", "rt-1"} - {home_name}).pop()
        assert (await gw.sims[home_name].handle("POST", "/sim/fail", {}, b"")).status == 200
        # Same prefix, so routing prefers the failing home; the gateway must retry elsewhere.
        for stream in (False, True):
            raw = await c.completions.with_raw_response.create(
                model="tiny", prompt=prompt + "again", max_tokens=2, stream=stream)
            if stream:
                assert [ch async for ch in raw.parse()]
            assert raw.headers["x-gateway-replica"] == other
        # The first retry went by reason "retry"; the second was routed away at once.
        samples = await gw.metrics()
        assert replica_up(samples)[home_name] == 0
        assert sample(samples, "gateway_retries_total", replica=other) == 1
        stats = await gw.stats()
        rt = next(p for p in stats["pools"] if p["name"] == "realtime")
        home_stats = next(r for r in rt["replicas"] if r["name"] == home_name)
        assert home_stats["healthy"] is False and "503" in home_stats["last_error"]


async def test_replica_leaves_and_rejoins_rotation() -> None:
    async with gateway(two_pools(realtime=2, batch=1)) as gw:
        await gw.sims["rt-0"].handle("POST", "/sim/fail", {}, b"")

        async def up_is(name: str, value: int) -> bool:
            return replica_up(await gw.metrics()).get(name) == value

        await eventually(lambda: up_is("rt-0", 0))
        c = gw.openai()
        for i in range(6):
            raw = await c.completions.with_raw_response.create(
                model="tiny", prompt=f"p{i} " * 200, max_tokens=1)
            assert raw.headers["x-gateway-replica"] == "rt-1"
        await gw.sims["rt-0"].handle("POST", "/sim/recover", {}, b"")
        await eventually(lambda: up_is("rt-0", 1))
        # Whole batch pool down: its class gets 503 with an OpenAI error, realtime still works.
        await gw.sims["bt-0"].handle("POST", "/sim/fail", {}, b"")
        await eventually(lambda: up_is("bt-0", 0))
        r = await gw.http.post("/v1/completions", headers={"x-traffic-class": "batch"},
                               json={"model": "tiny", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "no_healthy_replica"
        ready = await gw.http.get("/ready")
        assert ready.status_code == 503 and ready.json()["healthy_replicas"]["batch"] == 0
        assert (await c.completions.create(model="tiny", prompt="still fine",
                                           max_tokens=1)).choices


async def test_refused_connections_are_retried_and_the_error_names_no_address() -> None:
    config = two_pools(realtime=2, batch=1)
    for pool in config["pools"]:  # slow probes: the request path must notice by itself
        pool["health"] = {**pool["health"], "interval_s": 30}
    async with gateway(config) as gw:
        gw.upstream.unmount(gw.urls["rt-0"])  # refuses connections, as a stopped process does
        c = gw.openai()
        for i in range(4):
            raw = await c.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": f"q{i} " * 100}],
                max_tokens=1)
            assert raw.headers["x-gateway-replica"] == "rt-1"
        gw.upstream.unmount(gw.urls["rt-1"])
        r = await gw.http.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 502
        assert r.json()["error"]["type"] == "upstream_error"
        assert ".test:8000" not in r.text


def sse_event(text: str) -> bytes:
    event = {"id": "x", "object": "text_completion", "model": "tiny",
             "choices": [{"index": 0, "text": text, "finish_reason": None}]}
    return b"data: " + orjson.dumps(event) + b"\n\n"


def broken_stream(after: int) -> Handler:
    """A replica that streams `after` SSE chunks, then drops the connection."""

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(after):
            yield sse_event(f"t{i}")
        raise ConnectionResetError("replica died")

    return sse_replica(chunks)


def hanging_stream(closed: asyncio.Event) -> Handler:
    """A replica that sends one SSE chunk, then nothing until its connection is dropped."""

    async def chunks() -> AsyncIterator[bytes]:
        try:
            yield sse_event("t0")
            await asyncio.Event().wait()
        finally:
            closed.set()

    return sse_replica(chunks)


def one_replica(**server: Any) -> dict[str, Any]:
    config = two_pools(realtime=1, batch=1)
    config["server"] = server
    return config


async def test_a_stream_that_breaks_mid_way_ends_with_an_error_event() -> None:
    async with gateway(one_replica(), handlers={"rt-0": broken_stream(2)}) as gw:
        r = await gw.http.post("/v1/completions", json={"model": "tiny", "prompt": "x",
                                                        "stream": True, "max_tokens": 5})
        assert r.status_code == 200
        events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
        assert [orjson.loads(e)["choices"][0]["text"] for e in events[:2]] == ["t0", "t1"]
        error = orjson.loads(events[2])["error"]
        assert error["code"] == "upstream_failed" and "mid-stream" in error["message"]
        samples = await gw.metrics()
        assert sample(samples, "gateway_requests_total", replica="rt-0", status="502") == 1
        assert sample(samples, "gateway_inflight_requests") == 0


async def test_a_non_streaming_answer_cut_short_is_a_502_in_openai_shape() -> None:
    async with gateway(one_replica(), handlers={"rt-0": broken_stream(1)}) as gw:
        r = await gw.http.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 502
        err = r.json()["error"]
        # The client is told which pool failed, never which replica or where it is.
        assert err["code"] == "upstream_unavailable" and "'realtime'" in err["message"]
        assert "rt-0" not in r.text and gw.urls["rt-0"] not in r.text
        samples = await gw.metrics()
        assert sample(samples, "gateway_requests_total", status="502") == 1
        assert sample(samples, "gateway_inflight_requests") == 0


async def test_without_internal_streaming_the_body_passes_through_untouched() -> None:
    seen: list[bytes] = []
    async with gateway(one_replica(non_streaming_ttft=False)) as gw:
        real = sim_handler(gw.sims["rt-0"])

        async def recording(method, target, headers, body) -> HandlerResponse:
            if target.startswith("/v1/"):
                seen.append(body)
            return await real(method, target, headers, body)

        gw.upstream.mount(gw.urls["rt-0"], recording)
        body = b'{"model":"tiny","prompt":"hello there","max_tokens":3,"x_custom":[1,2]}'
        pool = gw.app.state.pools[0]
        assert pool._cpt_samples == 0
        r = await gw.http.post("/v1/completions", content=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert seen == [body]
        # The answer's usage is still read on the side: its prompt tokens teach the pool
        # its characters per token, as a stream's last event does.
        assert pool._cpt_samples == 1


async def asgi_request(app, path: str, body: bytes, leave: asyncio.Event) -> list[dict]:
    """Drive the ASGI app as a server would, for a client that disconnects once `leave` is
    set; returns the messages the app sent."""
    sent: list[dict] = []
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": [
        (b"content-type", b"application/json")], "query_string": b""}
    await app(scope, receive, send)
    return sent


@pytest.mark.parametrize(("stream", "internal_stream"), [(True, True), (False, True),
                                                         (False, False)])
async def test_a_client_that_leaves_cancels_the_upstream_request(stream: bool,
                                                                 internal_stream: bool) -> None:
    closed = asyncio.Event()
    config = one_replica(non_streaming_ttft=internal_stream)
    async with gateway(config, handlers={"rt-0": hanging_stream(closed)}) as gw:
        leave = asyncio.Event()
        body = orjson.dumps({"model": "tiny", "prompt": "x", "stream": stream})
        request = asyncio.create_task(asgi_request(gw.app, "/v1/completions", body, leave))

        async def started() -> bool:
            return sample(await gw.metrics(), "gateway_inflight_requests") == 1

        await eventually(started)
        leave.set()
        sent = await asyncio.wait_for(request, 10)
        await asyncio.wait_for(closed.wait(), 10)  # the replica's stream was closed
        samples = await gw.metrics()
        assert sample(samples, "gateway_requests_total", replica="rt-0", status="499") == 1
        assert sample(samples, "gateway_inflight_requests") == 0
        assert gw.app.state.pools[0].load.inflight == {"rt-0": 0}
        if stream:  # the client had the headers and the first chunk
            assert sent[0]["status"] == 200 and b"t0" in sent[1]["body"]
        else:  # nothing was sent to a client that is gone
            assert sent == []


@pytest.mark.parametrize("chat", [True, False])
async def test_a_non_streaming_answer_rebuilt_from_the_stream_matches_the_engines(
        chat: bool) -> None:
    async with gateway(one_replica(non_streaming_ttft=True)) as gw:
        if chat:
            path = "/v1/chat/completions"
            body = {"model": "tiny", "max_tokens": 7,
                    "messages": [{"role": "user", "content": "Tell me about caches."}]}
        else:
            path = "/v1/completions"
            body = {"model": "tiny", "max_tokens": 7, "prompt": "Tell me about caches."}
        via_gateway = (await gw.http.post(path, json=body)).json()
        direct = orjson.loads((await gw.sims["rt-0"].handle(
            "POST", path, {}, orjson.dumps(body))).body)
        assert via_gateway["object"] == direct["object"]
        assert via_gateway["usage"]["completion_tokens"] == 7
        assert via_gateway["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
        got, want = via_gateway["choices"][0], direct["choices"][0]
        assert got["finish_reason"] == want["finish_reason"] == "length"
        if chat:
            assert got["message"]["content"] == want["message"]["content"]
            assert got["message"]["role"] == "assistant"
        else:
            assert got["text"] == want["text"]
        # The engine got a stream; the gateway timed it.
        samples = await gw.metrics()
        assert sample(samples, "gateway_time_to_first_token_seconds_count", pool="realtime") == 1
        assert sample(samples, "gateway_time_per_output_token_seconds_count") == 1


async def test_engine_token_hashing_asks_the_engine_and_falls_back_to_characters() -> None:
    async with gateway(two_pools(realtime=2, batch=1, hashing="engine_tokens")) as gw:
        c = gw.openai()
        system = tenant_prompt(3)
        reasons = []
        for u in range(3):
            raw = await c.chat.completions.with_raw_response.create(
                model="tiny", max_tokens=2, messages=[
                    {"role": "system", "content": system}, {"role": "user", "content": str(u)}])
            reasons.append(raw.headers["x-gateway-route-reason"])
        assert reasons == ["cold", "affinity", "affinity"]
        tokenized = [url for method, url in gw.upstream.requests if url.endswith("/tokenize")]
        assert len(tokenized) == 3
        # Token ids need no tokenizer: no round trip.
        await c.completions.create(model="tiny", prompt=list(range(400)), max_tokens=1)
        assert sum(url.endswith("/tokenize") for _, url in gw.upstream.requests) == 3
        # trtllm-serve has no /tokenize: the batch pool hashes characters and still routes.
        raw = await gw.openai(default_headers={"x-traffic-class": "batch"}) \
            .completions.with_raw_response.create(model="tiny", prompt=system, max_tokens=1)
        assert raw.headers["x-gateway-replica"] == "bt-0"


async def test_a_request_cancelled_while_waiting_for_the_replica_releases_its_load() -> None:
    answered = asyncio.Event()

    async def silent() -> HandlerResponse:
        answered.set()
        await asyncio.Event().wait()  # never answers
        raise AssertionError("unreachable")

    async with gateway(one_replica(), handlers={"rt-0": replica_answering(silent)}) as gw:
        request = asyncio.create_task(gw.http.post(
            "/v1/completions", json={"model": "tiny", "prompt": "x"}))
        await asyncio.wait_for(answered.wait(), 10)
        assert gw.app.state.pools[0].load.inflight == {"rt-0": 1}
        request.cancel()  # as a server shutting down cancels its requests
        with pytest.raises(asyncio.CancelledError):
            await request
        assert gw.app.state.pools[0].load.inflight == {"rt-0": 0}
        assert sample(await gw.metrics(), "gateway_inflight_requests") == 0
