"""Engine adapters read real and simulated engine surfaces into one normalised snapshot."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from backends.adapters import Probe, TrtllmAdapter, VllmAdapter, adapter_for
from backends.adapters.trtllm import parse_iteration_stats, parse_trtllm_prometheus
from backends.adapters.vllm import parse_vllm_metrics
from backends.pool import ReplicaState
from backends.upstream.aiohttp_client import AiohttpUpstream
from tests.conftest import ROOT, start_sims

FIXTURES = ROOT / "tests" / "fixtures"


def test_real_vllm_cpu_metrics_page() -> None:
    snap = parse_vllm_metrics((FIXTURES / "vllm_metrics.txt").read_text())
    assert snap.source == "vllm:current-names"
    assert snap.prefix_query_tokens == 45232.0
    assert snap.prefix_hit_tokens == 28160.0
    assert snap.running == 0.0 and snap.waiting == 0.0
    # vllm-cpu 0.32.0 reports 512 blocks of 128 tokens in cache_config_info.
    assert (snap.block_size, snap.num_blocks) == (128, 512)
    assert snap.capacity_tokens == 65536


DEPRECATED = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m",engine="0"} 3.0
vllm:num_requests_running{model_name="m",engine="1"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m",engine="0"} 2.0
vllm:num_requests_waiting{model_name="m",engine="1"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m",engine="0"} 0.5
vllm:gpu_cache_usage_perc{model_name="m",engine="1"} 0.25
# TYPE vllm:gpu_prefix_cache_queries counter
vllm:gpu_prefix_cache_queries_total{model_name="m",engine="0"} 100.0
vllm:gpu_prefix_cache_queries_total{model_name="m",engine="1"} 300.0
# TYPE vllm:gpu_prefix_cache_hits counter
vllm:gpu_prefix_cache_hits_total{model_name="m",engine="0"} 50.0
vllm:gpu_prefix_cache_hits_total{model_name="m",engine="1"} 150.0
"""


def test_deprecated_vllm_names_and_data_parallel_engines() -> None:
    snap = parse_vllm_metrics(DEPRECATED)
    assert snap.source == "vllm:deprecated-names"
    assert snap.running == 4.0 and snap.waiting == 2.0
    assert snap.kv_usage == 0.375  # mean over the two engines
    assert (snap.prefix_hit_tokens, snap.prefix_query_tokens) == (200.0, 400.0)
    assert snap.capacity_tokens is None


def test_trtllm_iteration_stats_newest_entry_wins() -> None:
    stats = [
        {"iter": 1, "numActiveRequests": 9, "numQueuedRequests": 9,
         "kvCacheStats": {"maxNumBlocks": 100, "usedNumBlocks": 90, "tokensPerBlock": 32,
                          "reusedBlocks": 1, "missedBlocks": 1}},
        {"iter": 2, "numActiveRequests": 2, "numQueuedRequests": 1,
         "kvCacheStats": {"maxNumBlocks": 100, "usedNumBlocks": 25, "tokensPerBlock": 32,
                          "reusedBlocks": 30, "missedBlocks": 10}},
    ]
    snap = parse_iteration_stats(stats)
    assert (snap.running, snap.waiting, snap.kv_usage) == (2.0, 1.0, 0.25)
    assert (snap.prefix_hit_tokens, snap.prefix_query_tokens) == (960.0, 1280.0)
    assert (snap.block_size, snap.num_blocks) == (32, 100)
    idle = parse_iteration_stats([])
    assert (idle.running, idle.waiting, idle.prefix_hit_tokens) == (0.0, 0.0, None)


def test_trtllm_prometheus_names_are_sniffed() -> None:
    new = """\
# TYPE trtllm_num_requests_running gauge
trtllm_num_requests_running{model_name="undefined",engine_type="undefined"} 4.0
# TYPE trtllm_kv_cache_tokens_per_block gauge
trtllm_kv_cache_tokens_per_block{model_name="undefined",engine_type="undefined"} 32.0
# TYPE trtllm_kv_cache_reused_blocks counter
trtllm_kv_cache_reused_blocks_total{model_name="undefined",engine_type="undefined"} 3.0
# TYPE trtllm_kv_cache_missed_blocks counter
trtllm_kv_cache_missed_blocks_total{model_name="undefined",engine_type="undefined"} 1.0
"""
    snap = parse_trtllm_prometheus(new)
    assert snap.source == "trtllm:prometheus-trtllm_-names"
    assert snap.running == 4.0
    assert (snap.prefix_hit_tokens, snap.prefix_query_tokens) == (96.0, 128.0)
    old = """\
# TYPE request_success counter
request_success_total{model_name="undefined",engine_type="undefined",finished_reason="stop"} 7.0
"""
    legacy = parse_trtllm_prometheus(old)
    assert legacy.source == "trtllm:prometheus-bare-names"
    assert legacy.prefix_hit_tokens is None and legacy.running is None


def test_engine_hit_ratio_is_windowed_and_survives_resets() -> None:
    r = ReplicaState("p", "r", "http://x", {"m"}, None)
    from backends.adapters import EngineSnapshot
    r.observe_snapshot(EngineSnapshot(prefix_hit_tokens=0, prefix_query_tokens=0), 10, now=0)
    r.observe_snapshot(EngineSnapshot(prefix_hit_tokens=50, prefix_query_tokens=100), 10, now=5)
    assert r.engine_hit_ratio == 0.5
    r.observe_snapshot(EngineSnapshot(prefix_hit_tokens=150, prefix_query_tokens=200), 10, now=30)
    # Only the last window counts: (150-50)/(200-100).
    assert r.engine_hit_ratio == 1.0
    r.observe_snapshot(EngineSnapshot(prefix_hit_tokens=10, prefix_query_tokens=40), 10, now=31)
    assert r.engine_hit_ratio == 0.25  # counters reset: start over from the new values


def test_adapters_against_simulated_replicas(tmp_path) -> None:
    sims = start_sims(["vllm", "trtllm"], tmp_path)
    perf = start_sims(["trtllm"], tmp_path, extra=("--trtllm-perf-metrics",))

    async def run() -> None:
        upstream = AiohttpUpstream()
        async with aiohttp.ClientSession() as http:
            prompt = "shared prefix " * 300
            for url in (*sims.urls, *perf.urls):
                for _ in range(2):
                    async with http.post(url + "/v1/completions", data=orjson.dumps(
                            {"model": "tiny", "prompt": prompt, "max_tokens": 2})) as resp:
                        assert resp.status == 200
        vllm, trt = VllmAdapter(), TrtllmAdapter()
        try:
            assert await vllm.probe(upstream, sims.urls[0], 2) is Probe.OK
            assert await trt.probe(upstream, sims.urls[1], 2) is Probe.OK
            v = await vllm.scrape(upstream, sims.urls[0], 2)
            assert v.prefix_hit_tokens > 0 and v.block_size == 16
            t = await trt.scrape(upstream, sims.urls[1], 2)
            assert t.source == "trtllm:iteration-stats" and t.block_size == 32
            assert t.prefix_hit_tokens > 0
            p = await trt.scrape(upstream, perf.urls[0], 2)
            assert p.source == "trtllm:prometheus-trtllm_-names"
            assert p.prefix_hit_tokens > 0
            assert await vllm.probe(upstream, "http://127.0.0.1:9", 1) is Probe.DEAD
            tokens = await vllm.tokenize(upstream, sims.urls[0], {"model": "tiny",
                                         "prompt": "one two three"}, False, {})
            assert tokens and all(isinstance(t, int) for t in tokens)
            assert await trt.tokenize(upstream, sims.urls[1], {"model": "tiny",
                                      "prompt": "one two"}, False, {}) is None
        finally:
            await upstream.aclose()

    try:
        asyncio.run(run())
    finally:
        sims.stop()
        perf.stop()


def test_adapter_for_knows_only_real_engine_kinds() -> None:
    assert isinstance(adapter_for("vllm"), VllmAdapter)
    assert isinstance(adapter_for("trtllm"), TrtllmAdapter)
    with pytest.raises(ValueError, match="expected vllm or trtllm"):
        adapter_for("sim")
