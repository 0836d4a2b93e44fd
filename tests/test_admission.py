"""Admission control, in-process: queues and 429s, routing at dequeue, class order, borrowing,
priorities, disconnects, and every slot and queue entry returned.

Replicas here are `Held` handlers: each request streams one event, then waits until the test
lets it finish (or breaks it), so what is in flight and what waits is decided by the test,
never by timing."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import openai
import orjson
import pytest

from backends.upstream.inprocess import HandlerResponse
from gateway.exchange import InferenceRequest
from gateway.parse import parse_body
from gateway.stats import render_table
from tests.conftest import eventually, tenant_prompt
from tests.inprocess import Harness, gateway, two_pools
from tests.test_gateway import asgi_request, sample, sse_event


class Held:
    """A replica whose requests stream a first event, then wait for `finish()` (a
    non-streaming request's whole answer waits for it); `down` makes its health check fail."""

    def __init__(self) -> None:
        self.prompts: list[str] = []
        """The prompt of every inference request that reached it, in order."""
        self.waiting: list[asyncio.Future[bool]] = []
        """Requests it is still streaming, oldest first."""
        self.down = False

    async def __call__(self, method: str, target: str, headers: Mapping[str, str],
                      body: bytes) -> HandlerResponse:
        if target == "/health":
            return HandlerResponse(503 if self.down else 200)
        if not target.startswith("/v1/"):
            return HandlerResponse(404)
        payload = orjson.loads(body)
        self.prompts.append(payload["prompt"])
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.waiting.append(done)
        if not payload.get("stream"):
            return HandlerResponse(200, self._whole(done), {"content-type": "application/json"})
        return HandlerResponse(200, self._stream(done), {"content-type": "text/event-stream"})

    async def _whole(self, done: asyncio.Future[bool]):
        try:
            if not await done:
                raise ConnectionResetError("the replica broke the answer")
            yield orjson.dumps({"id": "cmpl-held", "object": "text_completion", "model": "tiny",
                                "choices": [{"index": 0, "text": "first last",
                                             "finish_reason": "stop"}]})
        finally:
            if done in self.waiting:
                self.waiting.remove(done)

    async def _stream(self, done: asyncio.Future[bool]):
        try:
            yield sse_event("first")
            if not await done:
                raise ConnectionResetError("the replica broke the stream")
            yield sse_event(" last")
            yield b"data: [DONE]\n\n"
        finally:
            if done in self.waiting:
                self.waiting.remove(done)

    def finish(self, ok: bool = True) -> str:
        """Let its oldest request end (or break it); returns that request's prompt."""
        done = self.waiting.pop(0)
        done.set_result(ok)
        return self.prompts[len(self.prompts) - len(self.waiting) - 1]


def holding(*names: str) -> dict[str, Held]:
    return {name: Held() for name in names}


def admission_config(*, rt: int = 1, bt: int = 1, rt_limit: int | None = 1,
                     bt_limit: int | None = 1, reserved: float = 0.25,
                     realtime: dict[str, Any] | None = None,
                     batch: dict[str, Any] | None = None, **classification: Any) -> dict:
    """`two_pools` with per-replica limits, realtime ranked above batch, and each class's
    admission settings as given."""
    config = two_pools(realtime=rt, batch=bt)
    for pool, limit in zip(config["pools"], (rt_limit, bt_limit), strict=True):
        if limit is not None:
            pool["max_inflight_per_replica"] = limit
            pool["reserved_fraction"] = reserved
    config["traffic_classes"] = [
        {"name": "realtime", "pool": "realtime", "priority": 10, "admission": realtime or {}},
        {"name": "batch", "pool": "batch", "priority": 0, "admission": batch or {}},
    ]
    config["classification"].update(classification)
    return config


async def admission(gw: Harness) -> tuple[dict[str, dict], dict[str, dict]]:
    """/admin/stats' admission section: (classes by name, pools by name)."""
    section = (await gw.stats())["admission"]
    return ({c["name"]: c for c in section["classes"]}, {p["name"]: p for p in section["pools"]})


async def queued(gw: Harness, cls: str) -> int:
    return (await admission(gw))[0][cls]["queued"]


async def until_queued(gw: Harness, cls: str, n: int) -> None:
    """Wait until `n` requests of `cls` wait in its queue."""
    async def check() -> bool:
        return await queued(gw, cls) == n

    await eventually(check)


def send(gw: Harness, prompt: str, *, cls: str | None = None, stream: bool = False,
         headers: dict[str, str] | None = None, **client: Any) -> asyncio.Task:
    """A completion request through the openai client, as a task: its raw response."""
    headers = dict(headers or {})
    if cls:
        headers["x-traffic-class"] = cls
    c = gw.openai(default_headers=headers, **client)

    async def go() -> Any:
        raw = await c.completions.with_raw_response.create(model="tiny", prompt=prompt,
                                                            max_tokens=2, stream=stream)
        if stream:
            raw.chunks = [ch async for ch in raw.parse()]
        return raw

    return asyncio.create_task(go())


def arrived(held: dict[str, Held]) -> int:
    return sum(len(h.prompts) for h in held.values())


async def assert_all_returned(gw: Harness) -> None:
    """No slot held, no request queued, no load left on any replica: in stats and metrics."""
    classes, pools = await admission(gw)
    assert all(c["queued"] == 0 and c["inflight"] == 0 and c["inflight_by_pool"] == {}
               for c in classes.values()), classes
    assert all(p["inflight"] == 0 and p["borrowed_inflight"] == 0 for p in pools.values())
    samples = await gw.metrics()
    for name in ("gateway_queue_depth", "gateway_admission_inflight",
                 "gateway_inflight_requests"):
        values = [s.value for s in samples if s.name == name]
        assert values and set(values) == {0}, name
    assert all(set(p.load.inflight.values()) <= {0} for p in gw.app.state.pools)


# Queue, 429, timeout --------------------------------------------------------------------------


async def test_past_its_queue_a_class_gets_429_with_retry_after_and_the_queue_is_served() -> None:
    held = holding("rt-0", "bt-0")
    config = admission_config(realtime={"max_queue": 2, "retry_after_s": 3})
    async with gateway(config, handlers=held) as gw:
        first = send(gw, "first")
        await eventually(lambda: held["rt-0"].prompts == ["first"])
        waiting = [send(gw, f"queued {i}") for i in range(2)]
        await until_queued(gw, "realtime", 2)
        with pytest.raises(openai.RateLimitError) as refused:
            await gw.openai().completions.create(model="tiny", prompt="one too many",
                                                 max_tokens=2)
        assert refused.value.status_code == 429
        assert refused.value.response.headers["retry-after"] == "3"
        assert (refused.value.type, refused.value.code) == ("rate_limit_error", "queue_full")
        assert set(refused.value.body) == {"message", "type", "param", "code"}
        # The two queued are served in turn, as the slot frees.
        for n in (2, 3):
            held["rt-0"].finish()
            await eventually(lambda n=n: len(held["rt-0"].prompts) == n)
        held["rt-0"].finish()
        replies = await asyncio.gather(first, *waiting)
        assert [r.status_code for r in replies] == [200, 200, 200]
        assert held["rt-0"].prompts == ["first", "queued 0", "queued 1"]
        samples = await gw.metrics()
        assert sample(samples, "gateway_admission_rejected_total", traffic_class="realtime",
                      reason="queue_full") == 1
        assert sample(samples, "gateway_requests_total", replica="none", status="429") == 1
        assert sample(samples, "gateway_queue_wait_seconds_count", traffic_class="realtime") == 3
        await assert_all_returned(gw)


async def test_a_request_that_waits_its_longest_gets_429() -> None:
    held = holding("rt-0", "bt-0")
    config = admission_config(realtime={"max_queue_wait_s": 0.05})
    async with gateway(config, handlers=held) as gw:
        first = send(gw, "first")
        await eventually(lambda: held["rt-0"].prompts == ["first"])
        r = await gw.http.post("/v1/completions",
                               json={"model": "tiny", "prompt": "late", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_timeout"
        assert held["rt-0"].prompts == ["first"]  # it never reached the replica
        held["rt-0"].finish()
        assert (await first).status_code == 200
        samples = await gw.metrics()
        assert sample(samples, "gateway_admission_rejected_total",
                      reason="queue_timeout") == 1
        # It waited the whole configured time, and that wait is in the histogram.
        assert sample(samples, "gateway_queue_wait_seconds_sum",
                      traffic_class="realtime") >= 0.05
        stats = (await admission(gw))[0]["realtime"]
        assert stats["rejected"] == {"queue_timeout": 1}
        await assert_all_returned(gw)


async def capacity(gw: Harness, pool: str) -> int:
    return (await admission(gw))[1][pool]["capacity"]


async def until_capacity(gw: Harness, pool: str, n: int) -> None:
    async def check() -> bool:
        return await capacity(gw, pool) == n

    await eventually(check)


def post(gw: Harness, prompt: str, **headers: str) -> asyncio.Task:
    """The request as plain HTTP, as a task: its httpx response, whatever the status."""
    return asyncio.create_task(gw.http.post(
        "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
        headers=headers))


async def test_capacity_follows_health_and_a_dead_pool_answers_503_not_429() -> None:
    held = holding("rt-0", "rt-1", "bt-0")
    async with gateway(admission_config(rt=2), handlers=held) as gw:
        assert await capacity(gw, "realtime") == 2
        held["rt-1"].down = True
        await until_capacity(gw, "realtime", 1)
        first = send(gw, "first")
        await eventually(lambda: held["rt-0"].prompts == ["first"])
        second = send(gw, "second")
        await until_queued(gw, "realtime", 1)
        # A replica back in rotation adds its slots: the queued request goes there at once.
        held["rt-1"].down = False
        await eventually(lambda: held["rt-1"].prompts == ["second"])
        samples = await gw.metrics()
        assert sample(samples, "gateway_admission_capacity", pool="realtime") == 2
        held["rt-1"].finish()
        assert (await second).status_code == 200
        # rt-1 down again: the next request waits for rt-0's slot; then rt-0 dies too, and
        # the waiting request gets the 503 it would have got without admission control.
        held["rt-1"].down = True
        await until_capacity(gw, "realtime", 1)
        third = post(gw, "third")
        await until_queued(gw, "realtime", 1)
        held["rt-0"].down = True
        r = await third
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_replica"
        r = await gw.http.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_replica"
        held["rt-0"].finish()
        assert (await first).status_code == 200
        await assert_all_returned(gw)


# Routing at dequeue, class order, borrowing -----------------------------------------------------


@pytest.mark.parametrize("freed", ["home", "other"])
async def test_the_replica_is_chosen_when_the_request_leaves_the_queue(freed: str) -> None:
    held = holding("rt-0", "rt-1", "bt-0")
    async with gateway(admission_config(rt=2), handlers=held) as gw:
        prefix = tenant_prompt(1)
        a = send(gw, prefix + " A")
        await eventually(lambda: arrived(held) == 1)
        home = next(n for n, h in held.items() if h.prompts)
        other = ({"rt-0", "rt-1"} - {home}).pop()
        # The prefix's home is at its limit, so it is hidden from routing: B goes elsewhere.
        b = send(gw, tenant_prompt(2) + " B")
        await eventually(lambda: len(held[other].prompts) == 1)
        # C shares A's prefix and waits; where it goes depends on which replica frees first.
        c = send(gw, prefix + " C")
        await until_queued(gw, "realtime", 1)
        target = home if freed == "home" else other
        held[target].finish()
        await eventually(lambda: arrived(held) == 3)
        assert held[target].prompts[-1].endswith(" C")
        held[target].finish()
        reply = await c
        assert reply.headers["x-gateway-replica"] == target
        if freed == "home":
            assert reply.headers["x-gateway-route-reason"] == "affinity"
        held[home if freed == "other" else other].finish()
        assert {(await a).headers["x-gateway-replica"], (await b).headers[
            "x-gateway-replica"]} == {home, other}
        await assert_all_returned(gw)


async def test_realtime_is_served_before_batch_when_both_wait_for_one_pool() -> None:
    held = holding("rt-0", "bt-0")
    config = admission_config()
    config["traffic_classes"][1]["pool"] = "realtime"  # both classes share one replica
    config["traffic_classes"].reverse()  # rank decides, not the order they are listed in
    async with gateway(config, handlers=held) as gw:
        rt = held["rt-0"]
        tasks = [send(gw, "batch 0", cls="batch")]
        await eventually(lambda: rt.prompts == ["batch 0"])
        tasks += [send(gw, f"batch {i}", cls="batch") for i in (1, 2)]
        await until_queued(gw, "batch", 2)
        tasks.append(send(gw, "realtime 1"))
        await until_queued(gw, "realtime", 1)
        for n in (2, 3, 4):
            rt.finish()
            await eventually(lambda n=n: len(rt.prompts) == n)
        rt.finish()
        assert rt.prompts == ["batch 0", "realtime 1", "batch 1", "batch 2"]
        assert [t.status_code for t in await asyncio.gather(*tasks)] == [200] * 4
        await assert_all_returned(gw)


async def test_at_equal_rank_a_freed_slot_goes_to_the_pools_own_class_first() -> None:
    held = holding("rt-0", "bt-0")
    config = admission_config(reserved=0.0, batch={"borrow": [
        {"pool": "realtime", "while_below": 1.0}]})
    config["traffic_classes"][0]["priority"] = 0  # the same rank as batch
    config["traffic_classes"].reverse()  # the borrower listed first: ownership decides
    async with gateway(config, handlers=held) as gw:
        tasks = [send(gw, "realtime 0"), send(gw, "batch 0", cls="batch")]
        await eventually(lambda: arrived(held) == 2)
        tasks.append(send(gw, "batch 1", cls="batch"))  # waits for either pool
        await until_queued(gw, "batch", 1)
        tasks.append(send(gw, "realtime 1"))
        await until_queued(gw, "realtime", 1)
        held["rt-0"].finish()  # the realtime pool's slot: its own class first
        await eventually(lambda: len(held["rt-0"].prompts) == 2)
        assert held["rt-0"].prompts == ["realtime 0", "realtime 1"]
        held["rt-0"].finish()  # now idle: the batch class may borrow it
        await eventually(lambda: len(held["rt-0"].prompts) == 3)
        assert held["rt-0"].prompts[-1] == "batch 1"
        held["rt-0"].finish()
        held["bt-0"].finish()
        replies = await asyncio.gather(*tasks)
        assert replies[2].headers["x-gateway-pool"] == "realtime"
        await assert_all_returned(gw)


@pytest.mark.parametrize(("while_below", "reserved", "lent"), [
    (0.5, 0.25, 2),   # the threshold stops it: 2 of 4 slots busy is a load of 0.5
    (1.0, 0.5, 2),    # the reserved half stops it, though the pool is far from busy
    (1.0, 0.0, 4),    # nothing reserved, no threshold: the whole idle pool
])
async def test_a_class_borrows_below_the_threshold_and_never_the_reserved_share(
        while_below: float, reserved: float, lent: int) -> None:
    held = holding("rt-0", *(f"bt-{i}" for i in range(4)))
    config = admission_config(bt=4, reserved=reserved, realtime={"borrow": [
        {"pool": "batch", "while_below": while_below}]})
    async with gateway(config, handlers=held) as gw:
        tasks = [send(gw, "own")]
        await eventually(lambda: held["rt-0"].prompts == ["own"])
        for i in range(lent + 1):
            tasks.append(send(gw, f"extra {i}"))

            async def placed(i: int = i) -> bool:  # on a batch replica, or queued
                return arrived(held) + await queued(gw, "realtime") == i + 2

            await eventually(placed)
        assert arrived(held) == 1 + lent and await queued(gw, "realtime") == 1
        classes, pools = await admission(gw)
        assert classes["realtime"]["inflight_by_pool"] == {"realtime": 1, "batch": lent}
        assert pools["batch"]["borrowed_inflight"] == lent
        assert pools["batch"]["lendable"] == int(4 * (1 - reserved))
        samples = await gw.metrics()
        assert sample(samples, "gateway_borrowed_total", traffic_class="realtime",
                      pool="batch") == lent
        assert sample(samples, "gateway_admission_inflight", traffic_class="realtime",
                      pool="batch") == lent
        for h in held.values():
            while h.waiting:
                h.finish()
        await eventually(lambda: arrived(held) == 2 + lent)  # the queued one got a slot
        for h in held.values():
            while h.waiting:
                h.finish()
        replies = await asyncio.gather(*tasks)
        assert sum(r.headers["x-gateway-pool"] == "batch" for r in replies) >= lent
        await assert_all_returned(gw)


@pytest.mark.parametrize("max_queue", [0, 8])
async def test_borrowed_work_is_refused_or_queued_first_when_the_owners_load_rises(
        max_queue: int) -> None:
    held = holding("rt-0", *(f"bt-{i}" for i in range(4)))
    config = admission_config(bt=4, realtime={"max_queue": max_queue, "borrow": [
        {"pool": "batch", "while_below": 0.5}]})
    async with gateway(config, handlers=held) as gw:
        tasks = [send(gw, "realtime 0"), send(gw, "realtime 1")]
        await eventually(lambda: arrived(held) == 2)  # its own slot, and one borrowed (load 1/4)
        tasks.append(send(gw, "batch 0", cls="batch"))
        await eventually(lambda: arrived(held) == 3)  # the batch pool's load is now 2/4
        late = post(gw, "realtime 2")
        if max_queue == 0:
            r = await late
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        else:
            await until_queued(gw, "realtime", 1)
        # The pool's own class still gets every free slot, realtime's rank notwithstanding.
        tasks += [send(gw, f"batch {i}", cls="batch") for i in (1, 2)]
        await eventually(lambda: arrived(held) == 5)
        tasks.append(send(gw, "batch 3", cls="batch"))
        await until_queued(gw, "batch", 1)
        first_batch = next(h for n, h in held.items() if h.prompts == ["batch 0"])
        first_batch.finish()  # a batch slot frees at a load of 3/4: batch's, not a borrower's
        await eventually(lambda: any(h.prompts[-1:] == ["batch 3"] for h in held.values()))
        assert await queued(gw, "realtime") == (0 if max_queue == 0 else 1)
        for name in ("batch 1", "batch 2"):
            next(h for h in held.values() if h.prompts[-1:] == [name]).finish()

        async def batch_load(n: int) -> bool:
            return (await admission(gw))[1]["batch"]["inflight"] == n

        await eventually(lambda: batch_load(2))  # realtime 1 and batch 3: still not below 0.5
        assert await queued(gw, "realtime") == (0 if max_queue == 0 else 1)
        next(h for h in held.values() if h.prompts[-1:] == ["batch 3"]).finish()
        if max_queue:
            await eventually(lambda: arrived(held) == 7)  # at 1/4, realtime 2 may borrow
            r = await asyncio.wait_for(_finish_all_then(held, late), 10)
            assert r.status_code == 200
        for h in held.values():
            while h.waiting:
                h.finish()
        await asyncio.gather(*tasks)
        await assert_all_returned(gw)


async def _finish_all_then(held: dict[str, Held], task: asyncio.Task) -> Any:
    for h in held.values():
        while h.waiting:
            h.finish()
    return await task


# Priorities -----------------------------------------------------------------------------------


async def test_priorities_order_a_class_queue() -> None:
    held = holding("rt-0", "bt-0")
    config = admission_config(priority_header="x-priority", priority_api_keys={"sk-vip": 5},
                              priority_min=-3, priority_max=8)
    async with gateway(config, handlers=held) as gw:
        rt = held["rt-0"]
        tasks = [send(gw, "first")]
        await eventually(lambda: rt.prompts == ["first"])
        order = [("plain 0", {}, {}), ("header 3", {"x-priority": "3"}, {}),
                 ("vip key", {}, {"api_key": "sk-vip"}),
                 ("header 3 again", {"x-priority": "3"}, {}),
                 ("clamped to 8", {"x-priority": "99"}, {}),
                 ("vip lowered", {"x-priority": "-2"}, {"api_key": "sk-vip"}),
                 ("plain 1", {}, {})]
        for i, (prompt, headers, client) in enumerate(order):
            tasks.append(send(gw, prompt, headers=headers, **client))
            await until_queued(gw, "realtime", i + 1)
        r = await gw.http.post("/v1/completions", headers={"x-priority": "high"},
                               json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_priority"
        for n in range(2, len(order) + 2):
            rt.finish()
            await eventually(lambda n=n: len(rt.prompts) == n)
        rt.finish()
        assert rt.prompts[1:] == ["clamped to 8", "vip key", "header 3", "header 3 again",
                                  "plain 0", "plain 1", "vip lowered"]
        await asyncio.gather(*tasks)
        await assert_all_returned(gw)


# Disconnects, cancellations, streams: nothing leaks ----------------------------------------------


def body(prompt: str, stream: bool = False) -> bytes:
    return orjson.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2, "stream": stream})


async def test_a_client_that_leaves_while_queued_frees_its_place() -> None:
    held = holding("rt-0", "bt-0")
    async with gateway(admission_config(realtime={"max_queue": 1}), handlers=held) as gw:
        first = send(gw, "first")
        await eventually(lambda: held["rt-0"].prompts == ["first"])
        leave = asyncio.Event()
        leaving = asyncio.create_task(asgi_request(gw.app, "/v1/completions", body("gone"),
                                                   leave))
        await until_queued(gw, "realtime", 1)
        leave.set()
        assert await asyncio.wait_for(leaving, 10) == []  # nothing sent to a client gone
        assert await queued(gw, "realtime") == 0
        # Its place is free: the next request queues (max_queue is 1) and is served next.
        after = send(gw, "after")
        await until_queued(gw, "realtime", 1)
        held["rt-0"].finish()
        await eventually(lambda: held["rt-0"].prompts == ["first", "after"])
        held["rt-0"].finish()
        assert [r.status_code for r in await asyncio.gather(first, after)] == [200, 200]
        samples = await gw.metrics()
        assert sample(samples, "gateway_requests_total", replica="none", status="499") == 1
        assert sample(samples, "gateway_admission_rejected_total") == 0
        await assert_all_returned(gw)


async def test_a_stream_holds_its_slot_until_its_body_is_closed() -> None:
    held = holding("rt-0", "bt-0")
    async with gateway(admission_config(), handlers=held) as gw:
        leave = asyncio.Event()
        sent: list[dict] = []
        streaming = asyncio.create_task(asgi_request(gw.app, "/v1/completions",
                                                     body("stream", stream=True), leave))
        await eventually(lambda: held["rt-0"].prompts == ["stream"])
        # The client has its headers (and the first event) and the slot is still held.
        nxt = send(gw, "next")
        await until_queued(gw, "realtime", 1)
        assert held["rt-0"].prompts == ["stream"]
        leave.set()  # the client leaves mid-stream: the stream closes, its slot frees
        sent = await asyncio.wait_for(streaming, 10)
        assert sent[0]["status"] == 200 and b"first" in sent[1]["body"]
        await eventually(lambda: held["rt-0"].prompts == ["stream", "next"])
        held["rt-0"].finish()
        assert (await nxt).status_code == 200
        # A stream read to its end releases its slot too.
        done = send(gw, "whole stream", stream=True)
        await eventually(lambda: len(held["rt-0"].prompts) == 3)
        held["rt-0"].finish()
        assert "".join(ch.choices[0].text for ch in (await done).chunks) == "first last"
        await assert_all_returned(gw)


async def test_slots_and_queues_all_return_to_zero_after_everything() -> None:
    held = holding("rt-0", "bt-0", "bt-1")
    config = admission_config(bt=2, reserved=0.5, realtime={
        "max_queue": 3, "borrow": [{"pool": "batch", "while_below": 1.0}]})
    async with gateway(config, handlers=held) as gw:
        rt = held["rt-0"]
        ok = [send(gw, "own"), send(gw, "borrowed", stream=True)]  # rt-0, then one batch slot
        await eventually(lambda: arrived(held) == 2)
        lent_to = next(n for n in ("bt-0", "bt-1") if held[n].prompts)
        broken = post(gw, "broken")  # queued; its stream will break (a 502)
        await until_queued(gw, "realtime", 1)
        leave = asyncio.Event()
        gone = asyncio.create_task(asgi_request(gw.app, "/v1/completions", body("gone"), leave))
        cancelled = post(gw, "cancelled")
        await until_queued(gw, "realtime", 3)
        r = await gw.http.post("/v1/completions", json={"model": "tiny", "prompt": "refused"})
        assert r.status_code == 429
        leave.set()  # leaves the queue
        assert await asyncio.wait_for(gone, 10) == []
        cancelled.cancel()  # cancelled in the queue, as a server shutting down does
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        await until_queued(gw, "realtime", 1)
        rt.finish()  # "own" done: "broken" gets the slot
        await eventually(lambda: rt.prompts == ["own", "broken"])
        rt.finish(ok=False)
        assert (await broken).status_code == 502
        held[lent_to].finish()
        replies = await asyncio.gather(*ok)
        assert [r.status_code for r in replies] == [200, 200]
        assert replies[1].headers["x-gateway-pool"] == "batch"
        # A batch request that breaks mid-stream, and a core call cancelled while it streams.
        bstream = send(gw, "batch stream", cls="batch", stream=True)
        await eventually(lambda: arrived(held) == 4)
        next(h for h in held.values() if h.waiting).finish(ok=False)
        with pytest.raises(openai.APIError, match="mid-stream"):
            await bstream
        core_call = asyncio.create_task(gw.app.core.handle(core_request("core", "batch")))
        await eventually(lambda: arrived(held) == 5)
        core_call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await core_call
        await assert_all_returned(gw)


# Without HTTP, without admission -----------------------------------------------------------------


def core_request(prompt: str, cls: str | None = None, priority: int | None = None
                 ) -> InferenceRequest:
    raw = body(prompt)
    payload, model, stream = parse_body(raw, chat=False)
    return InferenceRequest("/v1/completions", False, payload, raw, model, stream,
                            traffic_class=cls, priority=priority)


async def test_the_request_core_admits_requests_that_come_without_http() -> None:
    held = holding("rt-0", "bt-0")
    async with gateway(admission_config(), handlers=held) as gw:
        core = gw.app.core
        calls = [asyncio.create_task(core.handle(core_request("line 0", "batch")))]
        await eventually(lambda: held["bt-0"].prompts == ["line 0"])
        calls += [asyncio.create_task(core.handle(core_request(f"line {i}", "batch", i)))
                  for i in (1, 2)]
        await until_queued(gw, "batch", 2)
        for n in (2, 3):
            held["bt-0"].finish()
            await eventually(lambda n=n: len(held["bt-0"].prompts) == n)
        held["bt-0"].finish()
        assert held["bt-0"].prompts == ["line 0", "line 2", "line 1"]  # priority 2 first
        replies = await asyncio.gather(*calls)
        assert [r.status for r in replies] == [200, 200, 200]
        await assert_all_returned(gw)


async def test_without_admission_settings_nothing_waits_and_nothing_is_exported() -> None:
    held = holding("rt-0", "bt-0")
    async with gateway(two_pools(realtime=1, batch=1), handlers=held) as gw:
        tasks = [send(gw, f"r{i}") for i in range(6)]
        await eventually(lambda: len(held["rt-0"].prompts) == 6)  # all forwarded at once
        while held["rt-0"].waiting:
            held["rt-0"].finish()
        assert [r.status_code for r in await asyncio.gather(*tasks)] == [200] * 6
        assert (await gw.stats())["admission"] == {"classes": [], "pools": []}
        samples = await gw.metrics()
        assert not [s for s in samples if s.name.startswith(("gateway_queue",
                                                             "gateway_admission"))]
        assert "admission" not in render_table(await gw.stats())


# Visible everywhere ------------------------------------------------------------------------------


async def test_metrics_stats_and_the_table_show_admission() -> None:
    held = holding("rt-0", "bt-0", "bt-1")
    config = admission_config(bt=2, realtime={"max_inflight": 2, "max_queue": 1, "borrow": [
        {"pool": "batch", "while_below": 1.0}]})
    async with gateway(config, handlers=held) as gw:
        tasks = [send(gw, "own"), send(gw, "borrowed")]
        await eventually(lambda: arrived(held) == 2)
        tasks.append(send(gw, "waits"))  # the class limit (2) holds it, though batch has room
        await until_queued(gw, "realtime", 1)
        r = await gw.http.post("/v1/completions", json={"model": "tiny", "prompt": "refused"})
        assert r.status_code == 429
        stats = await gw.stats()
        classes = {c["name"]: c for c in stats["admission"]["classes"]}
        pools = {p["name"]: p for p in stats["admission"]["pools"]}
        rt = classes["realtime"]
        assert (rt["queued"], rt["inflight"], rt["max_inflight"], rt["max_queue"]) == (1, 2, 2, 1)
        assert rt["inflight_by_pool"] == {"realtime": 1, "batch": 1}
        assert rt["rejected"] == {"queue_full": 1} and rt["borrowed"] == {"batch": 1}
        assert rt["borrow"] == [{"pool": "batch", "while_below": 1.0}]
        assert rt["priority"] == 10 and rt["pool"] == "realtime"
        assert pools["batch"] == {
            "name": "batch", "max_inflight_per_replica": 1, "capacity": 2, "inflight": 1,
            "borrowed_inflight": 1, "load_fraction": 0.5, "reserved_fraction": 0.25,
            "lendable": 1}
        assert pools["realtime"]["load_fraction"] == 1.0
        samples = await gw.metrics()
        assert sample(samples, "gateway_queue_depth", traffic_class="realtime") == 1
        assert sample(samples, "gateway_queue_depth", traffic_class="batch") == 0
        assert sample(samples, "gateway_admission_inflight", traffic_class="realtime") == 2
        assert sample(samples, "gateway_admission_capacity", pool="batch") == 2
        assert sample(samples, "gateway_admission_rejected_total", traffic_class="realtime",
                      reason="queue_full") == 1
        assert sample(samples, "gateway_borrowed_total", pool="batch") == 1
        table = render_table(stats)
        by_class, by_pool = ({line.split()[0]: line.split() for line in part.splitlines()}
                             for part in table.split("admission\n", 1)[1].split("\n\n"))
        assert by_class["class"][:5] == ["class", "pool", "priority", "queued", "inflight"]
        assert by_class["realtime"][:6] == ["realtime", "realtime", "10", "1",
                                            "batch=1,realtime=1", "2"]
        assert by_class["realtime"][-2:] == ["queue_full=1", "batch=1"]
        assert by_pool["pool"][:4] == ["pool", "per_replica", "capacity", "inflight"]
        assert by_pool["batch"] == ["batch", "1", "2", "1", "1", "50.0%", "25.0%"]
        for h in held.values():
            while h.waiting:
                h.finish()
        await eventually(lambda: arrived(held) == 3)
        for h in held.values():
            while h.waiting:
                h.finish()
        await asyncio.gather(*tasks)
        samples = await gw.metrics()
        assert sample(samples, "gateway_queue_wait_seconds_count", traffic_class="realtime") == 3
        await assert_all_returned(gw)
