"""Offline discrete-event simulation of the gateway's routing over simulated engines (no HTTP).

The replicas are `backends.sim.engine.EngineModel`, the same cache and latency model the HTTP
simulated replica runs; the router is `routing.Router` with the policy `routing.build_policy`
makes from the gateway's `RoutingSettings`, fed as the gateway feeds it: the prompt text goes
through `router.request_from_text`, replica views come from the router's load, which it
updates on dispatch, chunks, first token and finish, and each index is sized to its engine's
KV capacity as the gateway does once it has read the engine's metrics. The engine hashes the
same text with its own block size, so router and engine see one prompt through their own
blocks.

Events are arrivals (trace time / speedup) and engine step ends; nothing waits on a wall clock,
so a whole trace over hundreds of replicas runs in seconds.

    python -m loadtests.simulate --trace data/traces/synthetic_trace.jsonl --policy all
    python -m loadtests.simulate --workload tenants --replicas 32 --json
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.sim.engine import EngineModel
from backends.sim.fleet_spec import (
    FLEET_HELP,
    SLOW_HELP,
    ReplicaProfile,
    describe,
    fleet_profiles,
    is_uniform,
)
from backends.sim.profiles import PROFILES, LatencyProfile, fastest
from backends.sim.prompt import estimate_tokens
from backends.sim.stats import EngineStats
from gateway.config import HealthSettings, RoutingSettings
from loadtests.reference_policies import Oracle, SGLangCacheAware
from loadtests.report import text_table
from loadtests.settings import add_routing_settings, add_workload_param
from loadtests.shadow import Shadow
from loadtests.sim_sharing import (
    DEFAULT_FLUSH_INTERVAL_S,
    DEFAULT_LOAD_INTERVAL_S,
    Gateways,
    Sharing,
)
from loadtests.stats import max_over_mean, percentile, prefill_seconds
from loadtests.traces import (
    SYNTHETIC,
    TraceRequest,
    agreement_figures,
    ideal_hit_ratio,
    load_requests,
    prompt_text,
    shadow_agreement,
    streams,
)
from loadtests.ttft_bound import TtftBounds, ttft_bounds
from routing import Router, RoutingRequest, build_policy
from routing.hashing import char_block_hashes
from routing.policies import Policy, policy_names, settings_names
from routing.types import Decision, ReplicaView

# The built-in policies in the order reports list them, then any other registered policy.
_REPORT_ORDER = ("round_robin", "least_load", "consistent_hash", "prefix_affinity")
GATEWAY_POLICIES = (*(p for p in _REPORT_ORDER if p in policy_names()),
                    *sorted(set(policy_names()) - set(_REPORT_ORDER)))
REFERENCE_POLICIES = ("sglang_cache_aware", "oracle")
ALL_POLICIES = (*GATEWAY_POLICIES, *REFERENCE_POLICIES)

DEFAULT_PROFILE = "qwen-32b-h200"
# 1,000 blocks of 512 tokens per replica, about what a 32B model leaves for KV on one
# 141 GB H200.
DEFAULT_KV_CAPACITY_TOKENS = 512_000
DEFAULT_ENGINE_BLOCK_TOKENS = 16  # vLLM's default KV block
DEFAULT_MAX_OUTPUT = 1024
FIRST_TOKEN_SIGNALS = ("count", "waiting", "none")
"""What a scrape can say of passed-through prefills: see run_pool's `first_tokens`."""
SAMPLE_INTERVAL_S = 0.5
# The gateway scrapes every replica's /metrics this often by default: policies see the
# engine's own queue and KV usage as of the last scrape, not as they are now.
DEFAULT_METRICS_INTERVAL_S: float = HealthSettings.model_fields["metrics_interval_s"].default
DEFAULT_PASSED_THROUGH_INTERVAL_S: float = (
    HealthSettings.model_fields["passed_through_interval_s"].default)

REPORT_KEYS = (
    "requests", "errors", "duration_s", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
    "tpot_p50_s", "hit_ratio", "ideal_hit_ratio", "imbalance", "prefill_imbalance",
    "prefill_time_imbalance", "peak_inflight_imbalance", "policy", "replicas", "workload",
)  # fmt: skip


@dataclass(slots=True)
class Workload:
    """A named request list (times already scaled) and what is derived from its prompt text.

    Prompt text is synthesised once per derivation and the results cached on the workload, so
    a scoreboard running many policies over one workload hashes each prompt once per setting.
    """

    name: str
    requests: list[TraceRequest]
    _engine: dict[int, tuple[list[array], list[int]]] = field(default_factory=dict)
    _routing: dict[tuple[int, float, int], list[RoutingRequest]] = field(default_factory=dict)
    _ideal: float | None = None
    _ideal_cached: dict[int, list[int]] = field(default_factory=dict)

    def engine_prompts(self, block_tokens: int) -> tuple[list[array], list[int]]:
        """Per request: the engine's chained block hashes and its prompt token count."""
        got = self._engine.get(block_tokens)
        if got is None:
            hashes, tokens = [], []
            # As backends/sim/prompt.text_prompt: blocks of block_tokens * 4 bytes of text.
            for req in self.requests:
                text = prompt_text(req)
                hashes.append(array("Q", char_block_hashes(text, block_tokens * 4)))
                tokens.append(estimate_tokens(text))
            got = self._engine[block_tokens] = (hashes, tokens)
        return got

    def routing_requests(self, router: Router) -> list[RoutingRequest]:
        """Per request: `router.request_from_text(text)`, exactly what the gateway computes."""
        key = (router.block_chars, router.chars_per_token, router.key_blocks)
        got = self._routing.get(key)
        if got is None:
            got = self._routing[key] = [router.request_from_text(prompt_text(r))
                                        for r in self.requests]
        return got

    def ideal_cached_tokens(self, block_tokens: int) -> list[int]:
        """Per request: the tokens one infinite engine cache would hold for it (all earlier
        prompts' blocks), stopping one token short of a full hit as vLLM does."""
        got = self._ideal_cached.get(block_tokens)
        if got is None:
            hashes, tokens = self.engine_prompts(block_tokens)
            seen: set[int] = set()
            got = []
            for chain, prompt in zip(hashes, tokens, strict=True):
                matched = 0
                for h in chain[: (prompt - 1) // block_tokens]:
                    if h not in seen:
                        break
                    matched += 1
                seen.update(chain)
                got.append(matched * block_tokens)
            self._ideal_cached[block_tokens] = got
        return got

    def ttft_bounds(self, profile: LatencyProfile, block_tokens: int = DEFAULT_ENGINE_BLOCK_TOKENS,
                    replicas: int = 1, max_output: int = DEFAULT_MAX_OUTPUT,
                    kv_capacity_tokens: int = DEFAULT_KV_CAPACITY_TOKENS) -> TtftBounds:
        """Mean TTFTs no policy beats in the replica model, over the requests an engine of this
        capacity accepts: the floor (every request alone on an idle engine holding every earlier
        prefix) and the floor plus the decode co-batching no router avoids (ttft_bound.py).
        They tell where a target is out of reach of any router."""
        _, tokens = self.engine_prompts(block_tokens)
        cached = self.ideal_cached_tokens(block_tokens)
        capacity = kv_capacity_tokens // block_tokens * block_tokens
        served = [i for i, p in enumerate(tokens) if p < capacity]
        # As EngineModel.submit caps max_tokens.
        outputs = [min(max(1, min(self.requests[i].output_tokens, max_output)),
                       capacity - tokens[i]) for i in served]
        return ttft_bounds(profile, replicas, [self.requests[i].timestamp_s for i in served],
                           [tokens[i] for i in served], [cached[i] for i in served], outputs)

    @property
    def ideal_hit_ratio(self) -> float:
        if self._ideal is None:
            self._ideal = ideal_hit_ratio(self.requests)
        return self._ideal


def load_workload(trace: str | None = None, workload: str | None = None, *,
                  limit: int | None = None, speedup: float = 1.0,
                  params: dict[str, Any] | None = None) -> Workload:
    """A trace file or directory, or a synthetic workload by name, with time divided by speedup."""
    name = Path(trace).name if trace else workload or ""
    return Workload(name, load_requests(trace, workload, limit, speedup, params))


PolicyFactory = Callable[[str, RoutingSettings, dict[str, EngineModel], dict[str, Any] | None],
                         Policy]
"""Builds a run's policy from its name, settings, engines and overrides (`make_policy`)."""


def make_policy(name: str, settings: RoutingSettings, engines: dict[str, EngineModel],
                overrides: dict[str, Any] | None = None) -> Policy:
    """The policy `name` as the gateway builds it from `settings` (a reference policy takes
    only the router's settings)."""
    if name == "oracle":
        return Oracle(engines)
    if name == "sglang_cache_aware":
        return SGLangCacheAware(block_chars=settings.block_chars, **(overrides or {}))
    return build_policy(name, {**settings.for_policy(name).policy_settings(), **(overrides or {})})


def settings_for(policy: str, given: dict[str, Any], *, strict: bool = True) -> RoutingSettings:
    """The gateway's routing settings for one simulated policy from ``--set`` values.

    Strict (one policy): a key must be a setting of the router or of that policy. Not strict
    (``--policy all``): a key must be a setting of the router or of some gateway policy, and
    each policy takes those that are its own (load_weight=1 tunes prefix_affinity, not
    round_robin). Raises ValueError naming what is wrong."""
    router_keys = set(RoutingSettings.model_fields) - {"policy"}
    takes = set(settings_names(policy)) if policy in GATEWAY_POLICIES else set()
    known = router_keys | takes
    if not strict:
        known = router_keys.union(*(settings_names(p) for p in GATEWAY_POLICIES))
    unknown = sorted(k for k in given if k not in known)
    if unknown:
        whose = "any gateway policy" if not strict else f"policy {policy}"
        raise ValueError(f"--set {', '.join(unknown)}: not a setting of the router "
                         f"({', '.join(sorted(router_keys))}) nor of {whose}"
                         + ("" if not strict else f" ({', '.join(sorted(takes)) or 'none'})"))
    kept = {k: v for k, v in given.items() if k in router_keys | takes}
    if policy in GATEWAY_POLICIES:
        return RoutingSettings(policy=policy, **kept)
    return RoutingSettings(**kept)


@dataclass(slots=True)
class PoolRun:
    """What one simulated pool did with a workload's requests, per request (indexed as the
    workload's requests; -1 / NaN for a request it did not serve)."""

    names: list[str]
    engines: list[EngineModel]
    routers: list[Router]
    """One per gateway; request k of the run went to gateway k % len(routers)."""
    replica_of: list[int]
    first_at: list[float]
    finish_at: list[float]
    out_tokens: list[int]
    inflight_at_arrival: list[int]
    """Requests running or waiting on the pool's engines when each one arrived."""
    prefill_done: list[float]
    routed: list[int]
    inflight_ratios: list[float]
    reasons: list[str | None]
    """Per request, the route reason its gateway gave (None: not served)."""
    shadow: Shadow | None = None
    """The shadow single gateway, with its picks (None: no shadow ran)."""

    @property
    def router(self) -> Router:
        """The first gateway's router."""
        return self.routers[0]

    @property
    def hit_ratio(self) -> float | None:
        """Prompt tokens the engines found cached over those they looked up (None: none)."""
        query = sum(e.cache.query_tokens for e in self.engines)
        return sum(e.cache.hit_tokens for e in self.engines) / query if query else None


def _every(interval_s: float, first_s: float, action: Callable[[float], None]
           ) -> Callable[[float], None]:
    """A function of time `t` that runs `action(due)` once for each multiple `due` of
    `interval_s` after `first_s` (included) that lies before `t` and has not run yet: what
    the gateway's periodic readings would have seen by then, and when."""
    due = first_s

    def until(t: float) -> None:
        nonlocal due
        while due < t:
            action(due)
            due += interval_s

    return until


def run_pool(
    workload: Workload,
    policy: str = "prefix_affinity",
    *,
    profiles: Sequence[LatencyProfile],
    kv_capacity_tokens: int = DEFAULT_KV_CAPACITY_TOKENS,
    max_output: int = DEFAULT_MAX_OUTPUT,
    engine_block_tokens: int = DEFAULT_ENGINE_BLOCK_TOKENS,
    settings: RoutingSettings | None = None,
    policy_params: dict[str, Any] | None = None,
    only: Sequence[int] | None = None,
    policy_factory: PolicyFactory = make_policy,
    metrics_interval_s: float | None = DEFAULT_METRICS_INTERVAL_S,
    gateways: int = 1,
    sharing: Sharing | None = None,
    shadow: bool | None = None,
    stream_share: float = 1.0,
    first_tokens: str = "count",
    passed_through_interval_s: float | None = DEFAULT_PASSED_THROUGH_INTERVAL_S,
    engine_caches_outputs: bool = False,
    engine_lazy_kv: bool = False,
) -> PoolRun:
    """Route the workload's requests (or those listed in `only`, in time order) over a pool of
    simulated replicas, one per profile in `profiles`, as the gateway does; per request, what
    happened.

    Every `metrics_interval_s` from the first arrival the engines are scraped as the gateway
    scrapes them, and each view carries the last scrape's waiting count and KV usage
    (`ReplicaView.engine_waiting`, `kv_usage`); None: never scraped, as a gateway that cannot
    read the engines' metrics.

    With `gateways` above one, each has its own router and policy; the k-th request routed
    goes to gateway k % gateways, its chunks, first token and finish to that gateway, which
    times a replica's step only when a request of its own streams a token in it; they share
    their state as `sharing` says (default: as the gateway's shared routing defaults).

    With `shadow` (default: when there are several gateways), one more router, the shadow
    single gateway, sees every request and every event at once; before each request is
    routed it is asked where it would send it (`PoolRun.shadow`), then told where the
    request really went, so that its state follows the real fleet.

    `stream_share`: the share of requests that stream (spread evenly over the arrivals). The
    others are non-streaming requests passed through, as the gateway does by default
    (`server.non_streaming_ttft: false`): their gateway sees no chunk and no first token, only
    the answer, so it times no engine step with them and learns no rate from them.

    `first_tokens`: what the engines' scrapes say of the prefills of those requests. "count":
    the first tokens made so far, as vLLM reports them; "waiting": how many requests wait
    for their first token, as TensorRT-LLM's iteration stats tell; "none": nothing. Every
    `passed_through_interval_s` too (None or 0: never), those alone are read of each engine
    where a gateway has such requests presumably waiting (`health.passed_through_interval_s`)."""
    if first_tokens not in FIRST_TOKEN_SIGNALS:
        raise ValueError(f"first_tokens: one of {FIRST_TOKEN_SIGNALS}")
    settings = settings or RoutingSettings()
    profs = list(profiles)
    replicas = len(profs)
    names = [f"r{i}" for i in range(replicas)]
    engines = {n: EngineModel(p, kv_capacity_tokens, engine_block_tokens,
                              cache_outputs=engine_caches_outputs, lazy_kv=engine_lazy_kv)
               for n, p in zip(names, profs, strict=True)}
    engine_list = [engines[n] for n in names]
    # What Pool.apply_engine_capacity does once the engine reports its KV capacity.
    index_blocks = max(1, int(kv_capacity_tokens * settings.chars_per_token
                              / settings.block_chars))

    def new_router() -> Router:
        router = Router(names, policy_factory(policy, settings, engines, policy_params),
                        block_chars=settings.block_chars,
                        chars_per_token=settings.chars_per_token,
                        index_capacity_blocks=settings.index_capacity_blocks,
                        key_blocks=settings.key_blocks,
                        prefill_tokens_per_s=settings.prefill_tokens_per_s,
                        speed_decode_agrees=settings.speed_decode_agrees,
                        pin_running=settings.pin_running,
                        # The simulated engine reserves a request's whole output when it
                        # admits it, as TensorRT-LLM's default scheduler does; with lazy KV
                        # it takes blocks as it decodes, as vLLM does.
                        output_reserve=settings.output_reserve_for(
                            "vllm" if engine_lazy_kv else "trtllm"),
                        output_cached=settings.output_cached,
                        decode_step_wait=settings.decode_step_wait,
                        engine_speed=settings.engine_speed)
        for n in names:
            router.resize_index(n, index_blocks)
        return router

    routers = [new_router() for _ in range(max(1, gateways))]
    shade = Shadow(new_router(), len(workload.requests)) if (
        shadow if shadow is not None else gateways > 1) else None
    oracles = [r.policy for r in (*routers, *((shade.router,) if shade else ()))
               if isinstance(r.policy, Oracle)]

    reqs = workload.requests
    routing_reqs = workload.routing_requests(routers[0])
    engine_hashes, prompt_tokens = workload.engine_prompts(engine_block_tokens)
    n = len(reqs)
    order = range(n) if only is None else only
    replica_of = [-1] * n
    decisions: list[Decision | None] = [None] * n
    first_at = [math.nan] * n
    finish_at = [math.nan] * n
    out_tokens = [0] * n
    inflight_at_arrival = [0] * n
    prefill_done = [0.0] * replicas  # true uncached prompt tokens computed, per replica
    routed = [0] * replicas
    index_of = {name: i for i, name in enumerate(names)}

    # As the HTTP replay samples the replicas' /metrics: every 0.5 s, max over mean of
    # running + waiting, kept when the mean is at least 1; the report takes the peak.
    inflight_ratios: list[float] = []
    start = reqs[order[0]].timestamp_s if order else 0.0
    gws = Gateways(routers, sharing or Sharing(), start)
    gateway_of = [0] * n
    # Per gateway and replica: its requests there past their first token, not finished.
    streaming = [[0] * replicas for _ in routers]
    streamed = [True] * n
    for k, rid in enumerate(order):
        streamed[rid] = streams(k, stream_share)

    def sample(_: float) -> None:
        loads = [e.num_running + e.num_waiting for e in engine_list]
        mean = sum(loads) / replicas
        if mean >= 1:
            inflight_ratios.append(max(loads) / mean)

    sample_until = _every(SAMPLE_INTERVAL_S, start, sample)

    # The last scrape of each engine: (waiting, KV usage), None before the first.
    scraped: list[tuple[int, float] | None] = [None] * replicas

    every_router = [*routers, *((shade.router,) if shade else ())]

    def scrape(at: float) -> None:
        for k, e in enumerate(engine_list):
            stats = e.stats()
            scraped[k] = (stats.waiting, stats.kv_usage)
            # What the gateway reads of the engine's prefill rate (EngineSpeeds).
            for router in every_router:
                router.load.engines.report(
                    names[k], at, stats.prompt_tokens - stats.prompt_cached_tokens,
                    stats.prefill_time_sum, stats.prefill_time_count)
                tell_counts(router, names[k], stats, at)

    def tell_counts(router: Router, name: str, stats: EngineStats, at: float) -> None:
        # What the gateway reads of the counts that end passed-through prefills.
        if first_tokens == "count":
            router.load.engine_first_tokens(name, stats.ttft_count)
        elif first_tokens == "waiting":
            router.load.engine_prefills_waiting(name, stats.prefills_waiting, at)

    def read_first_tokens(at: float) -> None:
        for k, e in enumerate(engine_list):
            stats = None
            for router in every_router:
                if router.load.awaits_unseen(names[k]):
                    stats = stats or e.stats()
                    tell_counts(router, names[k], stats, at)

    every_scrape = (_every(metrics_interval_s, start + metrics_interval_s, scrape)
                    if metrics_interval_s else lambda t: None)
    every_read = (_every(passed_through_interval_s, start + passed_through_interval_s,
                         read_first_tokens)
                  if passed_through_interval_s and stream_share < 1.0 else lambda t: None)

    def scrape_until(t: float) -> None:
        every_read(t)
        every_scrape(t)

    def scraped_views(router: Router, now: float) -> list[ReplicaView]:
        # As Pool._views gives each view the engine's last scrape.
        return [router.load.view(name, now, *(snap or ()))
                for name, snap in zip(names, scraped, strict=True)]

    heap: list[tuple[float, int]] = []
    scheduled: list[float | None] = [None] * replicas

    def reschedule(i: int) -> None:
        t = engine_list[i].next_event_time()
        if t is not None and t != scheduled[i]:
            scheduled[i] = t
            heapq.heappush(heap, (t, i))
        elif t is None:
            scheduled[i] = None

    def decided(rid: int) -> Decision:
        decision = decisions[rid]
        assert decision is not None  # only dispatched requests have engine events
        return decision

    def step(t: float, i: int) -> None:
        name = names[i]
        events = engine_list[i].advance(t)
        if shade is not None and (any(s[i] for s in streaming) or any(
                ev.kind == "first_token" and streamed[int(ev.req_id)] for ev in events)):
            shade.router.chunk(name, t)
        # A gateway sees this step's streamed chunks if a request of its own got a token in
        # it: one decoding there, or one whose first token this is (streamed requests only).
        for g, router in enumerate(routers):
            if streaming[g][i] or any(ev.kind == "first_token" and gateway_of[int(ev.req_id)] == g
                                      and streamed[int(ev.req_id)] for ev in events):
                router.chunk(name, t)
                gws.changed(g, t)
        for ev in events:
            rid = int(ev.req_id)
            g = gateway_of[rid]
            if ev.kind == "first_token":
                first_at[rid] = ev.time
                prefill_done[i] += prompt_tokens[rid] - ev.cached_tokens
                if streamed[rid]:
                    routers[g].first_token(decided(rid), ev.time, reqs[rid].timestamp_s)
                    if shade is not None:
                        shade.first_token(rid, ev.time, reqs[rid].timestamp_s)
                    streaming[g][i] += 1
            elif ev.kind == "finished":
                finish_at[rid] = ev.time
                out_tokens[rid] = ev.tokens
                routers[g].finished(decided(rid), streamed[rid], ev.tokens)
                if shade is not None:
                    shade.finished(rid, streamed[rid], ev.tokens)
                if streamed[rid]:
                    streaming[g][i] -= 1
            gws.changed(g, t)
        scheduled[i] = None
        reschedule(i)

    def drain_until(t_limit: float) -> None:
        while True:
            t_engine = heap[0][0] if heap else math.inf
            if t_engine == math.inf and t_limit == math.inf:
                return  # every request answered: what is shared now changes nothing
            t_shared = gws.next_time()
            if t_shared <= min(t_engine, t_limit):
                gws.run_until(min(t_engine, t_limit))
                continue
            if t_engine > t_limit:
                return
            t, i = heapq.heappop(heap)
            if scheduled[i] != t:
                continue  # superseded
            sample_until(t)
            scrape_until(t)
            step(t, i)

    for k, rid in enumerate(order):
        req = reqs[rid]
        now = req.timestamp_s
        # Engine events at the arrival instant happen first: a step ending now frees its slot.
        drain_until(now)
        sample_until(now)
        inflight_at_arrival[rid] = sum(e.num_running + e.num_waiting for e in engine_list)
        rr = routing_reqs[rid]
        rr.output_tokens = max_tokens = max(1, min(req.output_tokens, max_output))
        scrape_until(now)
        g = gateway_of[rid] = gws.gateway_of(k)
        router = routers[g]
        views = scraped_views(router, now)
        for oracle in oracles:
            oracle.observe(engine_hashes[rid], prompt_tokens[rid], now)
        gws.now = now
        if shade is None:
            decision = router.route(rr, views)
        else:
            # Asked before the real decision, on the state one gateway would have had.
            pick = shade.ask(rr, scraped_views(shade.router, now))
            decision = router.route(rr, views)
            shade.tell(rid, rr, pick, decision)
        i = index_of[decision.replica]
        eng = engine_list[i]
        try:
            eng.submit(str(rid), engine_hashes[rid], prompt_tokens[rid], max_tokens, now)
        except ValueError:
            continue  # a prompt longer than the engine's KV cache: a 400 error over HTTP
        replica_of[rid] = i
        decisions[rid] = decision
        blind_at = None if streamed[rid] else now
        router.dispatched(decision, now, blind_at)
        if shade is not None:
            shade.dispatched(rid, blind_at)
        gws.changed(g, now)
        routed[i] += 1
        reschedule(i)
    drain_until(math.inf)

    reasons = [d.reason if d is not None else None for d in decisions]
    return PoolRun(names, engine_list, routers, replica_of, first_at, finish_at, out_tokens,
                   inflight_at_arrival, prefill_done, routed, inflight_ratios, reasons,
                   shade)


def simulate(
    workload: Workload,
    policy: str = "prefix_affinity",
    *,
    replicas: int = 8,
    kv_capacity_tokens: int = DEFAULT_KV_CAPACITY_TOKENS,
    profile: str = DEFAULT_PROFILE,
    max_output: int = DEFAULT_MAX_OUTPUT,
    engine_block_tokens: int = DEFAULT_ENGINE_BLOCK_TOKENS,
    settings: RoutingSettings | None = None,
    policy_params: dict[str, Any] | None = None,
    fleet: Sequence[ReplicaProfile] | None = None,
    timeline: bool = False,
    policy_factory: PolicyFactory = make_policy,
    metrics_interval_s: float | None = DEFAULT_METRICS_INTERVAL_S,
    gateways: int = 1,
    sharing: Sharing | None = None,
    stream_share: float = 1.0,
    first_tokens: str = "count",
    passed_through_interval_s: float | None = DEFAULT_PASSED_THROUGH_INTERVAL_S,
    engine_caches_outputs: bool = False,
    engine_lazy_kv: bool = False,
) -> dict[str, Any]:
    """Run one policy over the workload; returns the replay's report keys (with `timeline`,
    also "timeline": [arrival s, TTFT s] of every answered request, in arrival order), with
    the replay's agreement figures (`agreement_figures`) and, through several `gateways`
    (run_pool), how they shared their state.

    `fleet` gives each replica its own profile and slowdown (its length is the replica count);
    else there are `replicas` replicas of `profile`. `stream_share`, `first_tokens`,
    `passed_through_interval_s`: as run_pool."""
    if profile not in PROFILES:
        raise SystemExit(f"unknown profile {profile!r}; choose one of {sorted(PROFILES)}")
    fleet = list(fleet) if fleet else [ReplicaProfile(profile)] * replicas
    replicas = len(fleet)
    profs = [r.build() for r in fleet]
    # The bounds hold for any routing if every replica is as fast as the fastest at each cost.
    prof = profs[0] if is_uniform(fleet) else fastest(profs)
    run = run_pool(workload, policy, profiles=profs, kv_capacity_tokens=kv_capacity_tokens,
                   max_output=max_output, engine_block_tokens=engine_block_tokens,
                   settings=settings, policy_params=policy_params,
                   policy_factory=policy_factory, metrics_interval_s=metrics_interval_s,
                   gateways=gateways, sharing=sharing, stream_share=stream_share,
                   first_tokens=first_tokens,
                   passed_through_interval_s=passed_through_interval_s,
                   engine_caches_outputs=engine_caches_outputs, engine_lazy_kv=engine_lazy_kv)
    reqs = workload.requests
    n = len(reqs)
    replica_of, first_at, finish_at = run.replica_of, run.first_at, run.finish_at
    out_tokens, router = run.out_tokens, run.router
    routed, prefill_done, inflight_ratios = run.routed, run.prefill_done, run.inflight_ratios

    done = [r for r in range(n) if replica_of[r] >= 0 and not math.isnan(first_at[r])]
    served = [run.names[i] if i >= 0 else None for i in replica_of]
    ttfts = [first_at[r] - reqs[r].timestamp_s for r in done]
    tpots = [(finish_at[r] - first_at[r]) / (out_tokens[r] - 1)
             for r in done if out_tokens[r] > 1 and not math.isnan(finish_at[r])]
    hit = run.hit_ratio
    start = reqs[0].timestamp_s if reqs else 0.0
    end = max((finish_at[r] for r in done if not math.isnan(finish_at[r])), default=start)
    bounds = workload.ttft_bounds(prof, engine_block_tokens, replicas, max_output,
                                  kv_capacity_tokens)
    report: dict[str, Any] = {
        "requests": len(done),
        "errors": n - len(done),
        "duration_s": round(end - start, 3),
        "ttft_mean_s": round(sum(ttfts) / len(ttfts), 4) if ttfts else 0.0,
        "ttft_p50_s": round(percentile(ttfts, 0.5, 0.0), 4),
        "ttft_p90_s": round(percentile(ttfts, 0.9, 0.0), 4),
        "ttft_p99_s": round(percentile(ttfts, 0.99, 0.0), 4),
        "tpot_p50_s": round(percentile(tpots, 0.5, 0.0), 5),
        "hit_ratio": round(hit, 4) if hit is not None else 0.0,
        "ideal_hit_ratio": round(workload.ideal_hit_ratio, 4),
        "ttft_floor_mean_s": round(bounds.floor, 4),
        "ttft_bound_mean_s": round(bounds.cobatch, 4),
        "imbalance": round(max_over_mean(routed, 0.0), 3),
        "prefill_imbalance": round(max_over_mean(prefill_done, 0.0), 3),
        "prefill_time_imbalance": round(max_over_mean(
            prefill_seconds(prefill_done, [p.prefill_tokens_per_s for p in profs]), 0.0), 3),
        "peak_inflight_imbalance": round(max(inflight_ratios, default=0.0), 3),
        "prefill_tokens_per_s": round(router.load.steps.rate),
        "prefill_tokens_per_replica": [round(t) for t in prefill_done],
        "learned_prefill_tokens_per_s": [round(router.load.steps.replica_rate(name) or 0)
                                         for name in run.names],
        "fleet": describe(fleet),
        "policy": policy + (" (emulated)" if policy == "sglang_cache_aware" else ""),
        "replicas": replicas,
        "workload": workload.name,
        "gateways": len(run.routers),
        **agreement_figures(reqs, served, run.reasons),
    }
    if engine_lazy_kv:
        report["engine_preemptions"] = sum(e.preemptions for e in run.engines)
    if run.shadow is not None:
        report.update(shadow_agreement(reqs, served, run.shadow.picks, run.shadow.matched,
                                       run.shadow.held))
    if len(run.routers) > 1:
        sharing = sharing or Sharing()
        report["sharing"] = ({"flush_interval_s": sharing.flush_interval_s,
                              "load_interval_s": sharing.load_interval_s,
                              "delay_s": sharing.delay_s} if sharing.enabled else "off")
    if timeline:
        report["timeline"] = [[reqs[r].timestamp_s, first_at[r] - reqs[r].timestamp_s]
                              for r in done]
    return report


# -- CLI -----------------------------------------------------------------------------------

_COLUMNS = (
    ("policy", "policy", "{}"), ("ttft_mean_s", "TTFT mean s", "{:.3f}"),
    ("ttft_p50_s", "p50", "{:.3f}"), ("ttft_p90_s", "p90", "{:.3f}"),
    ("ttft_p99_s", "p99", "{:.3f}"), ("tpot_p50_s", "TPOT p50", "{:.4f}"),
    ("hit_ratio", "hit", "{:.3f}"), ("ideal_hit_ratio", "ideal", "{:.3f}"),
    ("imbalance", "req imb", "{:.2f}"), ("prefill_imbalance", "prefill imb", "{:.2f}"),
    ("prefill_time_imbalance", "prefill time imb", "{:.2f}"),
    ("peak_inflight_imbalance", "peak imb", "{:.2f}"), ("requests", "requests", "{}"),
    ("errors", "errors", "{}"), ("duration_s", "duration s", "{:.1f}"),
    ("agreement", "agreement", "{:.3f}"), ("spills", "spills", "{}"),
)  # fmt: skip


_SHADOW_COLUMNS = (
    ("shadow_agreement", "shadow agr.", "{:.3f}"),
    ("shadow_match_agreement", "shadow match", "{:.3f}"),
    ("shadow_held_agreement", "shadow held", "{:.3f}"),
)


def format_table(reports: Sequence[dict[str, Any]]) -> str:
    """One row per report, for a terminal; the shadow's figures when a run has them."""
    shadow = _SHADOW_COLUMNS if any("shadow_agreement" in r for r in reports) else ()
    return text_table([title for _, title, _ in _COLUMNS + shadow],
                      [[fmt.format(r[key]) if r[key] is not None else "-"
                        for key, _, fmt in _COLUMNS]
                       + [fmt.format(r[key]) if r.get(key) is not None else "-"
                          for key, _, fmt in shadow] for r in reports])


def add_fleet_options(ap: argparse.ArgumentParser, note: str = "") -> None:
    """--replicas, --fleet, --slow and --profile: the simulated replicas and their speeds, as
    `fleet_from_options` builds them; `note` starts each help text."""
    ap.add_argument("--replicas", type=int, default=None,
                    help=f"{note}default 8, or the --fleet's")
    ap.add_argument("--fleet", default=None, help=note + FLEET_HELP)
    ap.add_argument("--slow", default=None, help=note + SLOW_HELP)
    ap.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES),
                    help=f"{note}the replicas' latency profile, where --fleet gives none")


def fleet_from_options(ap: argparse.ArgumentParser,
                       args: argparse.Namespace) -> list[ReplicaProfile]:
    """The fleet `add_fleet_options` describes; a usage error (exit 2) for one it cannot."""
    try:
        return fleet_profiles(args.replicas, args.profile, args.fleet, args.slow)
    except ValueError as exc:
        ap.error(str(exc))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Mooncake JSONL file or RAGPulse directory")
    src.add_argument("--workload", choices=sorted(SYNTHETIC), help="a synthetic workload")
    add_fleet_options(ap)
    ap.add_argument("--policy", default="prefix_affinity", choices=[*ALL_POLICIES, "all"])
    ap.add_argument("--limit", type=int, default=None, help="first N requests")
    ap.add_argument("--speedup", type=float, default=1.0, help="divide arrival times by this")
    ap.add_argument("--kv-capacity-tokens", type=int, default=DEFAULT_KV_CAPACITY_TOKENS)
    ap.add_argument("--max-output", type=int, default=DEFAULT_MAX_OUTPUT)
    ap.add_argument("--engine-block-tokens", type=int, default=DEFAULT_ENGINE_BLOCK_TOKENS)
    ap.add_argument("--metrics-interval-s", type=float, default=DEFAULT_METRICS_INTERVAL_S,
                    help="how often the gateway scrapes the engines' metrics, which policies "
                         "see as ReplicaView.engine_waiting and kv_usage (0: never)")
    ap.add_argument("--gateways", type=int, default=1,
                    help="gateways routing the requests, request k through gateway k mod N")
    ap.add_argument("--sharing", choices=("on", "off"), default="on",
                    help="whether several gateways share routing state (as through Redis)")
    ap.add_argument("--flush-interval-s", type=float, default=DEFAULT_FLUSH_INTERVAL_S,
                    help="shared_routing.flush_interval_s (0: every insert at once)")
    ap.add_argument("--load-interval-s", type=float, default=DEFAULT_LOAD_INTERVAL_S,
                    help="shared_routing.load_interval_s (0: on every change of load)")
    ap.add_argument("--read-interval-s", type=float, default=None,
                    help="the reader's pause after a read (default: --flush-interval-s)")
    ap.add_argument("--sharing-delay-s", type=float, default=0.0,
                    help="from a gateway's write to the others' being able to read it")
    ap.add_argument("--stream-share", type=float, default=1.0,
                    help="share of requests that stream (0-1); the others are passed through "
                         "whole, as the gateway does by default, and time no engine step")
    ap.add_argument("--first-tokens", choices=FIRST_TOKEN_SIGNALS, default="count",
                    help="what the engines say of the prefills of requests passed through: "
                         "their count of first tokens (vLLM), how many requests wait for "
                         "theirs (TensorRT-LLM), or nothing")
    ap.add_argument("--passed-through-interval-s", type=float,
                    default=DEFAULT_PASSED_THROUGH_INTERVAL_S,
                    help="how often, between scrapes, those counts alone are read where "
                         "requests passed through may wait for their prefill (the gateway's "
                         "health.passed_through_interval_s; 0: never)")
    ap.add_argument("--engine-caches-outputs", action="store_true",
                    help="the simulated engines keep a finished request's full output blocks "
                         "cached, as vLLM does (they push out older prefixes); default: "
                         "freed when it ends")
    ap.add_argument("--engine-lazy-kv", action="store_true",
                    help="the simulated engines take KV blocks as a request's tokens need "
                         "them and preempt the newest running request when none is left, as "
                         "vLLM does (the gateway then counts half of each max_tokens, as for "
                         "vLLM); default: a request's whole output reserved at admission, as "
                         "TensorRT-LLM's default scheduler does, never preempting")
    add_workload_param(ap)
    add_routing_settings(ap)
    ap.add_argument("--json", action="store_true", help="one JSON object on the last line")
    args = ap.parse_args(argv)
    fleet = fleet_from_options(ap, args)
    if not 0.0 <= args.stream_share <= 1.0:
        ap.error("--stream-share must be between 0 and 1")
    if args.gateways < 1:
        ap.error("--gateways must be at least 1")
    if args.gateways > 1 and args.policy in (*REFERENCE_POLICIES, "all"):
        ap.error("--gateways above 1 takes one of the gateway's policies")
    sharing = Sharing(args.sharing == "on", args.flush_interval_s, args.load_interval_s,
                      args.sharing_delay_s, args.read_interval_s)
    params = dict(args.workload_param)
    policies = ALL_POLICIES if args.policy == "all" else (args.policy,)
    try:
        settings = {name: settings_for(name, dict(args.settings), strict=args.policy != "all")
                    for name in policies}
    except ValueError as exc:
        ap.error(str(exc))
    workload = load_workload(args.trace, args.workload, limit=args.limit, speedup=args.speedup,
                             params=params)
    reports = []
    for name in policies:
        t0 = time.perf_counter()
        report = simulate(workload, name, kv_capacity_tokens=args.kv_capacity_tokens,
                          profile=args.profile, max_output=args.max_output,
                          engine_block_tokens=args.engine_block_tokens,
                          settings=settings[name], fleet=fleet,
                          metrics_interval_s=args.metrics_interval_s or None,
                          gateways=args.gateways, sharing=sharing,
                          stream_share=args.stream_share, first_tokens=args.first_tokens,
                          passed_through_interval_s=args.passed_through_interval_s or None,
                          engine_caches_outputs=args.engine_caches_outputs,
                          engine_lazy_kv=args.engine_lazy_kv)
        report["wall_s"] = round(time.perf_counter() - t0, 2)
        reports.append(report)
    print(f"# {workload.name}: {len(workload.requests)} requests, {len(fleet)} replicas "
          f"({describe(fleet)}), KV {args.kv_capacity_tokens} tokens/replica, "
          f"speedup {args.speedup}"
          + (f", {args.gateways} gateways (sharing {args.sharing})" if args.gateways > 1 else ""))
    print(format_table(reports))
    if args.json:
        print(json.dumps(reports[0] if len(reports) == 1 else {"runs": reports}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
