"""The /admin page's memory: per-interval samples in a fixed ring, and the latest routing
decisions, as /admin/history returns them."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, parse_config
from gateway.history import quantile
from gateway.metrics import TTFT_BUCKETS
from tests.conftest import eventually, tenant_prompt
from tests.inprocess import gateway, two_pools

BOUNDS = (*TTFT_BUCKETS, float("inf"))


def test_quantiles_interpolate_within_their_bucket_as_prometheus_does() -> None:
    counts = [0.0] * (len(BOUNDS) + 1)
    assert quantile(BOUNDS, counts, 0.5) is None
    counts[1] = 10  # ten between 5 and 10 ms
    assert quantile(BOUNDS, counts, 0.5) == 0.0075
    assert quantile(BOUNDS, counts, 1.0) == 0.01
    counts[len(BOUNDS) - 1] = 90  # ninety above the last finite bound (80 s)
    assert quantile(BOUNDS, counts, 0.05) == 0.0075
    assert quantile(BOUNDS, counts, 0.95) == 80.0  # that bound, as histogram_quantile


def test_the_ring_size_is_bounded_by_the_config() -> None:
    base = two_pools(realtime=1, batch=1)
    assert parse_config(base).history.samples == 180  # 15 minutes of 5 s
    for bad in ({"interval_s": 10, "window_s": 10}, {"interval_s": 0.1, "window_s": 86400},
                {"interval_s": 0.01}, {"decisions": -1}):
        with pytest.raises(ConfigError):
            parse_config({**base, "history": bad})


async def test_samples_count_what_happened_in_their_interval() -> None:
    config = two_pools(realtime=3, batch=1)
    config["history"] = {"interval_s": 3600, "window_s": 3 * 3600, "decisions": 4}
    async with gateway(config) as gw:
        history = gw.app.state.history
        c = gw.openai()
        reasons = []
        for i in range(6):
            r = await c.chat.completions.with_raw_response.create(
                model="tiny", max_tokens=4, stream=i % 2 == 0,
                messages=[{"role": "system", "content": tenant_prompt(i % 2)},
                          {"role": "user", "content": f"q{i}"}])
            if i % 2 == 0:
                [_ async for _ in r.parse()]  # read the stream to its end
            reasons.append((r.headers["x-gateway-replica"], r.headers["x-gateway-route-reason"]))
        first = history.sample()
        rt = next(p for p in first["pools"] if p["name"] == "realtime")
        assert rt["requests"] == 6 and rt["errors"] == 0
        assert rt["requests_per_s"] > 0
        assert rt["ttft_p50_s"] is not None and rt["ttft_p95_s"] >= rt["ttft_p50_s"]
        # Tenant prompts repeat: the second of each tenant hits.
        assert 0 < rt["estimated_hit_ratio"] < 1
        by_reason: dict[str, int] = {}
        for _, reason in reasons:
            by_reason[reason] = by_reason.get(reason, 0) + 1
        assert rt["decisions_by_reason"] == by_reason
        routed = {r["name"]: r["routed"] for r in rt["replicas"]}
        for name, n in routed.items():
            assert n == sum(1 for rep, _ in reasons if rep == name)
        shares = [r["load_share"] for r in rt["replicas"] if r["routed"]]
        assert sum(shares) == pytest.approx(1.0, abs=1e-3)
        assert sum(r["requests"] for r in rt["replicas"]) == 6
        bt = next(p for p in first["pools"] if p["name"] == "batch")
        assert bt["requests"] == 0 and bt["ttft_p50_s"] is None
        assert bt["replicas"][0]["load_share"] is None

        # The next sample has only what came after the first.
        await c.completions.create(model="tiny", prompt=tenant_prompt(9), max_tokens=2,
                                   extra_headers={"x-traffic-class": "batch"})
        second = history.sample()
        rt2, bt2 = second["pools"]
        assert rt2["requests"] == 0 and rt2["decisions_by_reason"] == {}
        assert rt2["estimated_hit_ratio"] is None
        assert bt2["requests"] == 1 and bt2["replicas"][0]["load_share"] == 1.0

        # /admin/history: the samples, and the latest decisions (at most 4), newest first.
        body = (await gw.http.get("/admin/history")).json()
        assert [s["t"] for s in body["samples"]] == [first["t"], second["t"]]
        assert body["interval_s"] == 3600 and body["max_samples"] == 3
        latest = body["recent_decisions"]
        assert len(latest) == 4
        assert latest[0]["pool"] == "batch" and latest[0]["traffic_class"] == "batch"
        assert [(d["replica"], d["reason"]) for d in latest[1:]] == reasons[::-1][:3]
        assert all(0 <= d["matched_fraction"] <= 1 and d["total_blocks"] > 0 for d in latest)
        assert [d["t"] for d in latest] == sorted((d["t"] for d in latest), reverse=True)
        since = (await gw.http.get("/admin/history", params={"since": first["t"]})).json()
        assert [s["t"] for s in since["samples"]] == [second["t"]]

        # The ring keeps the newest `window_s / interval_s` samples.
        for _ in range(5):
            history.sample()
        assert len(history.samples) == 3 and history.samples[0]["t"] >= second["t"]


async def test_the_sampler_runs_by_itself_every_interval() -> None:
    config = two_pools(realtime=1, batch=1)
    config["history"] = {"interval_s": 0.1, "window_s": 0.5}
    async with gateway(config) as gw:
        await gw.openai().completions.create(model="tiny", prompt="x", max_tokens=2)

        async def counted() -> bool:
            samples = (await gw.http.get("/admin/history")).json()["samples"]
            return len(samples) == 5 and sum(p["requests"] for s in samples
                                             for p in s["pools"]) == 1

        # Five samples kept, and the request in exactly one of them, once older ones have gone
        # (the request may fall out of the window: wait for a moment it is in).
        await eventually(counted, deadline_s=20)
