"""Engine pools at run time: replicas with their health and engine state, a router, load."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from backends.adapters import EngineAdapter, EngineSnapshot, adapter_for
from backends.upstream import Upstream
from routing import Router
from routing.hashing import token_block_hashes
from routing.load import LoadTracker
from routing.types import ReplicaView, RoutingRequest

log = logging.getLogger("prefix_gateway.pool")


@dataclass(frozen=True, slots=True)
class HealthTiming:
    """How often and how patiently a pool's replicas are probed and scraped."""

    interval_s: float = 2.0
    timeout_s: float = 2.0
    failure_threshold: int = 2
    metrics_interval_s: float = 5.0
    passed_through_interval_s: float = 1.0
    """Between scrapes, how often the engine's counts that end passed-through prefills are
    read where some may wait (0: not between scrapes)."""
    hit_ratio_window_s: float = 60.0


@dataclass(frozen=True, slots=True)
class Ejection:
    """Passive outlier ejection: when live traffic takes a replica out of rotation, and for
    how long (see docs/operating.md)."""

    consecutive_failures: int = 3
    """Failures of live requests in a row (5xx, timeouts) that eject the replica. A broken
    connection (refused, reset, dropped mid-stream) ejects it at once."""
    base_s: float = 1.0
    """The first ejection's length; each ejection soon after another lasts twice as long."""
    max_s: float = 30.0
    stall_s: float = 1.0
    """A replica that sends no byte for this long, while the gateway waits to read streams
    that already had content from it (or for 20 of its recent engine steps, if longer), and
    does not answer a health check meanwhile, is stalled: ejected (unless it is the pool's
    last healthy replica), and its requests that have sent nothing to their client yet are
    tried on another replica. 0: no stall watch."""


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """Where a replica is and what it serves (None: the pool's models)."""

    name: str
    base_url: str
    models: tuple[str, ...] | None = None
    api_key: str | None = None


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """Everything a pool is built from, as plain values."""

    name: str
    engine: str
    models: tuple[str, ...]
    replicas: tuple[ReplicaSpec, ...]
    health: HealthTiming = field(default_factory=HealthTiming)
    api_key: str | None = None
    hashing: str = "chars"
    """`chars` (hash character blocks) or `engine_tokens` (the engine's own tokens)."""
    token_block_size: int | None = None
    learn_chars_per_token: bool = True
    ejection: Ejection = field(default_factory=Ejection)


class ReplicaState:
    """One replica: where it is, whether it is healthy, and what its engine last reported."""

    def __init__(self, pool: str, name: str, base_url: str, models: set[str],
                 api_key: str | None = None) -> None:
        self.pool = pool
        self.name = name
        self.base_url = base_url
        self.models = models
        self.auth = f"Bearer {api_key}" if api_key else None
        # Unknown until the first probe; the gateway probes every replica before serving.
        self.healthy = False
        self.draining = False
        """Leaving the pool: no new requests (it is neither healthy nor suspect, and probes
        leave it so), while those in flight finish."""
        self.suspect = False
        """Out of rotation only because health checks timed out (not refused, not 503)."""
        self.failures = 0
        self.last_error = ""
        # Passive health, from live traffic (backends/health.py).
        self.live_failures = 0
        """Failures of live requests in a row (a success resets it)."""
        self.ejections = 0
        """Ejections in a row (each lasts longer); reset by a success after the last one."""
        self.ejected_until = 0.0
        """time.monotonic() before which probes may not bring the replica back."""
        self.last_chunk_at = 0.0
        """When the replica last sent a streamed chunk (perf_counter)."""
        self.reads = 0
        """Reads waiting now for the next chunk of a response that already sent content
        (the replica should be streaming it). A stream whose client reads slowly is not
        read either, so its silence never counts as the replica's."""
        self.reads_since = 0.0
        """When `reads` last rose from 0 (perf_counter)."""
        self.answered_at = 0.0
        """When the replica last answered a health check sent because it looked stalled
        (perf_counter): a busy engine answers, a frozen one does not."""
        self.unanswered_at = 0.0
        """When such a health check last went unanswered (perf_counter)."""
        self.stall_check: asyncio.Task[None] | None = None
        """That health check, while in flight."""
        self.holding: set[Any] = set()
        """Tries in flight there that have sent nothing to their client yet (each with an
        `interrupt(why)`): what a stall fails over."""
        self.snapshot: EngineSnapshot | None = None
        self.scraping = asyncio.Lock()
        """Held while the engine's metrics are read and applied: two reads of its counters
        must be applied in the order they were made (`LoadTracker.engine_first_tokens`)."""
        self._hit_samples: deque[tuple[float, float, float]] = deque()
        self.engine_hit_ratio: float | None = None

    def observe_snapshot(self, snap: EngineSnapshot, window_s: float,
                         now: float | None = None) -> None:
        """Keep the snapshot and update the engine hit ratio over the recent window."""
        self.snapshot = snap
        if snap.prefix_hit_tokens is None or snap.prefix_query_tokens is None:
            return
        now = time.monotonic() if now is None else now
        samples = self._hit_samples
        if samples and snap.prefix_query_tokens < samples[-1][2]:
            # Counters went backwards: the engine restarted or its cache was reset.
            samples.clear()
        samples.append((now, snap.prefix_hit_tokens, snap.prefix_query_tokens))
        # Keep one sample at or before the window start as the baseline of the difference.
        while len(samples) > 2 and samples[1][0] <= now - window_s:
            samples.popleft()
        _, h0, q0 = samples[0]
        _, h1, q1 = samples[-1]
        if q1 - q0 > 0:
            self.engine_hit_ratio = (h1 - h0) / (q1 - q0)
        elif len(samples) == 1 and q1 > 0:
            # First sight of a replica that already served traffic: its lifetime ratio.
            self.engine_hit_ratio = h1 / q1


class Pool:
    """A named group of replicas serving the same models for one or more traffic classes."""

    def __init__(self, spec: PoolSpec, router: Router,
                 adapter: EngineAdapter | None = None) -> None:
        self.name = spec.name
        self.engine = spec.engine
        self.adapter: EngineAdapter = adapter or adapter_for(spec.engine)
        self.models = set(spec.models)
        self.health = spec.health
        self.spec = spec
        self.router = router
        self.policy_name = router.policy.name
        self.hashes_engine_tokens = spec.hashing == "engine_tokens"
        """Prompts are hashed as the engine's own tokens (else as character blocks)."""
        self.replicas: dict[str, ReplicaState] = {}
        for r in spec.replicas:
            self.add_replica(r)
        self._cpt_samples = 0
        self._cpt_estimate = router.chars_per_token
        self._tokenize_cursor = itertools.count()

    # Membership: replicas join and leave while the gateway runs (gateway/fleet.py) ----------

    def add_replica(self, r: ReplicaSpec) -> ReplicaState:
        """A replica joins (or replaces the one of its name): out of rotation until a health
        check passes."""
        models = set(r.models) if r.models else set(self.spec.models)
        state = ReplicaState(self.name, r.name, r.base_url, models,
                             r.api_key or self.spec.api_key)
        if r.name in self.replicas:
            # Requests in flight there keep their state object and finish on the old URL; the
            # new engine's cache holds none of what the old one did.
            self.drain(r.name)
        self.replicas[r.name] = state
        self.router.add_replica(r.name)
        self._refresh_models()
        return state

    def update_replica(self, r: ReplicaSpec) -> None:
        """Same engine, other models or key: changed in place."""
        state = self.replicas[r.name]
        state.models = set(r.models) if r.models else set(self.spec.models)
        key = r.api_key or self.spec.api_key
        state.auth = f"Bearer {key}" if key else None
        self._refresh_models()

    def drain(self, name: str) -> ReplicaState:
        """Take `name` out of rotation for good: no new request goes there (routing and
        fallbacks only use healthy or suspect replicas), and no prefix leads there."""
        state = self.replicas[name]
        state.draining, state.healthy, state.suspect = True, False, False
        self.router.remove_replica(name)
        return state

    def undrain(self, name: str) -> ReplicaState:
        """Back in the pool; in rotation once a health check passes."""
        state = self.replicas[name]
        state.draining = False
        state.failures = 0
        self.router.add_replica(name)
        return state

    def idle(self, name: str) -> bool:
        """Nothing in flight on `name` any more."""
        state = self.replicas.get(name)
        return not self.router.load.inflight.get(name, 0) and not (state and state.holding)

    def drop(self, name: str) -> None:
        """Remove a drained replica (nothing in flight) from the pool."""
        state = self.replicas.pop(name, None)
        if state is not None:
            self.adapter.forget(state.base_url)
        self.router.remove_replica(name)
        self.router.forget_load(name)
        self._refresh_models()

    def _refresh_models(self) -> None:
        self.models = set(self.spec.models).union(
            *(r.models for r in self.replicas.values() if not r.draining))

    @property
    def load(self) -> LoadTracker:
        """The load this gateway has put on each replica (kept by the router)."""
        return self.router.load

    def healthy_views(self, model: str) -> list[ReplicaView]:
        """Healthy replicas serving `model`; if none, those whose health checks only timed out."""
        return self._views(model, suspects=False) or self._views(model, suspects=True)

    def _views(self, model: str, suspects: bool) -> list[ReplicaView]:
        views = []
        load = self.router.load
        now = perf_counter()  # the clock the proxy stamps streamed chunks with
        for r in self.replicas.values():
            usable = r.suspect if suspects else r.healthy
            if usable and model in r.models:
                snap = r.snapshot
                views.append(load.view(r.name, now) if snap is None else load.view(
                    r.name, now, int(snap.waiting or 0), snap.kv_usage))
        return views

    async def token_request(self, upstream: Upstream, payload: dict[str, Any], chat: bool,
                             traffic_class: str) -> RoutingRequest | None:
        """Tokenise on a healthy replica; None when none can (the caller falls back to chars).

        It costs one extra round trip per request; character blocks cost nothing and need no
        tokenizer.
        """
        prompt = payload.get("prompt")
        if not chat and isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            tokens: list[int] | None = prompt  # already token ids
        else:
            model = payload.get("model")
            healthy = [r for r in self.replicas.values() if r.healthy and model in r.models]
            if not healthy:
                return None
            replica = healthy[next(self._tokenize_cursor) % len(healthy)]
            headers: Mapping[str, str] = {"Authorization": replica.auth} if replica.auth else {}
            tokens = await self.adapter.tokenize(upstream, replica.base_url, payload, chat,
                                                 headers)
            if tokens is None:
                return None
        block = self.token_block_size()
        hashes = token_block_hashes(tokens, block)
        return self.router.request_from_hashes(hashes, float(len(tokens)), float(block),
                                               text=str(tokens[:64]),
                                               traffic_class=traffic_class)

    def observe_prompt_tokens(self, prompt_chars: int, prompt_tokens: int) -> None:
        """Learn the engine's characters per token from what it reports it tokenised.

        Token estimates from characters size the prefix index against the engine's KV capacity
        (in tokens) and weigh cache hits against queues: a tokenizer at 2.2 characters per token
        read as 4 makes the index believe it holds 1.8x what the engine really keeps.
        """
        if not self.spec.learn_chars_per_token or prompt_chars <= 0 or prompt_tokens <= 0:
            return
        sample = prompt_chars / prompt_tokens
        n = self._cpt_samples = self._cpt_samples + 1
        # A running mean for the first samples, then an exponential one that follows drift.
        alpha = max(1.0 / n, 0.02)
        self._cpt_estimate += alpha * (sample - self._cpt_estimate)
        used = self.router.chars_per_token
        if n >= 8 and abs(self._cpt_estimate - used) > 0.1 * used:
            log.info("pool %s: %.2f characters per token (was %.2f); resizing prefix indexes",
                     self.name, self._cpt_estimate, used)
            self.router.chars_per_token = self._cpt_estimate
            for r in self.replicas.values():
                self.apply_engine_capacity(r)

    def token_block_size(self) -> int:
        """Tokens per hashed block in engine_tokens mode: configured, else the engine's own."""
        if self.spec.token_block_size:
            return self.spec.token_block_size
        for r in self.replicas.values():
            if r.snapshot is not None and r.snapshot.block_size:
                return r.snapshot.block_size
        return self.adapter.default_block_size

    def apply_engine_capacity(self, replica: ReplicaState) -> None:
        """Size the replica's prefix index to what its engine reports it can cache."""
        snap = replica.snapshot
        cap = snap.capacity_tokens if snap else None
        if cap:
            if self.spec.hashing == "engine_tokens":
                blocks = cap // self.token_block_size()
            else:
                blocks = int(cap * self.router.chars_per_token / self.router.block_chars)
            self.router.resize_index(replica.name, max(1, blocks))
