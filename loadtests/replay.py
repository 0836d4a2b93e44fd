"""Replay a request trace against the gateway (or any OpenAI-compatible router) over HTTP.

Without --url it starts `--replicas N` simulated replicas (one `python -m backends.sim --count N`
process) and `--gateways G` gateway processes on one config in front of them (with `--redis`,
sharing a redis-server it starts), replays, and stops them all. With --url it drives running
routers (a comma-separated list) and reads the replicas named by --replica-urls, so another
router can be measured in front of the same replicas. Request i goes to router i mod G, as a
round-robin load balancer would send it. Prompts come from loadtests.traces.prompt_text; arrivals
follow the trace's timestamps divided by --speedup (open loop). The report's cache and balance
figures come from the replicas' own Prometheus /metrics, never from the router, so they mean the
same for every router; `agreement` comes from the `x-gateway-replica` response header.

    python -m loadtests.replay --trace data/traces/synthetic_trace.jsonl \
        --replicas 8 --limit 1000 --speedup 10 --json
    python -m loadtests.replay --workload tenants --replicas 8 --speedup 2 --gateways 3 --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from backends.sim.fleet_spec import FLEET_HELP, SLOW_HELP, describe, fleet_profiles
from gateway import processes
from gateway.config import RoutingSettings, load_config
from gateway.defaults import one_pool_config
from loadtests.fleet import MODEL, Fleet, run_async, sigterm_as_interrupt
from loadtests.metrics import (
    ENGINE_TTFT,
    HITS,
    QUERIES,
    RUNNING,
    SUCCESS,
    WAITING,
    scrape_all,
)
from loadtests.overhead import cpu_seconds as process_cpu_seconds
from loadtests.report import emit_json, markdown_table
from loadtests.settings import add_routing_settings, add_workload_param, key_value
from loadtests.shadow import ReplayShadow, replay_shadow
from loadtests.sse import data_events
from loadtests.stats import max_over_mean, percentile, prefill_seconds
from loadtests.traces import (
    BLOCK_TOKENS,
    SYNTHETIC,
    TraceRequest,
    agreement_figures,
    ideal_hit_ratio,
    load_requests,
    prompt_text,
    streams,
)

# 1,000 Mooncake blocks of 512 tokens per replica: the first 1,000 Mooncake requests touch
# about 30k distinct blocks, so 8 replicas (8k blocks) cannot hold them and caches evict.
DEFAULT_KV_CAPACITY_TOKENS = 512_000
DEFAULT_PROFILE = "llama-8b-h200"
DEFAULT_MAX_OUTPUT = 1024
SAMPLE_INTERVAL_S = 0.5
REQUIRED_KEYS = (
    "requests", "errors", "duration_s", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
    "tpot_p50_s", "hit_ratio", "ideal_hit_ratio", "imbalance", "prefill_imbalance",
    "peak_inflight_imbalance", "policy", "gateways", "agreement", "warm_requests",
)  # fmt: skip
# The response header naming the replica that served a request (the gateway's; routers
# without it leave `agreement` empty).
REPLICA_HEADER = "x-gateway-replica"
SHADOW_SYNC_S = 1.0
"""How often a replay's shadow copies what a gateway learned from the engines."""
# Why the gateway chose it (its `server.explain_headers`): classifies the warm requests that
# missed their home (`warm_miss_reasons`).
REASON_HEADER = "x-gateway-route-reason"

ENGINE_TTFT_SUM = ENGINE_TTFT + "_sum"
ENGINE_TTFT_COUNT = ENGINE_TTFT + "_count"
PREEMPTIONS = "vllm:num_preemptions_total"
_WANTED = (HITS, QUERIES, SUCCESS, RUNNING, WAITING, ENGINE_TTFT_SUM, ENGINE_TTFT_COUNT,
           PREEMPTIONS)


def log(msg: str) -> None:
    print(f"replay: {msg}", file=sys.stderr, flush=True)


# -- the client ------------------------------------------------------------------------------


@dataclass(slots=True)
class Result:
    ok: bool
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float = 0.0
    lag_s: float = 0.0
    tokens: int = 0
    error: str = ""
    replica: str | None = None
    reason: str | None = None


@dataclass
class ReplayOptions:
    max_output: int = DEFAULT_MAX_OUTPUT
    concurrency_limit: int = 0
    timeout_s: float = 600.0
    model: str = MODEL
    label: str = "external"
    stream_share: float = 1.0
    """The share of requests sent streaming, spread evenly; the others are sent
    non-streaming, as whole answers: their TTFT is not seen by the client (the report's
    `engine_ttft_mean_s`, from the engines' own histograms, counts every request)."""
    engine: str = "vllm"
    """The replicas' engine, whose metrics page the replay reads (`metrics.scrape`)."""


def _routed(resp: aiohttp.ClientResponse, shadow: ReplayShadow | None, index: int
            ) -> tuple[str | None, str | None, ReplayShadow | None]:
    """The replica that served request `index` and why (the router's headers), and the shadow
    if it was told so and follows the request from now on."""
    replica = resp.headers.get(REPLICA_HEADER)
    reason = resp.headers.get(REASON_HEADER)
    followed = shadow if shadow is not None and replica is not None and shadow.served(
        index, replica, reason) else None
    return replica, reason, followed


async def _send_whole(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                      lag_s: float, shadow: ReplayShadow | None, index: int) -> Result:
    """A non-streaming request: its answer whole, timed end to end (no first token to see)."""
    start = time.perf_counter()
    followed: ReplayShadow | None = None
    if shadow is not None:
        shadow.ask(index, start)
    try:
        async with session.post(url, data=orjson.dumps(body),
                                headers={"Content-Type": "application/json"}) as resp:
            raw = await resp.read()
            if resp.status != 200:
                return Result(False, latency_s=time.perf_counter() - start, lag_s=lag_s,
                              error=f"HTTP {resp.status}: {raw[:200]!r}")
            replica, reason, followed = _routed(resp, shadow, index)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Result(False, latency_s=time.perf_counter() - start, lag_s=lag_s,
                      error=f"{type(exc).__name__}: {exc}"[:200])
    finally:
        if followed is not None:
            followed.finished(index, False)
        elif shadow is not None:
            shadow.dropped(index)
    end = time.perf_counter()
    try:
        tokens = int(orjson.loads(raw)["usage"]["completion_tokens"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return Result(False, latency_s=end - start, lag_s=lag_s, error="no usage in answer")
    return Result(True, None, None, end - start, lag_s, tokens, replica=replica, reason=reason)


async def _send(session: aiohttp.ClientSession, url: str, req: TraceRequest, opts: ReplayOptions,
                lag_s: float, shadow: ReplayShadow | None = None, index: int = -1,
                stream: bool = True) -> Result:
    max_tokens = max(1, min(req.output_tokens, opts.max_output))
    body = {
        "model": opts.model,
        "prompt": prompt_text(req),
        "max_tokens": max_tokens,
        # Generate exactly max_tokens (vLLM and SGLang read these; others ignore them).
        "ignore_eos": True,
        "min_tokens": max_tokens,
        "temperature": 0.0,
    }
    if not stream:
        return await _send_whole(session, url, body, lag_s, shadow, index)
    body.update(stream=True, stream_options={"include_usage": True})
    start = time.perf_counter()
    first = last = None
    events = 0
    usage_tokens = None
    followed: ReplayShadow | None = None  # the shadow, once told where the request went
    if shadow is not None:
        shadow.ask(index, start)
    try:
        async with session.post(url, data=orjson.dumps(body),
                                headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                text = (await resp.text())[:200]
                return Result(False, latency_s=time.perf_counter() - start, lag_s=lag_s,
                              error=f"HTTP {resp.status}: {text}")
            replica, reason, followed = _routed(resp, shadow, index)
            async for data in data_events(resp.content):
                if followed is not None and replica is not None:
                    followed.chunk(replica, time.perf_counter())
                if b'"completion_tokens"' in data:
                    with contextlib.suppress(orjson.JSONDecodeError, KeyError, TypeError):
                        usage = orjson.loads(data).get("usage") or {}
                        usage_tokens = int(usage["completion_tokens"])
                    if b'"choices":[]' in data or b'"choices": []' in data:
                        continue
                if first is None:
                    # Parse only until the first chunk with text: that is the TTFT.
                    try:
                        chunk = orjson.loads(data)
                        choice = (chunk.get("choices") or [{}])[0]
                        text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    except (orjson.JSONDecodeError, AttributeError, IndexError):
                        text = None
                    if not text:
                        continue
                    first = time.perf_counter()
                    if followed is not None:
                        followed.first_token(index, first)
                last = time.perf_counter()
                events += 1
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Result(False, latency_s=time.perf_counter() - start, lag_s=lag_s,
                      error=f"{type(exc).__name__}: {exc}"[:200])
    finally:
        if followed is not None:
            followed.finished(index, first is not None)
        elif shadow is not None:
            shadow.dropped(index)
    end = time.perf_counter()
    if first is None:
        return Result(False, latency_s=end - start, lag_s=lag_s, error="no content in stream")
    tokens = usage_tokens or events
    tpot = (last - first) / (tokens - 1) if tokens > 1 and last is not None else None
    return Result(True, first - start, tpot, end - start, lag_s, tokens, replica=replica,
                  reason=reason)


async def _sampler(session: aiohttp.ClientSession, urls: Sequence[str], stop: asyncio.Event,
                   out: list[float], engine: str = "vllm") -> None:
    """Every ~0.5 s: max over mean of the replicas' running + waiting (if the mean is >= 1)."""
    while not stop.is_set():
        snap = await scrape_all(session, urls, _WANTED, timeout_s=2.0, engine=engine)
        loads = [m[RUNNING] + m[WAITING] for m in snap if m is not None]
        if loads and len(loads) == len(urls):
            mean = sum(loads) / len(loads)
            if mean >= 1:
                out.append(max(loads) / mean)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_INTERVAL_S)


async def _sync_shadow(session: aiohttp.ClientSession, url: str, shadow: ReplayShadow,
                       stop: asyncio.Event) -> None:
    """Every SHADOW_SYNC_S until `stop`: `shadow.sync` from the router's `/admin/stats` (a
    router that does not answer it leaves the shadow with what it has)."""
    stats_url = url.rstrip("/") + "/admin/stats"
    while not stop.is_set():
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with session.get(stats_url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                if resp.status == 200:
                    shadow.sync(orjson.loads(await resp.read()))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), SHADOW_SYNC_S)


@dataclass
class RunData:
    results: list[Result] = field(default_factory=list)
    duration_s: float = 0.0
    before: list[dict[str, float] | None] = field(default_factory=list)
    after: list[dict[str, float] | None] = field(default_factory=list)
    inflight_ratios: list[float] = field(default_factory=list)
    gateways: int = 1  # results[i] was sent to router i mod gateways
    shadow: ReplayShadow | None = None


def router_urls(text: str) -> list[str]:
    """`--url`'s comma-separated router base URLs."""
    return [u.strip() for u in text.split(",") if u.strip()]


async def replay(url: str | Sequence[str], replica_urls: Sequence[str],
                 requests: Sequence[TraceRequest], opts: ReplayOptions,
                 shadow: ReplayShadow | None = None) -> RunData:
    """Send every request at its (scaled) time, open loop, and read the replicas around it.

    `url` is one router or several: request i goes to router i mod len(url), as a round-robin
    load balancer in front of them would send it. With `shadow`, it is asked where one gateway
    would send each request and follows every request's life; every SHADOW_SYNC_S it copies
    what the first router's `/admin/stats` says it learned from the engines.
    """
    urls = router_urls(url) if isinstance(url, str) else list(url)
    if not urls:
        raise ValueError("no router URL")
    endpoints = [u.rstrip("/") + "/v1/completions" for u in urls]
    # limit=0: no cap on connections, so the pool never delays an open-loop arrival.
    connector = aiohttp.TCPConnector(limit=opts.concurrency_limit or 0, ttl_dns_cache=300,
                                     keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=opts.timeout_s, sock_connect=10)
    data = RunData(gateways=len(endpoints), shadow=shadow)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session, \
            aiohttp.ClientSession() as metrics_session:
        data.before = await scrape_all(metrics_session, replica_urls, _WANTED,
                                       engine=opts.engine)
        stop = asyncio.Event()
        sampler = asyncio.create_task(
            _sampler(metrics_session, replica_urls, stop, data.inflight_ratios, opts.engine))
        syncer = (asyncio.create_task(_sync_shadow(metrics_session, urls[0], shadow, stop))
                  if shadow is not None else None)
        sem = asyncio.Semaphore(opts.concurrency_limit) if opts.concurrency_limit else None
        loop = asyncio.get_running_loop()
        t0 = loop.time() + 0.2
        wall0 = time.perf_counter()

        async def fire(endpoint: str, i: int, req: TraceRequest) -> Result:
            stream = streams(i, opts.stream_share)
            if sem is None:
                return await _send(session, endpoint, req, opts,
                                   loop.time() - t0 - req.timestamp_s, shadow, i, stream)
            async with sem:
                return await _send(session, endpoint, req, opts,
                                   loop.time() - t0 - req.timestamp_s, shadow, i, stream)

        tasks = []
        for i, req in enumerate(requests):
            delay = t0 + req.timestamp_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(fire(endpoints[i % len(endpoints)], i, req)))
        data.results = list(await asyncio.gather(*tasks))
        data.duration_s = time.perf_counter() - wall0
        stop.set()
        await sampler
        if syncer is not None:
            await syncer
        # Engines update their counters when a request finishes; give them a moment.
        await asyncio.sleep(0.3)
        data.after = await scrape_all(metrics_session, replica_urls, _WANTED,
                                      engine=opts.engine)
    return data


# -- report ----------------------------------------------------------------------------------


def summarize(data: RunData, requests: Sequence[TraceRequest], policy: str,
              prefill_rates: Sequence[float] | None = None) -> dict[str, Any]:
    """The run's report; with each replica's prefill rate (tokens/s, in replica order) it
    adds `prefill_time_imbalance`: max over mean of uncached prompt tokens / rate."""
    ok = [r for r in data.results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    lags = [r.lag_s for r in data.results]
    errors = [r.error for r in data.results if not r.ok]
    per_req, per_prefill, hits = [], [], []
    queries = 0.0
    hit_total = 0.0
    engine_ttft_sum = engine_ttft_count = preemptions = 0.0
    complete = all(m is not None for m in data.before + data.after) and data.before
    if complete:
        for b, a in zip(data.before, data.after, strict=True):
            assert a is not None and b is not None
            dq, dh = a[QUERIES] - b[QUERIES], a[HITS] - b[HITS]
            per_req.append(a[SUCCESS] - b[SUCCESS])
            per_prefill.append(dq - dh)
            hits.append(dh)
            queries += dq
            hit_total += dh
            engine_ttft_sum += a.get(ENGINE_TTFT_SUM, 0.0) - b.get(ENGINE_TTFT_SUM, 0.0)
            engine_ttft_count += a.get(ENGINE_TTFT_COUNT, 0.0) - b.get(ENGINE_TTFT_COUNT, 0.0)
            preemptions += a.get(PREEMPTIONS, 0.0) - b.get(PREEMPTIONS, 0.0)
    out: dict[str, Any] = {
        "policy": policy,
        "requests": len(data.results),
        "errors": len(errors),
        "duration_s": round(data.duration_s, 3),
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
        # Every request's, streamed or not, as the engines measured it (from their arrival:
        # the router's own time is not in it).
        "engine_ttft_mean_s": (engine_ttft_sum / engine_ttft_count
                               if engine_ttft_count > 0 else None),
        "streamed": len(ttfts),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p90_s": percentile(ttfts, 0.9),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "tpot_p50_s": percentile(tpots, 0.5),
        "hit_ratio": hit_total / queries if queries > 0 else None,
        "ideal_hit_ratio": ideal_hit_ratio(requests),
        "imbalance": max_over_mean(per_req),
        "prefill_imbalance": max_over_mean(per_prefill),
        "prefill_time_imbalance": (
            max_over_mean(prefill_seconds(per_prefill, prefill_rates))
            if prefill_rates and per_prefill else None),
        "peak_inflight_imbalance": max(data.inflight_ratios) if data.inflight_ratios else None,
        "latency_p50_s": percentile([r.latency_s for r in ok], 0.5),
        "send_lag_p99_s": percentile(lags, 0.99),
        "requests_per_replica": [int(x) for x in per_req],
        "prefill_tokens_per_replica": [int(x) for x in per_prefill],
        "output_tokens": sum(r.tokens for r in ok),
        # Running requests the engines preempted for KV (vLLM's counter; trtllm-serve's
        # default scheduler reserves KV and never does).
        "engine_preemptions": int(preemptions) if complete else None,
        "input_tokens": sum(r.input_tokens for r in requests),
    }
    served = [r.replica if r.ok else None for r in data.results]
    reasons = [r.reason for r in data.results]
    n = max(1, data.gateways)
    out.update(gateways=data.gateways, **agreement_figures(requests, served, reasons))
    if data.shadow is not None:
        out.update(data.shadow.figures(requests, served))
    out.update(
        requests_per_gateway=[len(range(g, len(data.results), n)) for g in range(n)],
        errors_per_gateway=[sum(not r.ok for r in data.results[g::n]) for g in range(n)])
    if errors:
        out["first_errors"] = errors[:3]
    if not complete:
        out["metrics_error"] = "some replica /metrics could not be read; cache figures omitted"
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 100 else f"{v:.1f}"
    if isinstance(v, list):
        return " ".join(str(x) for x in v)
    return str(v)


def add_stream_share(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stream-share", type=float, default=1.0,
                   help="share of requests sent streaming, spread evenly (0-1); the others "
                   "are sent non-streaming, and only the engines see their TTFT "
                   "(engine_ttft_mean_s)")


def render_table(res: dict[str, Any]) -> str:
    rows = [(k, _fmt(res.get(k))) for k in (
        "policy", "requests", "errors", "duration_s", "streamed", "ttft_mean_s", "ttft_p50_s",
        "ttft_p90_s", "ttft_p99_s", "engine_ttft_mean_s", "tpot_p50_s", "hit_ratio",
        "ideal_hit_ratio", "imbalance",
        "prefill_imbalance", "prefill_time_imbalance", "peak_inflight_imbalance", "gateways",
        "agreement", "agreement_last", "warm_requests", "warm_miss_reasons",
        "shadow_agreement", "shadow_match_agreement", "shadow_held_agreement",
        "shadow_held_requests", "latency_p50_s", "send_lag_p99_s", "requests_per_replica",
        "requests_per_gateway",
        "gateway_cpu_ms_per_request")]
    return markdown_table(["metric", "value"], rows)


# -- the gateway in front of simulated replicas ------------------------------------------


def gateway_config(replica_urls: Sequence[str], policy: str | None,
                   routing: dict[str, Any] | None = None,
                   redis: dict[str, Any] | None = None, workers: int = 1,
                   engine: str = "vllm") -> dict[str, Any]:
    """The configuration of replay's gateways: one pool of the replicas (the policy left out
    means the gateway's), with `redis` that `redis` section, with `workers` above one its
    server.workers; port 0 (each gateway gets its own)."""
    routing = {**(routing or {}), **({"policy": policy} if policy else {})}
    # Lenient health checks: with sims, gateway and client sharing a few cores, a starved
    # event loop can fail 2 s checks for every replica at once (a 32-replica run got 216
    # 503s); this measures routing, not failure detection.
    cfg = one_pool_config(list(replica_urls), 0, pool="replay", engine=engine, models=(MODEL,),
                          replica_prefix="sim", routing=routing or None,
                          health={"timeout_s": 10.0, "failure_threshold": 3},
                          server={"workers": workers} if workers > 1 else None)
    if redis:
        cfg["redis"] = dict(redis)
    return cfg


def redis_section(url: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The gateways' `redis` section for one run: `url`, a key prefix of the run's own (so no
    state of an earlier run in the same Redis is read), and `extra` keys (which may name
    another `key_prefix`)."""
    return {"url": url, "key_prefix": f"replay-{uuid.uuid4().hex[:10]}:", **(extra or {})}


def start_gateways(fleet: Fleet, cfg: dict[str, Any], count: int = 1,
                   name: str = "gateway") -> list[tuple[str, subprocess.Popen]]:
    """`count` gateway processes on one configuration (`gateway_config`'s), each on a port of
    its own, once every one answers /ready: [(URL, process)]. Their configs and logs are
    `NAME-I.yaml` and `NAME-I.log` in the fleet's log directory (`NAME.*` for one)."""
    out = []
    for i, port in enumerate(processes.free_ports(count)):
        one = {**cfg, "server": {**cfg["server"], "port": port}}
        out.append(fleet.start_gateway_config(one, name if count == 1 else f"{name}-{i}"))
    return out


def start_gateway(fleet: Fleet, replica_urls: Sequence[str], policy: str | None,
                  routing: dict[str, Any] | None = None, name: str = "gateway",
                  engine: str = "vllm") -> tuple[str, subprocess.Popen]:
    """One gateway with one pool of the replicas; the policy left out means the gateway's."""
    return start_gateways(fleet, gateway_config(replica_urls, policy, routing, engine=engine),
                          name=name)[0]


def cpu_seconds(procs: Sequence[subprocess.Popen]) -> float | None:
    """User + system CPU the processes have used so far; None if one has gone."""
    try:
        return sum(process_cpu_seconds(p.pid) for p in procs)
    except OSError:
        return None


def sim_conditions(args: argparse.Namespace) -> dict[str, Any]:
    """The simulated replicas a run drove, as its result records them (replay's arguments,
    which compare_http and gateways share)."""
    out = {"replicas": args.replicas, "kv_capacity_tokens": args.kv_capacity_tokens,
           "profile": args.profile, "time_scale": args.time_scale}
    if getattr(args, "fleet", None) or getattr(args, "slow", None):
        out["fleet"] = describe(sim_fleet(args))
    if getattr(args, "engine", "vllm") != "vllm":
        out["engine"] = args.engine
    if getattr(args, "vllm_engines", False):
        out["vllm_engines"] = True
    return out


def start_sim_fleet(fleet: Fleet, args: argparse.Namespace) -> tuple[list[str], list[Any]]:
    """Start on `fleet` the simulated replicas that --replicas, --profile, --fleet and --slow
    describe (`args.replicas` set to their count): their base URLs and ReplicaProfiles."""
    sims = sim_fleet(args)
    args.replicas = len(sims)
    engine = getattr(args, "engine", "vllm")
    vllm_engines = getattr(args, "vllm_engines", False)
    if vllm_engines and engine != "vllm":
        raise SystemExit(f"{sys.argv[0]}: --vllm-engines needs --engine vllm")
    urls = fleet.start_sims(args.replicas, args.kv_capacity_tokens, args.profile,
                            args.time_scale, fleet=getattr(args, "fleet", None),
                            slow=getattr(args, "slow", None), engine=engine,
                            vllm_engines=vllm_engines)
    return urls, sims


def sim_fleet(args: argparse.Namespace) -> list[Any]:
    """Each simulated replica's ReplicaProfile from --replicas, --profile, --fleet, --slow
    (argparse errors are raised as SystemExit)."""
    try:
        return fleet_profiles(args.replicas, args.profile, getattr(args, "fleet", None),
                              getattr(args, "slow", None))
    except ValueError as exc:
        raise SystemExit(f"{sys.argv[0]}: {exc}") from None


def add_fleet_arguments(p: argparse.ArgumentParser) -> None:
    """--replicas, --fleet and --slow: the simulated replicas and their speeds."""
    p.add_argument("--replicas", type=int, default=None,
                   help="simulated replicas (default 8, or the --fleet's count)")
    p.add_argument("--fleet", default=None, help=FLEET_HELP)
    p.add_argument("--slow", default=None, help=SLOW_HELP)
    p.add_argument("--engine", choices=("vllm", "trtllm"), default="vllm",
                   help="the simulated replicas' engine: vLLM, or trtllm-serve (JSON iteration "
                        "stats, and its Prometheus page as with return_perf_metrics)")
    p.add_argument("--vllm-engines", action="store_true",
                   help="the simulated vLLM replicas take KV blocks as tokens need them, "
                        "preempt when none is left and keep finished outputs cached, as vLLM "
                        "does (default: they reserve prompt plus max_tokens and free outputs)")


def default_policy() -> str:
    return str(RoutingSettings().policy)


# -- command line ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Mooncake-format JSONL file, or a RAGPulse directory")
    src.add_argument("--workload", choices=sorted(SYNTHETIC), help="a synthetic workload")
    add_workload_param(p)
    add_fleet_arguments(p)
    p.add_argument("--policy", default=None,
                   help=f"gateway routing policy (default: the gateway's, {default_policy()})")
    p.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    p.add_argument("--speedup", type=float, default=1.0, help="divide arrival times by this")
    p.add_argument("--max-output", type=int, default=DEFAULT_MAX_OUTPUT,
                   help=f"cap on max_tokens (default {DEFAULT_MAX_OUTPUT})")
    p.add_argument("--kv-capacity-tokens", type=int, default=DEFAULT_KV_CAPACITY_TOKENS,
                   help=f"simulated KV cache per replica (default {DEFAULT_KV_CAPACITY_TOKENS}"
                   f" = 1,000 blocks of {BLOCK_TOKENS} tokens)")
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help=f"simulated latency profile (default {DEFAULT_PROFILE})")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply simulated latencies (0.1 = ten times faster engines)")
    p.add_argument("--gateway-workers", type=int, default=1, help="server.workers of the "
                   "gateway replay starts (serve --workers): routing state is per worker")
    p.add_argument("--gateways", type=int, default=1,
                   help="gateway processes to start on one config, request i to gateway i mod "
                   "N as a round-robin load balancer would send it (without --url; default 1)")
    redis = p.add_mutually_exclusive_group()
    redis.add_argument("--redis", action="store_true",
                       help="start a redis-server on a free port and give the gateways its URL "
                       "(config `redis: {url: ...}`)")
    redis.add_argument("--redis-url", help="give the gateways this Redis (config `redis.url`)")
    p.add_argument("--redis-set", action="append", default=[], metavar="KEY=VALUE",
                   type=key_value, help="another key of the gateways' `redis` section "
                   "(repeatable; with --redis or --redis-url)")
    p.add_argument("--url", help="drive these running OpenAI-compatible routers instead "
                   "(comma-separated: request i to router i mod N)")
    p.add_argument("--replica-urls", default="",
                   help="comma-separated replica base URLs whose /metrics to read (with --url)")
    add_routing_settings(p, "; without --url")
    p.add_argument("--shadow", nargs="?", const="", default=None, metavar="CONFIG",
                   help="ask a shadow single gateway, in the client, where one gateway would "
                   "send each request, and report shadow_agreement; with --url, CONFIG is the "
                   "routers' configuration file (their first pool's routing and replicas)")
    p.add_argument("--label", help="policy name to report (default: the policy, or 'external')")
    p.add_argument("--model", default=MODEL, help="model name to send")
    p.add_argument("--concurrency-limit", type=int, default=0,
                   help="cap on requests in flight (default 0: none, pure open loop)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    add_stream_share(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON on the last line")
    p.add_argument("--output", help="append the JSON result to this JSONL file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    requests = load_requests(args.trace, args.workload, args.limit, args.speedup,
                             dict(args.workload_param), from_zero=True)
    if not requests:
        raise SystemExit("replay: no requests to send")
    fleet = Fleet()
    try:
        with sigterm_as_interrupt():
            gateways: list[subprocess.Popen] = []
            redis_url = None
            if args.url:
                if args.settings:
                    raise SystemExit("replay: --set configures the gateway replay starts; "
                                     "not with --url")
                if args.gateways != 1 or args.redis or args.redis_url or args.redis_set:
                    raise SystemExit("replay: --gateways and --redis* configure the gateways "
                                     "replay starts; not with --url")
                urls = router_urls(args.url)
                replica_urls = router_urls(args.replica_urls)
                policy = args.label or "external"
                if args.shadow == "":
                    raise SystemExit("replay: --shadow with --url needs the routers' "
                                     "configuration file: --shadow CONFIG")
                shadow = (replay_shadow(load_config(args.shadow), requests)
                          if args.shadow else None)
            else:
                if args.replica_urls:
                    raise SystemExit("replay: --replica-urls needs --url")
                if args.shadow:
                    raise SystemExit("replay: --shadow CONFIG is for --url; the gateways "
                                     "replay starts need --shadow alone")
                if args.gateways < 1:
                    raise SystemExit("replay: --gateways must be at least 1")
                if args.redis_set and not (args.redis or args.redis_url):
                    raise SystemExit("replay: --redis-set needs --redis or --redis-url")
                redis_url = fleet.start_redis() if args.redis else args.redis_url
                redis = redis_section(redis_url, dict(args.redis_set)) if redis_url else None
                replica_urls, sims = start_sim_fleet(fleet, args)
                rates = [r.build().prefill_tokens_per_s for r in sims]
                cfg = gateway_config(replica_urls, args.policy, dict(args.settings), redis,
                                     args.gateway_workers, engine=args.engine)
                started = start_gateways(fleet, cfg, args.gateways)
                urls = [u for u, _ in started]
                gateways = [proc for _, proc in started]
                shadow = (replay_shadow(cfg, requests) if args.shadow is not None
                          else None)
                policy = args.label or args.policy or default_policy()
                log(f"{args.replicas} simulated replicas ({describe(sims)}, time scale "
                    f"{args.time_scale}, {args.kv_capacity_tokens} KV tokens each) and "
                    f"{len(urls)} gateway(s) ({policy}"
                    f"{f', Redis {redis_url}' if redis_url else ''}) at {', '.join(urls)}; "
                    f"logs in {fleet.log_dir}")
            if not urls:
                raise SystemExit("replay: --url names no router")
            span = requests[-1].timestamp_s
            log(f"replaying {len(requests)} requests over {span:.1f} s to {', '.join(urls)}")
            opts = ReplayOptions(args.max_output, args.concurrency_limit, args.timeout,
                                 args.model, policy, args.stream_share, engine=args.engine)
            cpu_before = cpu_seconds(gateways) if gateways else None
            data = run_async(replay(urls, replica_urls, requests, opts, shadow))
            cpu_after = cpu_seconds(gateways) if gateways else None
            res = summarize(data, requests, policy, None if args.url else rates)
            if not args.url:
                res.update(sim_conditions(args), redis=redis_url is not None,
                           log_dir=str(fleet.log_dir))
                if cpu_before is not None and cpu_after is not None:
                    # Every gateway process's CPU over the replay (health checks included).
                    res["gateway_cpu_ms_per_request"] = (
                        1000 * (cpu_after - cpu_before) / len(requests))
            res.update(speedup=args.speedup, max_output=args.max_output,
                       source=args.workload or os.path.basename(str(args.trace).rstrip("/")))
            print(render_table(res), end="", flush=True)
            emit_json(res, args.json, args.output)
    except KeyboardInterrupt:
        log("interrupted; stopping")
        return 130
    finally:
        fleet.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
