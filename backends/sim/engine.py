"""The continuous-batching engine model: scheduling, prefill chunks and decode in simulated time."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from backends.sim.kv_cache import PrefixCache
from backends.sim.profiles import LatencyProfile
from backends.sim.stats import Counters, EngineStats, Histogram, IterationRecord

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


@dataclass(slots=True, eq=False)
class _Req:
    """One request's progress through the engine (prompt blocks computed, KV held)."""

    req_id: str
    hashes: list[int]
    prompt_tokens: int
    max_tokens: int
    arrival: float
    total_blocks: int
    cached_tokens: int = 0
    scheduled_time: float = 0.0
    first_token_time: float = 0.0
    computed: int = 0
    pinned: int = 0
    reserved: int = 0
    state: str = "waiting"  # waiting | prefill | decode | done
    context: int = 0
    """Tokens its prefill computes: the prompt, and, once preempted, what it had generated."""
    decode_from: int = 0
    """The engine's decode step its current run of decoding began with."""
    epoch: int = 0
    """Its preemptions so far: heap entries of an earlier run are stale."""


@dataclass(slots=True)
class _Step:
    """The iteration in flight: when it ends and what it computes."""

    start: float
    end: float
    n_decode: int
    chunks: list[tuple[_Req, int]]
    n_new: int
    n_active: int
    """Requests running as the step began, those it admitted included: TensorRT-LLM counts
    its active requests then (`numActiveRequests`)."""


class EngineModel:
    """A continuous-batching engine in simulated time, scheduled per iteration like vLLM V1.

    Each step decodes one token for every running sequence past prefill, then spends the rest
    of the step's token budget on prefill chunks: partially prefilled requests first, then new
    requests admitted FCFS from the waiting queue while running < max_running and the KV cache
    can hold them. By default admission reserves KV for the whole request (prompt plus
    max_tokens, as trtllm's GUARANTEED_NO_EVICT does), so preemption is never needed. With
    `lazy_kv`, as vLLM does, admission takes blocks for the prompt only and a decoding
    sequence takes a block each time it fills one; when none is left, free or evictable,
    the newest running request is preempted: its blocks are freed (its prompt's stay cached
    until evicted) and it goes back to the head of the queue, to compute its prompt and what
    it had generated again.

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
        cache_outputs: bool = False,
        lazy_kv: bool = False,
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
        self.cache_outputs = cache_outputs
        """A finished request's full output blocks stay cached, as vLLM keeps every full block
        it computed (generated ones are hashed too); off: its output's room is freed."""
        self.lazy_kv = lazy_kv
        """KV taken as a request's tokens need it, with preemption (vLLM); off: reserved whole
        at admission (TensorRT-LLM's GUARANTEED_NO_EVICT)."""
        self.preemptions = 0
        self._grow_heap: list[tuple[int, int, int, _Req]] = []
        """(decode step at which it needs one more block, seq, epoch, request), `lazy_kv`."""
        self._running_order: list[_Req] = []
        """Running requests, oldest admission first (`lazy_kv`): the last is preempted first."""
        self.iterations: deque[IterationRecord] = deque(maxlen=max(iteration_log, 1))
        self._log_iterations = iteration_log > 0
        self._reqs: dict[str, _Req] = {}
        self._waiting: deque[_Req] = deque()
        self._prefilling: list[_Req] = []
        self._decoding: dict[str, _Req] = {}
        self._finish_heap: list[tuple[int, int, int, _Req]] = []
        self._seq = 0
        self._dsteps = 0
        self._step: _Step | None = None
        self._kv_blocked = False
        self._pending_prefill = 0
        self._iter = 0
        self._c = Counters()

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
            req.computed + k >= req.context for req, k in step.chunks
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
    ) -> int:
        """Queue a request; returns the max_tokens it will generate (capped by KV capacity).

        `block_hashes` are chained hashes of the prompt's full blocks of this engine's
        `block_tokens` tokens.
        """
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
        req = _Req(req_id, hashes, prompt_tokens, max_tokens, now, total_blocks,
                   context=prompt_tokens)
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
            self._pending_prefill -= req.context
            self._kv_blocked = False  # it may have been the head that did not fit
        elif req.state == "prefill":
            self._prefilling.remove(req)
            self._pending_prefill -= req.context - req.computed
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
        """Live histograms by name: ttft, e2e, queue_time, prefill_time, tpot (seconds), and
        prefill_computed (tokens each request computed in its prefill)."""
        c = self._c
        return {
            "ttft": c.ttft,
            "e2e": c.e2e,
            "queue_time": c.queue_time,
            "prefill_time": c.prefill_time,
            "prefill_computed": c.prefill_computed,
            "tpot": c.tpot,
        }

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
            prefill_time_sum=c.prefill_time.sum,
            prefill_time_count=c.prefill_time.count,
            pending_prefill_tokens=self._pending_prefill,
            prefills_waiting=len(self._waiting) + len(self._prefilling),
            capacity_blocks=cache.capacity_blocks,
            used_blocks=cache.used_blocks,
            free_blocks=cache.capacity_blocks - cache.used_blocks,
            resident_blocks=cache.resident_blocks,
            reused_blocks=c.reused_blocks,
            missed_blocks=c.missed_blocks,
            alloc_total_blocks=c.alloc_total_blocks,
            alloc_new_blocks=c.alloc_new_blocks,
            iterations=self._iter,
            preemptions=self.preemptions,
        )

    # -- scheduling ------------------------------------------------------------------------

    def _start_step(self, t: float) -> None:
        prof = self.profile
        # vLLM admits no waiting request in a step that had to preempt a running one.
        preempted = self.lazy_kv and bool(self._decoding) and self._grow(self._dsteps + 1)
        n_decode = len(self._decoding)
        budget = self.max_batched_tokens - n_decode
        cost = prof.step_overhead_s + prof.decode_s(n_decode)
        chunks: list[tuple[_Req, int]] = []
        for req in self._prefilling:
            if budget <= 0:
                break
            k = min(req.context - req.computed, budget)
            cost += prof.prefill_chunk_s(k, req.computed)
            chunks.append((req, k))
            budget -= k
        n_new = 0
        waiting = self._waiting
        while (
            waiting
            and budget > 0
            and not self._kv_blocked
            and not preempted
            and self.num_running < self.max_running
            and waiting[0].arrival <= t
        ):
            req = waiting[0]
            if not self._admit(req, t):
                self._kv_blocked = True
                break
            waiting.popleft()
            n_new += 1
            k = min(req.context - req.computed, budget)
            cost += prof.prefill_chunk_s(k, req.computed) + prof.cached_token_s * req.computed
            chunks.append((req, k))
            budget -= k
        if not chunks and not n_decode:
            self._step = None
            # The driver was late and this request arrived after the step we could have run.
            if waiting and not self._kv_blocked and waiting[0].arrival > t:
                self._start_step(waiting[0].arrival)
            return
        self._step = _Step(t, t + cost * self.time_scale, n_decode, chunks, n_new,
                           self.num_running)

    def _admit(self, req: _Req, t: float) -> bool:
        cache, bt = self.cache, self.block_tokens
        # vLLM always computes the last prompt token, so a full hit stops one token short.
        hashes = req.hashes[: (req.context - 1) // bt]
        matched = cache.match(hashes)
        cache.acquire(hashes[:matched])
        need = (-(-req.context // bt) if self.lazy_kv else req.total_blocks) - matched
        if not cache.reserve(need):
            cache.release(hashes[:matched])
            return False
        req.computed = matched * bt
        req.pinned = matched
        req.reserved = need
        req.state = "prefill"
        self._prefilling.append(req)
        self._pending_prefill -= req.computed
        if self.lazy_kv:
            self._running_order.append(req)
        if req.epoch:
            return True  # resumed after a preemption: counted when it was first admitted
        cache.query_tokens += req.prompt_tokens
        cache.hit_tokens += matched * bt
        req.cached_tokens = req.computed
        req.scheduled_time = t
        self._c.queue_time.observe(t - req.arrival)
        c = self._c
        prompt_blocks = -(-req.prompt_tokens // bt)
        c.reused_blocks += matched
        c.missed_blocks += prompt_blocks - matched
        c.alloc_total_blocks += req.total_blocks
        c.alloc_new_blocks += need
        return True

    def _release(self, req: _Req, output_blocks: int = 0) -> None:
        """Give back what `req` holds; its `output_blocks` stay cached, evicted before its
        prompt's blocks (vLLM frees a request's blocks tail first)."""
        if self.lazy_kv:
            self._running_order.remove(req)
        self.cache.unreserve(req.reserved)
        if output_blocks:
            self.cache.keep_output(output_blocks)
        self.cache.release(req.hashes[: req.pinned])
        req.pinned = req.reserved = 0
        self._kv_blocked = False

    def _finish(self, req: _Req, t: float, events: list[Event]) -> None:
        req.state = "done"
        del self._reqs[req.req_id]
        kept = 0
        if self.cache_outputs:
            # The blocks its output filled, the first shared with the prompt's partial last.
            bt = self.block_tokens
            kept = (req.prompt_tokens + req.max_tokens) // bt - req.prompt_tokens // bt
        self._release(req, kept)
        c = self._c
        c.success += 1
        c.e2e.observe(t - req.arrival)
        if req.max_tokens > 1:
            c.tpot.observe((t - req.first_token_time) / (req.max_tokens - 1))
        events.append(Event("finished", req.req_id, t, req.max_tokens, req.cached_tokens, "length"))

    def _decode(self, req: _Req, remaining: int) -> bool:
        """`req` computed its context and sampled a token: it decodes its `remaining` tokens
        from the next decode step on. True: it has none left (it finishes now)."""
        if remaining <= 0:
            return True
        req.state = "decode"
        self._decoding[req.req_id] = req
        first = self._dsteps + 1
        req.decode_from = first
        self._seq += 1
        heapq.heappush(self._finish_heap, (first + remaining - 1, self._seq, req.epoch, req))
        if self.lazy_kv:
            self._push_growth(req)
        return False

    def _push_growth(self, req: _Req) -> None:
        """When `req` next fills the blocks it holds: at decode step s it stores the KV of
        context + 1 + (s - decode_from) tokens."""
        held = (req.pinned + req.reserved) * self.block_tokens
        self._seq += 1
        heapq.heappush(self._grow_heap, (req.decode_from + held - req.context, self._seq,
                                         req.epoch, req))

    def _grow(self, step: int) -> bool:
        """Before decode step `step`: a block for every decoding request that fills the ones
        it holds, preempting the newest running request while none is left (vLLM's
        scheduler does so for its running requests before it admits any). True: it
        preempted one."""
        heap = self._grow_heap
        before = self.preemptions
        while heap and heap[0][0] <= step:
            _, _, epoch, req = heapq.heappop(heap)
            if req.state != "decode" or epoch != req.epoch:
                continue  # finished, aborted or preempted since
            while not self.cache.reserve(1):
                victim = self._running_order[-1]
                self._preempt(victim, step)
                if victim is req:
                    break
            else:
                req.reserved += 1
                self._push_growth(req)
        return self.preemptions > before

    def _preempt(self, req: _Req, step: int) -> None:
        """Free what running `req` holds and queue it first, to compute again its prompt and
        the tokens it generated before decode step `step` (vLLM's recompute preemption)."""
        if req.state == "decode":
            del self._decoding[req.req_id]
            req.context += 1 + step - req.decode_from
        else:
            self._prefilling.remove(req)
            self._pending_prefill -= req.context - req.computed
        self._release(req)
        req.state = "waiting"
        req.computed = 0
        req.epoch += 1
        self._pending_prefill += req.context
        self._waiting.appendleft(req)
        self.preemptions += 1

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
                _, _, epoch, req = heapq.heappop(heap)
                if req.state != "decode" or epoch != req.epoch:
                    continue  # aborted or preempted while decoding
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
            if req.computed < req.context:
                continue
            self._prefilling.remove(req)
            # Resumed after a preemption while it decoded: its next token, not its first. (One
            # preempted during its prefill generated nothing: its context is its prompt.)
            if req.context > req.prompt_tokens:
                c.generation_tokens += 1
                if self.token_events:
                    events.append(Event("tokens", req.req_id, t, 1))
                if self._decode(req, req.max_tokens - (req.context - req.prompt_tokens) - 1):
                    self._finish(req, t, events)
                    completed += 1
                continue
            req.first_token_time = t
            c.ttft.observe(t - req.arrival)
            c.prefill_time.observe(t - req.scheduled_time)
            c.prefill_computed.observe(req.prompt_tokens - req.cached_tokens)
            c.prompt_tokens += req.prompt_tokens
            c.prompt_cached_tokens += req.cached_tokens
            c.generation_tokens += 1
            events.append(Event("first_token", req.req_id, t, 1, req.cached_tokens))
            if self._decode(req, req.max_tokens - 1):
                self._finish(req, t, events)
                completed += 1
        self._iter += 1
        if self._log_iterations:
            cache = self.cache
            self.iterations.append(
                IterationRecord(
                    iter=self._iter,
                    start=step.start,
                    end=t,
                    num_active=step.n_active,
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
