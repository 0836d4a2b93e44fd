"""Rate limits per key and per class: the sliding window's arithmetic, 429s with Retry-After
through the official client, and one budget shared by two gateways through a real Redis."""

from __future__ import annotations

import math
from typing import Any

import openai
import pytest

from gateway.ratelimit import Budget, MemoryCounter, wait_s
from tests.inprocess import gateway, two_pools
from tests.test_auth import ALL, BT, RT, bearer, sample, with_auth


def test_the_sliding_window_weighs_the_previous_minute_by_what_is_left_of_it() -> None:
    # 10 per minute; the previous minute used 10, we are a quarter into this one: 7.5 of
    # them still count, so 2 more fit and a third does not.
    assert wait_s(10, 2, cur=0, prev=10, fraction=0.25) == 0
    wait = wait_s(10, 3, cur=0, prev=10, fraction=0.25)
    # 3 fit once the previous minute's share is 7: at fraction 0.3, 3 s from now.
    assert wait == pytest.approx(3.0)
    # This minute is full: only the next one holds it, once this one's share has decayed.
    assert wait_s(10, 1, cur=10, prev=0, fraction=0.5) == pytest.approx(30 + 6)
    # A request bigger than the whole budget never fits.
    assert math.isinf(wait_s(10, 11, cur=0, prev=0, fraction=0.0))


def test_a_refused_request_charges_no_budget() -> None:
    counter = MemoryCounter()
    key, cls = Budget("key:a:requests", 2, 1), Budget("class:c:requests", 100, 1)
    now = 120.0  # the start of a window
    assert counter.charge([key, cls], now) == (0.0, -1)
    assert counter.charge([key, cls], now) == (0.0, -1)
    wait, which = counter.charge([key, cls], now + 1)
    assert which == 0 and wait > 0
    # The class budget was not charged for the refused request.
    assert counter.counts[("class:c:requests", 2)] == 2


def limited(**limits: Any) -> dict[str, Any]:
    config = with_auth()
    config["auth"]["api_keys"][2]["limits"] = limits  # the key with both classes
    return config


async def test_a_keys_requests_per_minute_end_in_429_with_retry_after() -> None:
    async with gateway(limited(requests_per_minute=2)) as gw:
        c = gw.openai(api_key=ALL)
        for _ in range(2):
            await c.completions.create(model="tiny", prompt="x", max_tokens=2)
        with pytest.raises(openai.RateLimitError) as info:
            await c.completions.create(model="tiny", prompt="x", max_tokens=2)
        err = info.value
        assert err.code == "rate_limit_exceeded" and "'all'" in err.message
        retry = int(err.response.headers["retry-after"])
        assert 1 <= retry <= 120
        # Other keys have budgets of their own.
        await gw.openai(api_key=RT).completions.create(model="tiny", prompt="x", max_tokens=2)
        text = (await gw.http.get("/metrics", headers=bearer("sk-admin"))).text
        assert sample(text, "gateway_auth_rejected_total", surface="inference",
                      traffic_class="realtime", reason="rate_limited") == 1
        assert sample(text, "gateway_requests_total", replica="none", status="429") == 1


async def test_tokens_per_minute_count_the_prompt_and_max_tokens() -> None:
    async with gateway(limited(tokens_per_minute=1000)) as gw:
        c = gw.openai(api_key=ALL)
        # About 100 (prompt: bytes / 4) + 600 max_tokens: fits once, not twice.
        prompt = "word " * 80
        await c.completions.create(model="tiny", prompt=prompt, max_tokens=600)
        with pytest.raises(openai.RateLimitError) as info:
            await c.completions.create(model="tiny", prompt=prompt, max_tokens=600)
        assert "tokens per minute" in info.value.message
        # Bigger than the whole budget: refused, saying so.
        with pytest.raises(openai.RateLimitError) as info:
            await c.completions.create(model="tiny", prompt="x", max_tokens=5000)
        assert "Request too large" in info.value.message


async def test_a_class_budget_is_shared_by_every_client_of_the_class() -> None:
    config = with_auth()
    config["rate_limits"] = {"classes": {"batch": {"requests_per_minute": 3}}}
    async with gateway(config) as gw:
        for key in (BT, BT, ALL):
            await gw.openai(api_key=key, default_headers={"x-traffic-class": "batch"}) \
                .completions.create(model="tiny", prompt="x", max_tokens=2)
        with pytest.raises(openai.RateLimitError) as info:
            await gw.openai(api_key=ALL).completions.create(
                model="tiny", prompt="x", max_tokens=2, extra_body={"service_tier": "flex"})
        assert "traffic class 'batch'" in info.value.message
        # Realtime is not limited.
        await gw.openai(api_key=ALL).completions.create(model="tiny", prompt="x", max_tokens=2)


async def test_class_limits_apply_without_client_keys_too() -> None:
    config = two_pools(realtime=1, batch=1)
    config["rate_limits"] = {"classes": {"realtime": {"requests_per_minute": 1}}}
    async with gateway(config) as gw:
        r1 = await gw.http.post("/v1/completions", json={"model": "tiny", "prompt": "x",
                                                         "max_tokens": 2})
        r2 = await gw.http.post("/v1/completions", json={"model": "tiny", "prompt": "x",
                                                         "max_tokens": 2})
        assert r1.status_code == 200 and r2.status_code == 429
        assert r2.json()["error"]["type"] == "rate_limit_error" and r2.headers["retry-after"]


async def test_two_gateways_share_one_budget_in_redis(redis_server) -> None:
    redis = redis_server.config()
    config = limited(requests_per_minute=3)
    config["redis"] = redis
    async with gateway(config) as one, gateway({**config, "redis": redis}) as two:
        a, b = one.openai(api_key=ALL), two.openai(api_key=ALL)
        await a.completions.create(model="tiny", prompt="x", max_tokens=2)
        await b.completions.create(model="tiny", prompt="x", max_tokens=2)
        await a.completions.create(model="tiny", prompt="x", max_tokens=2)
        # Each gateway alone has seen at most 2 of the key's 3: only Redis knows it is spent.
        for c in (a, b):
            with pytest.raises(openai.RateLimitError) as info:
                await c.completions.create(model="tiny", prompt="x", max_tokens=2)
            assert int(info.value.response.headers["retry-after"]) >= 1
        # The in-memory counters never saw them: Redis held the budget.
        assert not one.app.state.limiter.memory.counts
        assert not two.app.state.limiter.memory.counts
