"""Reference policies no gateway can run: an oracle over the engines' truth, and SGLang's rule.

Both plug into `routing.Router` like any policy, so the simulator drives them exactly as it
drives the gateway's own. They live in loadtests/ because they are yardsticks, not products:

- `Oracle` reads every simulated engine's true prefix cache and queue and sends each request
  where its own estimated TTFT is lowest (greedy: it does not weigh what the request does to
  later ones).
- `SGLangCacheAware` emulates the SGLang router's published `cache_aware` algorithm with its CLI
  defaults. It is an emulation: the real router is measured over HTTP by
  `python -m loadtests.compare_http`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from backends.sim.engine import EngineModel
from routing import rendezvous
from routing.policies.base import Policy, PrefixLookup
from routing.prefix_index import PrefixIndex
from routing.types import (
    REASON_AFFINITY,
    REASON_LEAST_LOAD,
    Decision,
    ReplicaView,
    RoutingRequest,
)

REASON_ORACLE = "oracle"


class Oracle(Policy):
    """Lowest estimated TTFT on each replica's true cache and queue.

    Before each decision the simulator calls `observe` with the request's engine-side block
    hashes and the current time. The estimate, per replica: the rest of the step in flight, the
    prefill compute of every request queued ahead (its own cache hit judged when it was first
    seen), one step overhead plus a decode step per `max_batched_tokens` of that work, and the
    request's own prefill with its true cache hit. KV-admission stalls are not modelled.
    """

    name = "oracle"

    def __init__(self, engines: Mapping[str, EngineModel]) -> None:
        super().__init__()
        self.engines = engines
        self._hashes: Sequence[int] = ()
        self._prompt_tokens = 0
        self._now = 0.0
        # Cache hit (tokens) of each queued request, judged once when first seen: recomputing
        # it for a deep queue on every decision would dominate the simulation's run time.
        self._queued_hit: dict[tuple[str, str], int] = {}
        self._decisions = 0

    def observe(self, engine_hashes: Sequence[int], prompt_tokens: int, now: float) -> None:
        self._hashes = engine_hashes
        self._prompt_tokens = prompt_tokens
        self._now = now

    def cached_tokens(self, name: str) -> int:
        """The current request's prompt tokens `name`'s engine truly holds now."""
        eng = self.engines[name]
        bt = eng.block_tokens
        # vLLM computes the last prompt token even on a full hit (as EngineModel._admit).
        return eng.cache.match(self._hashes[: (self._prompt_tokens - 1) // bt],
                               touch=False) * bt

    def estimate(self, name: str) -> tuple[float, int]:
        """(estimated TTFT in seconds, true cached tokens) of the current request on `name`."""
        eng = self.engines[name]
        prof = eng.profile
        bt = eng.block_tokens
        cached = self.cached_tokens(name)
        new = self._prompt_tokens - cached
        # The oracle may read the engine's private queue: knowing it is what makes it an oracle.
        ahead_s = 0.0
        ahead_tokens = 0
        for req in eng._prefilling:
            left = req.prompt_tokens - req.computed
            ahead_s += prof.prefill_chunk_s(left, req.computed)
            ahead_tokens += left
        for req in eng._waiting:
            key = (name, req.req_id)
            hit = self._queued_hit.get(key)
            if hit is None:
                hit = eng.cache.match(req.hashes[: (req.prompt_tokens - 1) // bt],
                                      touch=False) * bt
                self._queued_hit[key] = hit
            ahead_s += prof.prefill_chunk_s(req.prompt_tokens - hit, hit)
            ahead_tokens += req.prompt_tokens - hit
        n_decode = len(eng._decoding)
        budget = max(1, eng.max_batched_tokens - n_decode)
        steps = math.ceil((ahead_tokens + new) / budget)
        step_end = eng.next_event_time()
        rest = max(0.0, step_end - self._now) if step_end is not None else 0.0
        own = prof.prefill_chunk_s(new, cached) + prof.cached_token_s * cached
        per_step = prof.step_overhead_s + prof.decode_s(n_decode)
        return rest + (ahead_s + own + steps * per_step) * eng.time_scale, cached

    def choose(
        self, request: RoutingRequest, replicas: Sequence[ReplicaView], lookup: PrefixLookup
    ) -> Decision:
        self._decisions += 1
        if self._decisions % 2048 == 0:
            self._forget_started()
        rows = []
        for r in replicas:
            est, cached = self.estimate(r.name)
            # Ties (an idle fleet) go by rendezvous weight so cold prompts still spread.
            rows.append((est, -rendezvous.weight(request.key, r.name), cached, r.name))
        rows.sort()
        est, _, cached, chosen = rows[0]
        matched = lookup.matched_blocks(chosen, request.hashes)
        return Decision(
            replica=chosen,
            reason=REASON_ORACLE,
            matched_blocks=matched,
            total_blocks=len(request.hashes),
            uncached_tokens=float(max(0, self._prompt_tokens - cached)),
            fallbacks=[row[3] for row in rows[1:]],
        )

    def _forget_started(self) -> None:
        live = {(name, req.req_id) for name, eng in self.engines.items() for req in eng._waiting}
        self._queued_hit = {k: v for k, v in self._queued_hit.items() if k in live}


class SGLangCacheAware(Policy):
    """Emulated SGLang router `cache_aware` (sglang-router 0.3.x CLI defaults).

    1. Load is in-flight requests per worker, as the router counts them. If
       max - min > balance_abs_threshold and max > min * balance_rel_threshold, the request
       goes to the least-loaded worker (ties: the first in worker order).
    2. Otherwise match_rate = matched characters / prompt characters on the tree. Above
       cache_threshold the request goes to the worker holding the longest match (several such:
       a hash-ordered pick, as the tree's tenant map iterates); else to the least-loaded one.
    3. The prompt is inserted into the chosen worker's tree in every case (`on_routed`).
    """

    name = "sglang_cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_size: int = 2**26,
        block_chars: int = 256,
    ) -> None:
        super().__init__()
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree_blocks = max(1, max_tree_size // block_chars)
        # One worker's share of SGLang's character radix tree, as chained character blocks:
        # prompts here diverge only at block boundaries, so the matched length is the same to
        # within one block. SGLang evicts LRU leaves down to max_tree_size every 60 s; an LRU
        # bounded at insert is the same budget without the timer.
        self.trees: dict[str, PrefixIndex] = {}

    def _tree(self, name: str) -> PrefixIndex:
        tree = self.trees.get(name)
        if tree is None:
            tree = self.trees[name] = PrefixIndex(self.tree_blocks)
        return tree

    def choose(
        self, request: RoutingRequest, replicas: Sequence[ReplicaView], lookup: PrefixLookup
    ) -> Decision:
        hashes = request.hashes
        loads = [r.inflight for r in replicas]
        hi, lo = max(loads), min(loads)
        # min() returns the first minimum: SGLang's min_by_key keeps the first worker on ties.
        least = min(replicas, key=lambda r: r.inflight)
        imbalanced = (hi - lo > self.balance_abs_threshold
                      and hi > lo * self.balance_rel_threshold)
        matches = {r.name: self._tree(r.name).match(hashes) for r in replicas}
        best = max(matches.values(), default=0)
        reason = REASON_LEAST_LOAD
        chosen = least.name
        if not imbalanced and best:
            rate = best * request.block_tokens / request.prompt_tokens
            if rate > self.cache_threshold:
                deepest = hashes[best - 1]
                holders = [n for n, m in matches.items() if m == best]
                chosen = max(holders, key=lambda n: rendezvous.weight(deepest, n))
                reason = REASON_AFFINITY
        matched = lookup.matched_blocks(chosen, hashes)
        return Decision(
            replica=chosen,
            reason=reason,
            matched_blocks=matched,
            total_blocks=len(hashes),
            uncached_tokens=max(0.0, request.prompt_tokens - matched * request.block_tokens),
            fallbacks=[r.name for r in replicas if r.name != chosen],
        )

    def on_routed(self, request: RoutingRequest, decision: Decision) -> None:
        # Inserted wherever the request goes, a retry included, as the router's tree is.
        self._tree(decision.replica).insert(request.hashes)
