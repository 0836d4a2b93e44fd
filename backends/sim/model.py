"""The simulated engine's prefix cache and continuous-batching latency model (pure, no I/O)."""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

# vLLM's and trtllm-serve's default TTFT buckets (identical in both engines).
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# Both engines' request-latency buckets (end-to-end, queue time).
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
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


@dataclass(frozen=True, slots=True)
class LatencyProfile:
    """Cost of one engine iteration (step), in unscaled seconds.

    A step costs `step_overhead_s`, plus `decode_base_s + decode_per_seq_s * b` when it decodes
    b sequences, plus for every prefill chunk of k uncached tokens starting at position p:
    `k / prefill_tokens_per_s + attention_s_per_token2 * k * (p + k / 2)` (the quadratic term is
    attention over the context), plus `cached_token_s` per prefix-cache-hit token in the step
    where the request starts its prefill (reading its cached KV is not free).
    """

    name: str
    prefill_tokens_per_s: float
    attention_s_per_token2: float
    cached_token_s: float
    step_overhead_s: float
    decode_base_s: float
    decode_per_seq_s: float
    max_running: int
    max_batched_tokens: int
    calibration: str = ""

    def prefill_chunk_s(self, tokens: int, context: int) -> float:
        """Compute cost of `tokens` uncached prompt tokens after `context` earlier tokens."""
        return tokens / self.prefill_tokens_per_s + self.attention_s_per_token2 * tokens * (
            context + tokens / 2
        )

    def decode_s(self, batch: int) -> float:
        """Decode cost of one step over `batch` sequences (without the step overhead)."""
        return self.decode_base_s + self.decode_per_seq_s * batch if batch else 0.0

    def ttft_s(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """TTFT of a lone request on an idle engine: its uncached tokens are prefilled in
        chunks of `max_batched_tokens`, one step each (at least one step, as vLLM computes
        the last prompt token even on a full hit)."""
        t = self.cached_token_s * cached_tokens
        done = cached_tokens
        while True:
            k = min(self.max_batched_tokens, prompt_tokens - done)
            t += self.step_overhead_s + self.prefill_chunk_s(max(0, k), done)
            done += k
            if done >= prompt_tokens:
                return t


PROFILES: dict[str, LatencyProfile] = {
    profile.name: profile
    for profile in (
        LatencyProfile(
            name="llama-8b-h200",
            prefill_tokens_per_s=37_600.0,
            attention_s_per_token2=9.0e-10,
            cached_token_s=1.7e-6,
            step_overhead_s=0.005,
            decode_base_s=0.0153,
            decode_per_seq_s=0.0008,
            max_running=256,
            max_batched_tokens=8192,
            calibration=(
                "ENGINES.md H200 table, Llama 8B: cold 2k/8k/16k/32k -> 61/253/562/1,350 ms "
                "(measured 60/253/577/1,360; 32k tok/s effective at 8k); cached 8k+256/16k+512/"
                "32k+512 -> 28/54/90 ms (measured 32/54/90); decode step at batch 1/8/32/64 -> "
                "21/27/46/72 ms (least-squares line through 26/24/41/74). Eager-PyTorch launch "
                "floor of small cases (512 cold 38 ms, 2k+128 cached 31 ms) not modelled."
            ),
        ),
        LatencyProfile(
            name="qwen-32b-h200",
            prefill_tokens_per_s=9_072.0,
            attention_s_per_token2=2.2e-9,
            cached_token_s=5.0e-6,
            step_overhead_s=0.005,
            decode_base_s=0.0383,
            decode_per_seq_s=0.00172,
            max_running=256,
            max_batched_tokens=8192,
            calibration=(
                "ENGINES.md H200 table, Qwen 32B shape: cold 512/2k/8k/16k/32k -> "
                "62/235/982/2,106/4,799 ms (measured 64/239/982/2,114/4,799; 8.3k tok/s "
                "effective at 8k); cached 8k+256/16k+512/32k+512 -> 79/162/262 ms (measured "
                "76/162/261; 2k+128 measured 122 ms is an outlier); decode step at batch "
                "1/8/32/64 -> 45/57/98/153 ms (least-squares line through 50/54/94/156)."
            ),
        ),
        LatencyProfile(
            name="vllm-cpu-tiny",
            prefill_tokens_per_s=21_240.0,
            attention_s_per_token2=2.99e-8,
            cached_token_s=1.67e-5,
            step_overhead_s=0.010,
            decode_base_s=0.002,
            decode_per_seq_s=0.0003,
            max_running=256,
            max_batched_tokens=4096,
            calibration=(
                "ENGINES.md vLLM CPU (vllm-cpu 0.32.0, 4-layer hidden-256 Llama, 2 cores), "
                "streaming /v1/completions, assuming the simulator's chars/4 estimate gives "
                "1.5 tokens per English word: 1,600 words = 2,400 tokens -> 209 ms cold / "
                "50 ms cached; 800 words = 1,200 tokens -> 88 ms cold / 30 ms cached (fitted "
                "exactly). Decode step (12 ms at batch 1 + 0.3 ms per sequence) is assumed, "
                "not measured."
            ),
        ),
    )
}


class PrefixCache:
    """Block-hashed KV cache with a capacity in blocks and block-granular LRU eviction.

    Blocks in use by running requests are pinned (refcounted) and never evicted; unpinned
    resident blocks sit in LRU order. `reserved` counts blocks promised to running requests that
    do not hold a hashed prefix block yet (uncomputed prompt blocks, partial tail, decode
    output), so admission can guarantee a request never runs out of KV mid-flight.
    """

    def __init__(self, capacity_blocks: int, block_tokens: int) -> None:
        if capacity_blocks <= 0 or block_tokens <= 0:
            raise ValueError("capacity_blocks and block_tokens must be positive")
        self.capacity_blocks = capacity_blocks
        self.block_tokens = block_tokens
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._pins: dict[int, int] = {}
        self.reserved = 0
        self.query_tokens = 0
        self.hit_tokens = 0
        self.inserted_blocks = 0
        self.evicted_blocks = 0

    @property
    def resident_blocks(self) -> int:
        return len(self._lru) + len(self._pins)

    @property
    def used_blocks(self) -> int:
        """Blocks held or reserved by running requests (what vLLM reports as KV usage)."""
        return len(self._pins) + self.reserved

    @property
    def free_blocks(self) -> int:
        """Blocks holding nothing at all (evictable cached blocks are not counted)."""
        return self.capacity_blocks - len(self._lru) - len(self._pins) - self.reserved

    @property
    def evictable_blocks(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru or block_hash in self._pins

    def hashes(self) -> list[int]:
        """Every resident block hash (pinned first, then unpinned oldest first)."""
        return [*self._pins, *self._lru]

    def match(self, hashes: Sequence[int], touch: bool = True) -> int:
        """Number of leading blocks resident; the chain is useless past the first miss."""
        lru, pins = self._lru, self._pins
        n = 0
        for h in hashes:
            if h not in lru and h not in pins:
                break
            n += 1
        if touch and n:
            # Head blocks become the most recent: losing a head orphans the whole chain.
            for h in reversed(hashes[:n]):
                if h in lru:
                    lru.move_to_end(h)
        return n

    def lookup(self, hashes: Sequence[int], query_tokens: int) -> int:
        """`match` that also counts the query and its hit in tokens, as vLLM does."""
        n = self.match(hashes)
        self.query_tokens += query_tokens
        self.hit_tokens += n * self.block_tokens
        return n

    def insert(self, hashes: Sequence[int]) -> int:
        """Make a chain resident and most recent (unpinned); returns blocks newly added."""
        added = 0
        for h in reversed(hashes):
            if h in self._pins:
                continue
            if h in self._lru:
                self._lru.move_to_end(h)
                continue
            if self.free_blocks <= 0 and not self._evict(1):
                break
            self._lru[h] = None
            added += 1
        self.inserted_blocks += added
        return added

    def acquire(self, hashes: Sequence[int]) -> None:
        """Pin resident blocks for a running request."""
        lru, pins = self._lru, self._pins
        for h in hashes:
            if h in pins:
                pins[h] += 1
            else:
                del lru[h]
                pins[h] = 1

    def release(self, hashes: Sequence[int]) -> None:
        """Unpin blocks; tail first so the chain's head is the last to be evicted (as vLLM)."""
        lru, pins = self._lru, self._pins
        for h in reversed(hashes):
            left = pins[h] - 1
            if left:
                pins[h] = left
            else:
                del pins[h]
                lru[h] = None

    def reserve(self, blocks: int) -> bool:
        """Promise `blocks` to a request, evicting LRU blocks if needed; False if impossible."""
        short = blocks - self.free_blocks
        if short > 0 and not self._evict(short):
            return False
        self.reserved += blocks
        return True

    def unreserve(self, blocks: int) -> None:
        self.reserved -= blocks

    def commit(self, block_hash: int) -> None:
        """Turn one reserved block into the pinned, hashed block a request just computed."""
        self.reserved -= 1
        pins = self._pins
        if block_hash in pins:
            pins[block_hash] += 1
            return
        if block_hash in self._lru:
            del self._lru[block_hash]
        else:
            self.inserted_blocks += 1
        pins[block_hash] = 1

    def clear(self) -> int:
        """Drop every unpinned block (vLLM's reset_prefix_cache); returns blocks dropped."""
        n = len(self._lru)
        self._lru.clear()
        self.evicted_blocks += n
        return n

    def _evict(self, blocks: int) -> bool:
        if blocks > len(self._lru):
            return False
        pop = self._lru.popitem
        for _ in range(blocks):
            pop(last=False)
        self.evicted_blocks += blocks
        return True


EventKind = Literal["first_token", "tokens", "finished"]


class Event(NamedTuple):
    """Something a request saw at simulated time `time`.

    first_token: `tokens` is 1 and `cached_tokens` the prefix-cache hit; tokens: `tokens` new
    tokens from one decode step (only with `token_events`); finished: `tokens` is the total
    generated and `finish_reason` says why.
    """

    kind: EventKind
    req_id: str
    time: float
    tokens: int
    cached_tokens: int = 0
    finish_reason: str = ""


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


@dataclass(slots=True, eq=False)
class _Req:
    req_id: str
    hashes: list[int]
    prompt_tokens: int
    max_tokens: int
    arrival: float
    total_blocks: int
    cached_tokens: int = 0
    admitted: float = 0.0
    first_token_time: float = 0.0
    computed: int = 0
    pinned: int = 0
    reserved: int = 0
    state: str = "waiting"  # waiting | prefill | decode | done


@dataclass(slots=True)
class _Step:
    start: float
    end: float
    n_decode: int
    chunks: list[tuple[_Req, int]]
    n_new: int


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
    pending_prefill_tokens: int
    capacity_blocks: int
    used_blocks: int
    free_blocks: int
    resident_blocks: int
    reused_blocks: int
    missed_blocks: int
    alloc_total_blocks: int
    alloc_new_blocks: int
    iterations: int


@dataclass(slots=True)
class _Counters:
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
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))


class EngineModel:
    """A continuous-batching engine in simulated time, scheduled per iteration like vLLM V1.

    Each step decodes one token for every running sequence past prefill, then spends the rest
    of the step's token budget on prefill chunks: partially prefilled requests first, then new
    requests admitted FCFS from the waiting queue while running < max_running and the KV cache
    can hold them. Admission reserves KV for the whole request (prompt plus max_tokens, as
    trtllm's GUARANTEED_NO_EVICT does), so preemption is never needed and not modelled.

    Decoding is lazy: a sequence's token count is derived from a global decode-step counter and
    its finish step sits in a heap, so a decode step costs O(1) plus O(finishing requests)
    unless `token_events` asks for a per-sequence event each step (the HTTP server streams
    them; an offline simulation leaves it off). Durations are the profile's times
    `time_scale`; the caller owns the clock and must call `advance(now)` before `submit(now)`.
    """

    def __init__(
        self,
        profile: LatencyProfile,
        kv_capacity_tokens: int,
        block_tokens: int = 16,
        *,
        max_running: int | None = None,
        max_batched_tokens: int | None = None,
        time_scale: float = 1.0,
        token_events: bool = False,
        iteration_log: int = 0,
    ) -> None:
        if kv_capacity_tokens < block_tokens:
            raise ValueError("kv_capacity_tokens must hold at least one block")
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.profile = profile
        self.block_tokens = block_tokens
        self.cache = PrefixCache(kv_capacity_tokens // block_tokens, block_tokens)
        self.capacity_tokens = self.cache.capacity_blocks * block_tokens
        self.max_running = max_running or profile.max_running
        self.max_batched_tokens = max_batched_tokens or profile.max_batched_tokens
        self.time_scale = time_scale
        self.token_events = token_events
        self.iterations: deque[IterationRecord] = deque(maxlen=max(iteration_log, 1))
        self._log_iterations = iteration_log > 0
        self._reqs: dict[str, _Req] = {}
        self._waiting: deque[_Req] = deque()
        self._prefilling: list[_Req] = []
        self._decoding: dict[str, _Req] = {}
        self._finish_heap: list[tuple[int, int, _Req]] = []
        self._seq = 0
        self._dsteps = 0
        self._step: _Step | None = None
        self._kv_blocked = False
        self._pending_prefill = 0
        self._iter = 0
        self._c = _Counters()

    # -- the clock -------------------------------------------------------------------------

    def next_event_time(self) -> float | None:
        """End of the step in flight, or None when the engine is idle."""
        step = self._step
        return step.end if step is not None else None

    @property
    def step_emits_tokens(self) -> bool:
        """Whether the step in flight ends with a token for some request (a streamed chunk)."""
        step = self._step
        if step is None:
            return False
        return step.n_decode > 0 or any(
            req.computed + k >= req.prompt_tokens for req, k in step.chunks
        )

    def advance(self, now: float) -> list[Event]:
        """Complete every step that ends at or before `now`; O(1) when idle."""
        events: list[Event] = []
        while self._step is not None and self._step.end <= now:
            self._finish_step(events)
        return events

    # -- requests --------------------------------------------------------------------------

    def submit(
        self,
        req_id: str,
        block_hashes: Sequence[int],
        prompt_tokens: int,
        max_tokens: int,
        now: float,
        block_tokens: int | None = None,
    ) -> int:
        """Queue a request; returns the max_tokens it will generate (capped by KV capacity).

        `block_hashes` are chained hashes of the prompt's full `block_tokens`-token blocks.
        """
        if block_tokens is not None and block_tokens != self.block_tokens:
            raise ValueError(
                f"request hashed with {block_tokens}-token blocks, engine uses {self.block_tokens}"
            )
        if req_id in self._reqs:
            raise ValueError(f"duplicate request id {req_id!r}")
        if prompt_tokens < 1 or max_tokens < 1:
            raise ValueError("prompt_tokens and max_tokens must be at least 1")
        if prompt_tokens >= self.capacity_tokens:
            raise ValueError(
                f"prompt of {prompt_tokens} tokens does not fit this engine's KV cache of "
                f"{self.capacity_tokens} tokens; shorten the prompt"
            )
        bt = self.block_tokens
        max_tokens = min(max_tokens, self.capacity_tokens - prompt_tokens)
        hashes = list(block_hashes[: prompt_tokens // bt])
        total_blocks = -(-(prompt_tokens + max_tokens) // bt)
        req = _Req(req_id, hashes, prompt_tokens, max_tokens, now, total_blocks)
        self._reqs[req_id] = req
        self._waiting.append(req)
        self._pending_prefill += prompt_tokens
        if self._step is None:
            self._start_step(now)
        return max_tokens

    def abort(self, req_id: str) -> bool:
        """Drop a request (client went away); its KV is released at once."""
        req = self._reqs.pop(req_id, None)
        if req is None:
            return False
        if req.state == "waiting":
            self._waiting.remove(req)
            self._pending_prefill -= req.prompt_tokens
            self._kv_blocked = False  # it may have been the head that did not fit
        elif req.state == "prefill":
            self._prefilling.remove(req)
            self._pending_prefill -= req.prompt_tokens - req.computed
            self._release(req)
        elif req.state == "decode":
            del self._decoding[req_id]
            self._release(req)
        req.state = "done"
        self._c.aborted += 1
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached block not in use; returns blocks dropped."""
        self._kv_blocked = False
        return self.cache.clear()

    # -- observation -----------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._prefilling) + len(self._decoding)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def pending_prefill_tokens(self) -> int:
        """Prompt tokens still to compute, queued or in progress (cache hits excluded)."""
        return self._pending_prefill

    @property
    def histograms(self) -> dict[str, Histogram]:
        """Live histograms by name: ttft, e2e, queue_time, tpot (seconds)."""
        c = self._c
        return {"ttft": c.ttft, "e2e": c.e2e, "queue_time": c.queue_time, "tpot": c.tpot}

    def stats(self) -> EngineStats:
        c, cache = self._c, self.cache
        return EngineStats(
            running=self.num_running,
            waiting=self.num_waiting,
            kv_usage=cache.used_blocks / cache.capacity_blocks,
            prefix_cache_query_tokens=cache.query_tokens,
            prefix_cache_hit_tokens=cache.hit_tokens,
            prompt_tokens=c.prompt_tokens,
            prompt_cached_tokens=c.prompt_cached_tokens,
            generation_tokens=c.generation_tokens,
            request_success=c.success,
            request_aborted=c.aborted,
            ttft_bucket_counts=list(c.ttft.counts),
            ttft_sum=c.ttft.sum,
            ttft_count=c.ttft.count,
            pending_prefill_tokens=self._pending_prefill,
            capacity_blocks=cache.capacity_blocks,
            used_blocks=cache.used_blocks,
            free_blocks=cache.capacity_blocks - cache.used_blocks,
            resident_blocks=cache.resident_blocks,
            reused_blocks=c.reused_blocks,
            missed_blocks=c.missed_blocks,
            alloc_total_blocks=c.alloc_total_blocks,
            alloc_new_blocks=c.alloc_new_blocks,
            iterations=self._iter,
        )

    # -- scheduling ------------------------------------------------------------------------

    def _start_step(self, t: float) -> None:
        prof = self.profile
        n_decode = len(self._decoding)
        budget = self.max_batched_tokens - n_decode
        cost = prof.step_overhead_s + prof.decode_s(n_decode)
        chunks: list[tuple[_Req, int]] = []
        for req in self._prefilling:
            if budget <= 0:
                break
            k = min(req.prompt_tokens - req.computed, budget)
            cost += prof.prefill_chunk_s(k, req.computed)
            chunks.append((req, k))
            budget -= k
        n_new = 0
        waiting = self._waiting
        while (
            waiting
            and budget > 0
            and not self._kv_blocked
            and self.num_running < self.max_running
            and waiting[0].arrival <= t
        ):
            req = waiting[0]
            if not self._admit(req, t):
                self._kv_blocked = True
                break
            waiting.popleft()
            n_new += 1
            k = min(req.prompt_tokens - req.computed, budget)
            cost += prof.prefill_chunk_s(k, req.computed) + prof.cached_token_s * req.computed
            chunks.append((req, k))
            budget -= k
        if not chunks and not n_decode:
            self._step = None
            # The driver was late and this request arrived after the step we could have run.
            if waiting and not self._kv_blocked and waiting[0].arrival > t:
                self._start_step(waiting[0].arrival)
            return
        self._step = _Step(t, t + cost * self.time_scale, n_decode, chunks, n_new)

    def _admit(self, req: _Req, t: float) -> bool:
        cache, bt = self.cache, self.block_tokens
        # vLLM always computes the last prompt token, so a full hit stops one token short.
        hashes = req.hashes[: (req.prompt_tokens - 1) // bt]
        matched = cache.match(hashes)
        cache.acquire(hashes[:matched])
        need = req.total_blocks - matched
        if not cache.reserve(need):
            cache.release(hashes[:matched])
            return False
        cache.query_tokens += req.prompt_tokens
        cache.hit_tokens += matched * bt
        req.cached_tokens = req.computed = matched * bt
        req.pinned = matched
        req.reserved = need
        req.state = "prefill"
        req.admitted = t
        self._c.queue_time.observe(t - req.arrival)
        self._prefilling.append(req)
        self._pending_prefill -= req.cached_tokens
        c = self._c
        prompt_blocks = -(-req.prompt_tokens // bt)
        c.reused_blocks += matched
        c.missed_blocks += prompt_blocks - matched
        c.alloc_total_blocks += req.total_blocks
        c.alloc_new_blocks += need
        return True

    def _release(self, req: _Req) -> None:
        self.cache.release(req.hashes[: req.pinned])
        self.cache.unreserve(req.reserved)
        req.pinned = req.reserved = 0
        self._kv_blocked = False

    def _finish(self, req: _Req, t: float, events: list[Event]) -> None:
        req.state = "done"
        del self._reqs[req.req_id]
        self._release(req)
        c = self._c
        c.success += 1
        c.e2e.observe(t - req.arrival)
        if req.max_tokens > 1:
            c.tpot.observe((t - req.first_token_time) / (req.max_tokens - 1))
        events.append(Event("finished", req.req_id, t, req.max_tokens, req.cached_tokens, "length"))

    def _finish_step(self, events: list[Event]) -> None:
        step = self._step
        assert step is not None
        t = step.end
        c = self._c
        completed = 0
        if step.n_decode:
            self._dsteps += 1
            decoding = self._decoding
            c.generation_tokens += len(decoding)
            if self.token_events:
                events.extend(Event("tokens", rid, t, 1) for rid in decoding)
            heap = self._finish_heap
            while heap and heap[0][0] <= self._dsteps:
                req = heapq.heappop(heap)[2]
                if req.state != "decode":
                    continue  # aborted while decoding
                del decoding[req.req_id]
                self._finish(req, t, events)
                completed += 1
        n_ctx_tokens = 0
        for req, k in step.chunks:
            if req.state != "prefill":
                continue  # aborted mid-step
            n_ctx_tokens += k
            req.computed += k
            self._pending_prefill -= k
            full = min(req.computed // self.block_tokens, len(req.hashes))
            if full > req.pinned:
                commit = self.cache.commit
                for h in req.hashes[req.pinned : full]:
                    commit(h)
                req.reserved -= full - req.pinned
                req.pinned = full
            if req.computed < req.prompt_tokens:
                continue
            self._prefilling.remove(req)
            req.first_token_time = t
            c.ttft.observe(t - req.arrival)
            c.prompt_tokens += req.prompt_tokens
            c.prompt_cached_tokens += req.cached_tokens
            c.generation_tokens += 1
            events.append(Event("first_token", req.req_id, t, 1, req.cached_tokens))
            if req.max_tokens == 1:
                self._finish(req, t, events)
                completed += 1
                continue
            req.state = "decode"
            self._decoding[req.req_id] = req
            self._seq += 1
            heapq.heappush(self._finish_heap, (self._dsteps + req.max_tokens - 1, self._seq, req))
        self._iter += 1
        if self._log_iterations:
            cache = self.cache
            self.iterations.append(
                IterationRecord(
                    iter=self._iter,
                    start=step.start,
                    end=t,
                    num_active=self.num_running,
                    num_queued=len(self._waiting),
                    num_new_active=step.n_new,
                    num_completed=completed,
                    num_context_requests=len(step.chunks),
                    num_gen_requests=step.n_decode,
                    num_ctx_tokens=n_ctx_tokens,
                    used_blocks=cache.used_blocks,
                    free_blocks=cache.capacity_blocks - cache.used_blocks,
                    max_blocks=cache.capacity_blocks,
                    reused_blocks=c.reused_blocks,
                    missed_blocks=c.missed_blocks,
                    alloc_total_blocks=c.alloc_total_blocks,
                    alloc_new_blocks=c.alloc_new_blocks,
                )
            )
        self._start_step(t)
