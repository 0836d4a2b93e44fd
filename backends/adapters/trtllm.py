"""TensorRT-LLM `trtllm-serve`: JSON iteration stats at /metrics, Prometheus only if enabled.

Surface as read from TensorRT-LLM's source (serve/openai_server.py @0005772, metrics/collector.py
@050f80d, and the older 1.1.0rc5 collector @89fd9b7); never run against a real TensorRT-LLM here
(it needs an NVIDIA GPU). /metrics drains the iteration-stats queue: each call returns only the
iterations since the previous call, so the newest entry is the current state.
"""

from __future__ import annotations

import orjson

from backends.adapters.base import EngineAdapter, EngineSnapshot
from backends.adapters.promtext import check_page, counter_sum, scan_samples, with_totals
from backends.upstream import Upstream, fetch_text

_PROM_PATH = "/prometheus/metrics"
_JSON_PATH = "/metrics"


def _num(d: dict, *keys: str) -> float | None:
    for k in keys:
        v = d.get(k)
        if isinstance(v, int | float):
            return float(v)
    return None


def parse_iteration_stats(payload: object) -> EngineSnapshot | None:
    """Normalise trtllm-serve's /metrics JSON (a list of per-iteration stats)."""
    if isinstance(payload, dict):
        payload = [payload]
    if not isinstance(payload, list):
        return None
    if not payload:
        # No iteration since the last poll: the executor was idle.
        return EngineSnapshot(running=0.0, waiting=0.0, source="trtllm:iteration-stats")
    it = payload[-1]
    if not isinstance(it, dict):
        return None
    kv = it.get("kvCacheStats") or {}
    ifb = it.get("inflightBatchingStats") or {}
    running = _num(it, "numActiveRequests")
    waiting = _num(it, "numQueuedRequests")
    if waiting is None:
        waiting = _num(ifb, "numPausedRequests")
    latency_ms = _num(it, "iterLatencyMS")
    max_blocks = _num(kv, "maxNumBlocks")
    used = _num(kv, "usedNumBlocks")
    per_block = _num(kv, "tokensPerBlock")
    reused = _num(kv, "reusedBlocks")
    missed = _num(kv, "missedBlocks")
    hits = queries = None
    if reused is not None and missed is not None and per_block:
        hits = reused * per_block
        queries = (reused + missed) * per_block
    return EngineSnapshot(
        running=running,
        waiting=waiting,
        prefills_waiting=_prefills_waiting(it, ifb),
        prefills_waiting_lag_s=latency_ms / 1000.0 if latency_ms is not None else None,
        kv_usage=(used / max_blocks) if used is not None and max_blocks else None,
        prefix_hit_tokens=hits,
        prefix_query_tokens=queries,
        block_size=int(per_block) if per_block else None,
        num_blocks=int(max_blocks) if max_blocks else None,
        source="trtllm:iteration-stats",
    )


def _prefills_waiting(it: dict, ifb: dict) -> float | None:
    """Requests not yet past their first token after an iteration: those queued at its end,
    and those active at its start that were not generating (scheduled for context, waiting
    to be, or not yet admitted): `numQueuedRequests + numActiveRequests - numGenRequests -
    numPausedRequests`. The executor counts its active requests as the iteration begins, so
    the context requests that finish their prefill in it are counted too: an upper bound,
    which is all `LoadTracker.engine_prefills_waiting` asks."""
    queued, active = _num(it, "numQueuedRequests"), _num(it, "numActiveRequests")
    gen = _num(ifb, "numGenRequests")
    if queued is None or active is None or gen is None:
        return None
    return max(0.0, queued + active - gen - (_num(ifb, "numPausedRequests") or 0.0))


def iteration_prefill(payload: object) -> tuple[float, float, float] | None:
    """Of the iterations in one /metrics read that computed context (prompt) tokens: those
    tokens, the iterations' seconds, and the context requests they carried; None if the read
    has no iteration that says its latency and context tokens (older releases, or idle)."""
    if isinstance(payload, dict):
        payload = [payload]
    if not isinstance(payload, list):
        return None
    tokens = seconds = requests = 0.0
    timed = False
    for it in payload:
        if not isinstance(it, dict):
            continue
        ifb = it.get("inflightBatchingStats")
        latency_ms = _num(it, "iterLatencyMS")
        ctx = _num(ifb, "numCtxTokens") if isinstance(ifb, dict) else None
        if latency_ms is None or ctx is None:
            continue
        timed = True
        if ctx > 0 and latency_ms > 0:
            tokens += ctx
            seconds += latency_ms / 1000.0
            requests += _num(ifb, "numContextRequests") or 0.0
    return (tokens, seconds, requests) if timed else None


_TRTLLM_NAMES = ("kv_cache_tokens_per_block", "kv_cache_reused_blocks", "kv_cache_missed_blocks",
                 "prompt_cache_hit_tokens", "prompt_tokens", "kv_cache_max_blocks",
                 "num_requests_running", "num_requests_waiting", "kv_cache_utilization",
                 "request_prefill_time_seconds_sum", "request_prefill_time_seconds_count")
# What to scan for: the `trtllm_`-prefixed names, or the older bare ones.
_TRTLLM_READ = {prefix: with_totals(prefix + name for name in _TRTLLM_NAMES)
                for prefix in ("trtllm_", "")}


def parse_trtllm_prometheus(text: str) -> EngineSnapshot:
    """Normalise /prometheus/metrics; sniffs `trtllm_`-prefixed versus older bare names.
    Reads only the samples it uses (`scan_samples`); ValueError if it is not a Prometheus
    page."""
    check_page(text)
    prefixed = text.startswith("trtllm_") or "\ntrtllm_" in text
    p = "trtllm_" if prefixed else ""
    found = scan_samples(text, _TRTLLM_READ[p])

    def get(name: str) -> float | None:
        return counter_sum(found, p + name)

    per_block = get("kv_cache_tokens_per_block")
    reused, missed = get("kv_cache_reused_blocks"), get("kv_cache_missed_blocks")
    hits = queries = None
    if reused is not None and missed is not None and per_block:
        hits, queries = reused * per_block, (reused + missed) * per_block
    elif get("prompt_cache_hit_tokens") is not None and get("prompt_tokens") is not None:
        hits, queries = get("prompt_cache_hit_tokens"), get("prompt_tokens")
    max_blocks = get("kv_cache_max_blocks")
    prompt, cache_hits = get("prompt_tokens"), get("prompt_cache_hit_tokens")
    computed = prompt - cache_hits if prompt is not None and cache_hits is not None else None
    return EngineSnapshot(
        running=get("num_requests_running"),
        waiting=get("num_requests_waiting"),
        kv_usage=get("kv_cache_utilization"),
        prefix_hit_tokens=hits,
        prefix_query_tokens=queries,
        block_size=int(per_block) if per_block else None,
        num_blocks=int(max_blocks) if max_blocks else None,
        computed_prompt_tokens=computed,
        prefill_seconds=get("request_prefill_time_seconds_sum"),
        prefills=get("request_prefill_time_seconds_count"),
        source="trtllm:prometheus-" + ("trtllm_-names" if prefixed else "bare-names"),
    )


class TrtllmAdapter(EngineAdapter):
    kind = "trtllm"
    health_path = "/health"
    default_block_size = 32

    def __init__(self) -> None:
        # Per replica: whether /prometheus/metrics is mounted (only with return_perf_metrics).
        self._has_prometheus: dict[str, bool] = {}
        # Per replica whose iteration stats time their steps: the context tokens, seconds and
        # context requests of every iteration read so far that computed prompt tokens. Each
        # read drains the engine's queue, so the running sums are the counters.
        self._iterations: dict[str, list[float]] = {}

    def forget(self, base_url: str) -> None:
        # Replicas come and go under discovery: what is kept per URL must go with them.
        self._has_prometheus.pop(base_url, None)
        self._iterations.pop(base_url, None)

    async def scrape(
        self, upstream: Upstream, base_url: str, timeout: float
    ) -> EngineSnapshot | None:
        snap_prom: EngineSnapshot | None = None
        if self._has_prometheus.get(base_url, True):
            status, text = await fetch_text(upstream, base_url + _PROM_PATH, timeout)
            if status == 200 and text:
                try:
                    snap_prom = parse_trtllm_prometheus(text)
                except ValueError:
                    snap_prom = None
                self._has_prometheus[base_url] = snap_prom is not None
            elif status in (404, 405):
                self._has_prometheus[base_url] = False
        snap_json = await self._read_iterations(upstream, base_url, timeout)
        sums = self._iterations.get(base_url)
        if sums is not None and snap_prom is not None:
            snap_prom.computed_prompt_tokens, snap_prom.prefill_seconds, snap_prom.prefills = sums
        if snap_prom is None:
            return snap_json
        if snap_json is not None:
            # Prometheus has the counters; iteration stats have the freshest queue state.
            for field in ("running", "waiting", "kv_usage", "block_size", "num_blocks",
                          "prefills_waiting", "prefills_waiting_lag_s"):
                if getattr(snap_prom, field) is None:
                    setattr(snap_prom, field, getattr(snap_json, field))
        return snap_prom

    async def read_counts(
        self, upstream: Upstream, base_url: str, timeout: float
    ) -> EngineSnapshot | None:
        # The count of requests awaiting a first token is in the iteration stats alone: the
        # Prometheus page, fetched at every scrape, is not needed between them.
        return await self._read_iterations(upstream, base_url, timeout)

    async def _read_iterations(
        self, upstream: Upstream, base_url: str, timeout: float
    ) -> EngineSnapshot | None:
        """The iteration stats (/metrics), their prefill timings added to the running sums
        whichever read drained them."""
        status, text = await fetch_text(upstream, base_url + _JSON_PATH, timeout)
        snap = None
        if status == 200 and text:
            try:
                payload = orjson.loads(text)
            except orjson.JSONDecodeError:
                payload = None
            snap = parse_iteration_stats(payload)
            read = iteration_prefill(payload)
            if read is not None:
                sums = self._iterations.setdefault(base_url, [0.0, 0.0, 0.0])
                for i, v in enumerate(read):
                    sums[i] += v
        sums = self._iterations.get(base_url)
        if sums is not None and snap is not None:
            # Timed engine step by step, the prefill rate needs no per-request histogram (and
            # its error where prefills overlap): once seen, the source for this replica.
            snap.computed_prompt_tokens, snap.prefill_seconds, snap.prefills = sums
        return snap
