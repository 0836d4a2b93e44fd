"""The gateway times engine steps and learns the prefill rate from a replica's stream over HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest

from backends.sim.profiles import PROFILES
from gateway import processes
from gateway.defaults import one_pool_config
from tests.conftest import start_gateway, start_sims, streaming_meanwhile

PROFILE = "llama-8b-h200"


@contextmanager
def fast_and_slow_fleet(tmp_path, engine: str = "vllm", extra: tuple[str, ...] = (),
                        health: dict | None = None
                        ) -> Iterator[tuple[list[str], str, openai.OpenAI]]:
    """Two simulated replicas, the second four times slower at everything, behind a gateway:
    (the replicas' URLs, fast first; the gateway's URL; a client of it)."""
    sims = start_sims([engine, engine], tmp_path, time_scale=[1.0, 4.0], profile=PROFILE,
                      extra=extra)
    try:
        gw = start_gateway(one_pool_config(sims.urls, processes.free_ports(1)[0], engine=engine,
                                           models=("tiny",), health=health), tmp_path)
        try:
            yield sims.urls, gw.url, openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-test",
                                                   max_retries=0)
        finally:
            gw.stop()
    finally:
        sims.stop()


def fast_and_slow(replicas: list[dict], urls: list[str]) -> tuple[dict, dict]:
    """The fast and the slow replica's entries of /admin/stats."""
    fast, slow = (next(r for r in replicas if r["url"].startswith(url)) for url in urls)
    return fast, slow


def test_prefill_rate_is_learned_over_http(tmp_path) -> None:
    # One simulated replica in real time, so its steps last as long as the profile says: a
    # decode step of about 20 ms, a 1,000-token prefill about 27 ms more.
    sims = start_sims(["vllm"], tmp_path, time_scale=1.0, profile=PROFILE)
    try:
        gw = start_gateway(one_pool_config(sims.urls, processes.free_ports(1)[0], models=("tiny",),
                                           health={"metrics_interval_s": 0.2}), tmp_path)
        try:
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-test", max_retries=0)
            with streaming_meanwhile(client):
                # Until the rate is learned (20 samples, about one per request), or 80 sent.
                for i in range(80):
                    prompt = f"request {i}: " + "fresh words that nobody cached before " * 100
                    # Streamed: its first token ends its prefill step (a non-streaming
                    # request is passed through whole by default).
                    list(client.completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                                   stream=True))
                    if i >= 19:
                        stats = httpx.get(gw.url + "/admin/stats").json()
                        if stats["pools"][0]["prefill_tokens_per_s"]:
                            break
        finally:
            gw.stop()
    finally:
        sims.stop()
    pool = stats["pools"][0]
    assert pool["prefill_rate_learned"] is True
    rate = pool["prefill_tokens_per_s"]
    assert rate, pool
    # Hidden work can only lengthen a step, and timing noise moves the rate a few percent: it
    # must never land far above the engine's, the side where the step wait outweighs hits.
    assert rate < 1.5 * PROFILES[PROFILE].prefill_tokens_per_s, rate
    assert pool["replicas"][0]["engine_step_s"] > 0
    # The replica's own rate, learned from the same steps; alone, it is the median replica.
    own = pool["replicas"][0]["prefill_tokens_per_s"]
    assert own and own < 1.5 * PROFILES[PROFILE].prefill_tokens_per_s, own
    assert pool["replicas"][0]["speed"] == 1.0


def test_a_mixed_fleets_speeds_are_known_once_each_replica_served_one_cold_prompt(
        tmp_path) -> None:
    # Two simulated replicas, the second four times slower at everything. Each request is a
    # cold prompt of about 2,000 tokens, streamed through the chat API (a role chunk before
    # the first token), sent only once the one before has finished: every replica is idle
    # when a request reaches it. Timed from dispatch to first token, one such request is the
    # replica's prefill whole, and gives its own rate; from engine steps alone it took five.
    with fast_and_slow_fleet(tmp_path) as (urls, gw_url, client):
        for i in range(10):  # until both replicas have served one
            words = f"conversation {i} opens with words nobody cached before " * 150
            list(client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": words}],
                max_tokens=2, stream=True))
            replicas = httpx.get(gw_url + "/admin/stats").json()["pools"][0]["replicas"]
            if all(r["requests"] for r in replicas):
                break
    fast, slow = fast_and_slow(replicas, urls)
    assert fast["requests"] and slow["requests"], replicas
    assert fast["prefill_tokens_per_s"] and slow["prefill_tokens_per_s"], replicas
    assert slow["speed"] < 1.0 < fast["speed"], replicas


@pytest.mark.parametrize(("engine", "extra"), [
    ("vllm", ()),
    # trtllm-serve as it starts by default: JSON iteration stats only, each engine step's
    # latency and context tokens.
    ("trtllm", ()),
    # With return_perf_metrics: /prometheus/metrics too (its per-request prefill histogram);
    # the iteration stats still time the steps.
    ("trtllm", ("--trtllm-perf-metrics",)),
])
def test_without_streaming_a_mixed_fleets_speeds_come_from_the_engines_metrics(
        tmp_path, engine, extra) -> None:
    # Two simulated replicas, the second four times slower at everything, and only
    # non-streaming requests, passed through whole (the default): the gateway sees no chunk
    # and no first token, so it times no engine step. The engines' metrics (prompt tokens
    # computed, seconds in prefill) still tell the two apart.
    with fast_and_slow_fleet(tmp_path, engine, extra, {"metrics_interval_s": 0.2}) as (
            urls, gw_url, client):

        def ask(i: int) -> None:
            words = f"question {i} is asked in words nobody cached before " * 120
            client.completions.create(model="tiny", prompt=words, max_tokens=2)

        with ThreadPoolExecutor(4) as pool:
            # Until both engines' rates are known, or 400 requests sent.
            for batch in range(50):
                list(pool.map(ask, range(8 * batch, 8 * batch + 8)))
                replicas = httpx.get(gw_url + "/admin/stats").json()["pools"][0]["replicas"]
                if all(r["engine_prefill_tokens_per_s"] for r in replicas):
                    break
    fast, slow = fast_and_slow(replicas, urls)
    assert fast["engine_prefill_tokens_per_s"] and slow["engine_prefill_tokens_per_s"], replicas
    # Nothing was timed from a stream: the speeds are the engines'.
    assert fast["prefill_tokens_per_s"] is None and slow["prefill_tokens_per_s"] is None
    assert fast["engine_prefill_tokens_per_s"] > 2 * slow["engine_prefill_tokens_per_s"]
    assert slow["speed"] < 1.0 < fast["speed"], replicas
