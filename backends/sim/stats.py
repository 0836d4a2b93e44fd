"""What the simulated engine counts: latency histograms, counters, per-step records, snapshots."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# vLLM's and trtllm-serve's default TTFT buckets (identical in both engines).
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# Both engines' request-latency buckets (end-to-end, queue time, prefill time).
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# vLLM's token-count buckets (1-2-5 up to the model's length: here, any prompt the sim takes).
TOKEN_BUCKETS: tuple[float, ...] = tuple(
    m * 10.0**e for e in range(7) for m in (1, 2, 5))
TPOT_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class Histogram:
    """Bucketed observations (non-cumulative counts; the last slot is +Inf)."""

    __slots__ = ("buckets", "count", "counts", "sum")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[int]:
        out, total = [], 0
        for n in self.counts:
            total += n
            out.append(total)
        return out


@dataclass(slots=True)
class Counters:
    """The engine's running totals, updated as requests are admitted, decoded and finished."""

    prompt_tokens: int = 0
    prompt_cached_tokens: int = 0
    generation_tokens: int = 0
    success: int = 0
    aborted: int = 0
    reused_blocks: int = 0
    missed_blocks: int = 0
    alloc_total_blocks: int = 0
    alloc_new_blocks: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    prefill_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    prefill_computed: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))


@dataclass(slots=True)
class IterationRecord:
    """One engine step, enough to render trtllm-serve's iteration stats."""

    iter: int
    start: float
    end: float
    num_active: int
    num_queued: int
    num_new_active: int
    num_completed: int
    num_context_requests: int
    num_gen_requests: int
    num_ctx_tokens: int
    used_blocks: int
    free_blocks: int
    max_blocks: int
    reused_blocks: int
    missed_blocks: int
    alloc_total_blocks: int
    alloc_new_blocks: int


@dataclass(slots=True)
class EngineStats:
    """Gauges and counters in the units the real engines export (tokens, not blocks)."""

    running: int
    waiting: int
    kv_usage: float
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    prompt_tokens: int
    prompt_cached_tokens: int
    generation_tokens: int
    request_success: int
    request_aborted: int
    ttft_bucket_counts: list[int]  # non-cumulative, one per TTFT_BUCKETS edge plus +Inf
    ttft_sum: float
    ttft_count: int
    prefill_time_sum: float  # scheduled to first token, as vLLM's request_prefill_time
    prefill_time_count: int
    pending_prefill_tokens: int
    prefills_waiting: int  # requests queued or prefilling: not yet past their first token
    capacity_blocks: int
    used_blocks: int
    free_blocks: int
    resident_blocks: int
    reused_blocks: int
    missed_blocks: int
    alloc_total_blocks: int
    alloc_new_blocks: int
    iterations: int
    preemptions: int = 0
