"""Routing benchmark on real vLLM CPU replicas: TTFT and the engines' own prefix-cache hits.

Starts N real vLLM CPU replicas (backends/vllm_cpu/launch.py) with a KV cache sized so that
every tenant's system prompt fits in the fleet's caches together but not in one replica's,
then for each policy (and, for prefix_affinity, each `hashing` mode): resets the engines'
prefix caches (POST /reset_prefix_cache), starts a gateway process with that policy, runs the
same multi-tenant multi-turn streaming chat workload through /v1/chat/completions with a few
concurrent users, and stops the gateway. TTFT is client-side (first chunk with content; the
first chat chunk is role-only); the hit ratio is the engines' own (delta of
vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total over the run). Then the same
policies again on replicas whose cache holds every tenant (control, no pressure).
It has its own client because loadtests.replay sends /v1/completions with Mooncake-block
text, so it cannot replay a chat workload.

    python -m loadtests.vllm_bench --json --output /tmp/vllm-bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from backends.vllm_cpu import launch
from gateway.processes import consecutive_free_ports
from loadtests.caches import reset_prefix_caches
from loadtests.fleet import MODEL, Fleet, run_async, sigterm_as_interrupt
from loadtests.metrics import (
    ENGINE_QUEUE,
    ENGINE_TTFT,
    HITS,
    KV_USAGE,
    PREEMPTIONS,
    QUERIES,
    RUNNING,
    WAITING,
    labelled_values,
    parse_sums,
    scrape,
)
from loadtests.metrics import GATEWAY_PREFIX_BLOCKS as EXPECTED_BLOCKS
from loadtests.metrics import GATEWAY_TTFT as GW_TTFT
from loadtests.report import cell, markdown_table, median_range
from loadtests.settings import key_value
from loadtests.sse import data_events
from loadtests.stats import median, percentile
from loadtests.traces import WORDS

COUNTERS = (HITS, QUERIES, f"{ENGINE_TTFT}_sum", f"{ENGINE_TTFT}_count", f"{ENGINE_QUEUE}_sum",
            f"{ENGINE_QUEUE}_count", PREEMPTIONS)
GAUGES = (WAITING, RUNNING, KV_USAGE)
VARIANTS = ("round_robin", "least_load", "prefix_affinity", "prefix_affinity+engine_tokens")


def log(msg: str) -> None:
    print(f"vllm_bench: {msg}", file=sys.stderr, flush=True)


# -- workload ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    """One chat request: a user's turn, with the tenant's system prompt and the history."""

    tenant: int
    user: int
    turn: int
    messages: tuple[dict[str, str], ...]


@dataclass
class Workload:
    """The requests in issue order, and the facts needed to size the KV cache."""

    turns: list[Turn]
    system_tokens: list[int]
    max_prompt_tokens: int = 0
    prompt_tokens: dict[tuple[int, int, int], int] = field(default_factory=dict)


def words(seed: int, n: int) -> str:
    """``n`` deterministic words of seed ``seed``."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def fit_words(target_tokens: int, count: Callable[[int], int], start: int) -> int:
    """Word count whose text has at most ``target_tokens`` tokens, close to it (few calls)."""
    n = max(1, start)
    for _ in range(6):
        c = count(n)
        if abs(c - target_tokens) <= 8:
            break
        n = max(1, round(n * target_tokens / max(1, c)))
    while n > 1 and count(n) > target_tokens:
        n -= max(1, n // 100)
    return n


def system_targets(tenants: int, lo: int, hi: int) -> list[int]:
    """System-prompt lengths spread evenly over [lo, hi] tokens."""
    if tenants == 1:
        return [(lo + hi) // 2]
    return [round(lo + (hi - lo) * i / (tenants - 1)) for i in range(tenants)]


def build_turns(system: Sequence[str], users: int, turns: int, user_words: int,
                reply_words: int, seed: int) -> list[Turn]:
    """Rounds of turns: in round k every user sends turn k, users shuffled per round.

    A user's history grows each round by its previous message and a deterministic reply (not
    the model's output, so every policy sees byte-identical prompts).
    """
    rng = random.Random(seed)
    history: dict[tuple[int, int], list[dict[str, str]]] = {}
    out: list[Turn] = []
    keys = [(t, u) for t in range(len(system)) for u in range(users)]
    for k in range(turns):
        order = keys[:]
        rng.shuffle(order)
        for t, u in order:
            h = history.setdefault((t, u), [{"role": "system", "content": system[t]}])
            ident = 1_000_000 * (t + 1) + 1000 * u + k
            msg = f"User {u} of tenant {t}, turn {k}: " + words(ident, user_words)
            h.append({"role": "user", "content": msg})
            out.append(Turn(t, u, k, tuple(h)))
            h.append({"role": "assistant", "content": words(ident + 500, reply_words)})
    return out


def build_workload(tok: Callable[[dict[str, Any]], int], tenants: int, sys_lo: int,
                   sys_hi: int, users: int, turns: int, user_tokens: int, reply_tokens: int,
                   seed: int) -> Workload:
    """Fit system prompts to token targets with the engine's tokenizer, then build turns."""
    system, counts = [], []
    for t, target in enumerate(system_targets(tenants, sys_lo, sys_hi)):
        head = f"You are the assistant of tenant {t}. Follow its manual: "

        def count(n: int, head: str = head, t: int = t) -> int:
            return tok({"prompt": head + words(seed * 7919 + t, n)})

        n = fit_words(target, count, target // 2)
        system.append(head + words(seed * 7919 + t, n))
        counts.append(count(n))
    per_word = max(0.5, counts[0] / max(1, len(system[0].split())))
    user_words = max(4, round(user_tokens / per_word))
    reply_words = max(4, round(reply_tokens / per_word))
    wl = Workload(build_turns(system, users, turns, user_words, reply_words, seed), counts)
    for tr in wl.turns:
        if tr.turn == turns - 1 or tr.turn == 0:
            n = tok({"messages": list(tr.messages)})
            wl.prompt_tokens[(tr.tenant, tr.user, tr.turn)] = n
            wl.max_prompt_tokens = max(wl.max_prompt_tokens, n)
    return wl


def kv_blocks_for(tokens: float, block: int) -> int:
    """Whole KV blocks that hold ``tokens`` tokens."""
    return math.ceil(tokens / block)


def kv_gib(blocks: int, block: int, bytes_per_token: int) -> float:
    """KV memory (GiB, a little over) for ``blocks`` blocks, so the block cap is what binds."""
    return round(blocks * block * bytes_per_token * 1.05 / launch.GiB + 0.01, 3)


# -- client ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Result:
    """One request as the client saw it."""

    tenant: int
    turn: int
    ok: bool
    ttft_s: float | None = None
    latency_s: float = 0.0
    replica: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    expected_match: float | None = None
    """The share of the prompt's blocks the gateway's index held on the replica it chose
    (its `x-gateway-prefix-match` header)."""
    sent_s: float = 0.0
    """When it was sent (perf_counter seconds)."""
    first_token_s: float | None = None
    """When its first content token came (perf_counter seconds; None: none came)."""


async def send_chat(s: aiohttp.ClientSession, url: str, tr: Turn, max_tokens: int) -> Result:
    """Stream one chat request; TTFT is the first chunk whose delta has content."""
    body = {"model": MODEL, "messages": list(tr.messages), "max_tokens": max_tokens,
            "min_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    res = Result(tr.tenant, tr.turn, False)
    t0 = res.sent_s = time.perf_counter()
    try:
        async with s.post(url + "/v1/chat/completions", data=orjson.dumps(body),
                          headers={"Content-Type": "application/json"}) as r:
            res.replica = r.headers.get("x-gateway-replica", "")
            match = r.headers.get("x-gateway-prefix-match")
            res.expected_match = float(match) if match else None
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return res
            async for data in data_events(r.content):
                chunk = orjson.loads(data)
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = int(details.get("cached_tokens") or 0)
                if res.ttft_s is None:
                    choices = chunk.get("choices") or [{}]
                    if (choices[0].get("delta") or {}).get("content"):
                        res.first_token_s = time.perf_counter()
                        res.ttft_s = res.first_token_s - t0
    except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
        return res
    res.latency_s = time.perf_counter() - t0
    res.ok = res.ttft_s is not None
    if not res.ok:
        res.error = "no content in stream"
    return res


async def drive(url: str, turns: Sequence[Turn], concurrency: int,
                max_tokens: int) -> tuple[list[Result], float]:
    """Closed loop: ``concurrency`` workers take turns in order; a user's turn waits for the
    previous one (its history includes it)."""
    done: dict[tuple[int, int, int], asyncio.Event] = {
        (t.tenant, t.user, t.turn): asyncio.Event() for t in turns}
    queue: asyncio.Queue[Turn] = asyncio.Queue()
    for t in turns:
        queue.put_nowait(t)
    results: list[Result] = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=600)) as s:
        async def worker() -> None:
            while not queue.empty():
                tr = queue.get_nowait()
                prev = done.get((tr.tenant, tr.user, tr.turn - 1))
                if prev is not None:
                    await prev.wait()
                results.append(await send_chat(s, url, tr, max_tokens))
                done[(tr.tenant, tr.user, tr.turn)].set()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - t0


async def sample_engines(urls: Sequence[str], stop: asyncio.Event, out: list[list[float]],
                         tok_url: str | None, tok_body: dict[str, Any] | None,
                         tok_out: list[float]) -> None:
    """Every 0.5 s: each replica's waiting, running, KV usage; optionally time one /tokenize."""
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            try:
                snaps = await asyncio.gather(*(scrape(s, u, GAUGES) for u in urls))
                out.append([v for m in snaps for v in (m[WAITING], m[RUNNING], m[KV_USAGE])])
                if tok_url and tok_body:
                    t0 = time.perf_counter()
                    async with s.post(tok_url + "/tokenize", data=orjson.dumps(tok_body),
                                      headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                    tok_out.append(time.perf_counter() - t0)
            except (TimeoutError, aiohttp.ClientError):
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)


# -- one run ---------------------------------------------------------------------------------


def parse_variant(variant: str) -> tuple[str, str, float | None]:
    """``policy[+hashing][@chars_per_token][/KEY=VALUE...]`` -> (policy, hashing,
    chars_per_token); the KEY=VALUE routing settings come from `variant_settings`."""
    head, _, cpt = variant.split("/")[0].partition("@")
    policy, _, mode = head.partition("+")
    return policy, mode or "chars", float(cpt) if cpt else None


def variant_settings(variant: str) -> dict[str, Any]:
    """The ``/KEY=VALUE`` routing settings of a variant, e.g. ``/prefill_tokens_per_s=0``."""
    return dict(key_value(item) for item in variant.split("/")[1:])


def start_gateway(fleet: Fleet, urls: Sequence[str], policy: str, hashing: str, name: str,
                  chars_per_token: float | None = None,
                  settings: dict[str, Any] | None = None) -> tuple[str, Any]:
    """A gateway with one pool of the vLLM replicas and this policy, hashing mode and other
    settings, once it answers /ready."""
    routing: dict[str, Any] = {**(settings or {}), "policy": policy, "hashing": hashing}
    if chars_per_token:
        routing["chars_per_token"] = chars_per_token
    return fleet.start_gateway(urls, name, deadline_s=180, pool="bench", models=(MODEL,),
                               replica_prefix="vllm", routing=routing,
                               health={"interval_s": 1.0, "metrics_interval_s": 0.5})


def expected_blocks(text: str) -> tuple[float, float]:
    """(hit, miss) blocks the gateway expected, summed over its pools and replicas, from its
    metrics page `text`."""
    hit = miss = 0.0
    for labels, value in labelled_values(text, EXPECTED_BLOCKS):
        if labels.get("result") == "hit":
            hit += value
        elif labels.get("result") == "miss":
            miss += value
    return hit, miss


def gateway_page_figures(text: str) -> dict[str, Any]:
    """What a run diffs of the gateway's metrics page `text`: its TTFT histogram's sum and
    count, and under "expected" its `expected_blocks`."""
    return {**parse_sums(text, (f"{GW_TTFT}_sum", f"{GW_TTFT}_count")),
            "expected": expected_blocks(text)}


async def gateway_figures(session: aiohttp.ClientSession, gw_url: str) -> dict[str, Any]:
    """`gateway_page_figures` of the gateway at `gw_url` now, from one read of its page."""
    async with session.get(gw_url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
        r.raise_for_status()
        return gateway_page_figures(await r.text())


def expected_hit_ratio(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """The share of the prompt blocks routed between two `expected_blocks` readings that the
    gateway expected to hit; None if none was routed."""
    hit, miss = after[0] - before[0], after[1] - before[1]
    return hit / (hit + miss) if hit + miss > 0 else None


def belief_gaps(results: Sequence[Result], block_tokens: int) -> dict[str, Any] | None:
    """Where the gateway's index believed more of a prompt cached than the engine found.

    Per request, the gateway's expected share (its prefix-match header) of the prompt's tokens
    against the engine's `cached_tokens`. A request is `short` when the engine held more than
    one KV block less than expected (less is rounding: the two count in different blocks);
    `in_flight` when, as it was sent, an earlier request of its tenant on the same replica had
    not returned its first token (the shared prefix was sent there but not yet computed);
    `engine_cold` when the engine held less than one block of it. Points are shares of all
    prompt tokens. None without requests that carry both figures.
    """
    ok = [r for r in results if r.ok]
    rows = [r for r in ok if r.expected_match is not None and r.prompt_tokens]
    if not rows:
        return None
    prompt = sum(r.prompt_tokens for r in rows)

    def expected(r: Result) -> float:
        assert r.expected_match is not None
        return r.expected_match * r.prompt_tokens

    def shortfall(r: Result) -> float:
        return expected(r) - r.cached_tokens

    def behind_in_flight(r: Result) -> bool:
        return any(o is not r and o.replica == r.replica and o.tenant == r.tenant
                   and o.sent_s < r.sent_s
                   and (o.first_token_s is None or o.first_token_s > r.sent_s) for o in ok)

    short = [r for r in rows if shortfall(r) > block_tokens]
    in_flight = [r for r in short if behind_in_flight(r)]
    return {
        "requests": len(rows),
        "expected_cached_ratio": sum(expected(r) for r in rows) / prompt,
        "engine_cached_ratio": sum(r.cached_tokens for r in rows) / prompt,
        "short": len(short),
        "short_points": sum(shortfall(r) for r in short) / prompt,
        "in_flight": len(in_flight),
        "in_flight_points": sum(shortfall(r) for r in in_flight) / prompt,
        "engine_cold": sum(1 for r in short if r.cached_tokens < block_tokens),
    }


async def run_once(urls: Sequence[str], gw_url: str, wl: Workload, concurrency: int,
                   max_tokens: int, tokenize_probe: bool, block_tokens: int) -> dict[str, Any]:
    """Reset caches, drive the workload through the gateway, diff the engines' counters."""
    # Blocking, in a thread: nothing else runs on this loop yet.
    await asyncio.to_thread(reset_prefix_caches, urls)
    async with aiohttp.ClientSession() as s:
        before = await asyncio.gather(*(scrape(s, u, COUNTERS) for u in urls))
        gw_before = await gateway_figures(s, gw_url)
    stop = asyncio.Event()
    samples: list[list[float]] = []
    tok_times: list[float] = []
    probe = wl.turns[len(wl.turns) // 2]
    sampler = asyncio.create_task(sample_engines(
        urls, stop, samples, urls[0] if tokenize_probe else None,
        {"model": MODEL, "messages": list(probe.messages), "add_generation_prompt": True},
        tok_times))
    results, wall = await drive(gw_url, wl.turns, concurrency, max_tokens)
    stop.set()
    await sampler
    await asyncio.sleep(1.0)  # counters and the gateway's histograms settle after the last byte
    async with aiohttp.ClientSession() as s:
        after = await asyncio.gather(*(scrape(s, u, COUNTERS) for u in urls))
        gw_after = await gateway_figures(s, gw_url)
    return summarize(results, wall, before, after, gw_before, gw_after, samples, tok_times,
                     len(urls), block_tokens)


def _delta(before: Sequence[dict[str, float]], after: Sequence[dict[str, float]],
           key: str) -> list[float]:
    return [a[key] - b[key] for a, b in zip(after, before, strict=True)]


def summarize(results: Sequence[Result], wall: float, before: Sequence[dict[str, float]],
              after: Sequence[dict[str, float]], gw_before: dict[str, Any],
              gw_after: dict[str, Any], samples: Sequence[Sequence[float]],
              tok_times: Sequence[float], n: int, block_tokens: int = 128) -> dict[str, Any]:
    """Client TTFT percentiles, engine hit ratio and the gateway's expected one (and where
    they part, `belief_gaps` of engine blocks of `block_tokens`), preemptions, queueing,
    gateway-minus-engine TTFT."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    hits, queries = _delta(before, after, HITS), _delta(before, after, QUERIES)
    e_sum = sum(_delta(before, after, f"{ENGINE_TTFT}_sum"))
    e_cnt = sum(_delta(before, after, f"{ENGINE_TTFT}_count"))
    q_sum = sum(_delta(before, after, f"{ENGINE_QUEUE}_sum"))
    q_cnt = sum(_delta(before, after, f"{ENGINE_QUEUE}_count"))
    g_sum = gw_after[f"{GW_TTFT}_sum"] - gw_before[f"{GW_TTFT}_sum"]
    g_cnt = gw_after[f"{GW_TTFT}_count"] - gw_before[f"{GW_TTFT}_count"]
    per_replica: dict[str, int] = {}
    tenants_on: dict[str, set[int]] = {}
    for r in ok:
        per_replica[r.replica] = per_replica.get(r.replica, 0) + 1
        tenants_on.setdefault(r.replica, set()).add(r.tenant)
    waiting = [[row[3 * i] for row in samples] for i in range(n)]
    kv = [[row[3 * i + 2] for row in samples] for i in range(n)]
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "first_errors": [r.error for r in results if not r.ok][:3],
        "wall_s": round(wall, 2),
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p90_s": percentile(ttft, 0.9),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "engine_hit_ratio": sum(hits) / sum(queries) if sum(queries) else None,
        "gateway_expected_hit_ratio": expected_hit_ratio(gw_before["expected"],
                                                         gw_after["expected"]),
        "engine_preemptions": sum(_delta(before, after, PREEMPTIONS)),
        "belief": belief_gaps(results, block_tokens),
        "engine_hit_ratio_per_replica": [h / q if q else None for h, q in zip(hits, queries,
                                                                              strict=True)],
        "engine_prefill_tokens_per_replica": [int(q - h) for h, q in zip(hits, queries,
                                                                         strict=True)],
        "client_cached_ratio": (sum(r.cached_tokens for r in ok) / prompt) if prompt else None,
        "engine_ttft_mean_s": e_sum / e_cnt if e_cnt else None,
        "engine_queue_mean_s": q_sum / q_cnt if q_cnt else None,
        "gateway_ttft_mean_s": g_sum / g_cnt if g_cnt else None,
        "gateway_minus_engine_ttft_s": (g_sum / g_cnt - e_sum / e_cnt) if g_cnt and e_cnt
        else None,
        "requests_per_replica": dict(sorted(per_replica.items())),
        "tenants_per_replica": {k: sorted(v) for k, v in sorted(tenants_on.items())},
        "engine_waiting_mean": [round(statistics.fmean(w), 3) if w else None for w in waiting],
        "engine_waiting_max": [max(w) if w else None for w in waiting],
        "engine_kv_usage_max": [round(max(k), 3) if k else None for k in kv],
        "tokenize_under_load_s": {"n": len(tok_times), "p50": percentile(tok_times, 0.5),
                                  "p90": percentile(tok_times, 0.9)} if tok_times else None,
    }


def step_figures(gw_url: str) -> dict[str, Any]:
    """The gateway's prefill rate and per-replica engine step times, from /admin/stats."""
    with urllib.request.urlopen(gw_url + "/admin/stats", timeout=10) as r:
        pool = json.loads(r.read())["pools"][0]
    steps = [x["engine_step_s"] for x in pool["replicas"] if x["engine_step_s"] is not None]
    return {"prefill_tokens_per_s": pool["prefill_tokens_per_s"],
            "prefill_rate_learned": pool["prefill_rate_learned"],
            "engine_step_s": [round(v, 4) for v in steps]}


def run_variant(urls: Sequence[str], variant: str, wl: Workload, args: argparse.Namespace,
                fleet: Fleet, tag: str) -> dict[str, Any]:
    """One gateway process, one workload run, for a policy[+engine_tokens] variant."""
    policy, hashing, cpt = parse_variant(variant)
    settings = variant_settings(variant)
    suffix = "-".join(f"{k}{v}" for k, v in settings.items())
    gw_url, proc = start_gateway(fleet, urls, policy, hashing,
                                 f"gw-{tag}-{policy}-{hashing}-{cpt or ''}{suffix}", cpt,
                                 settings)
    try:
        res = run_async(run_once(urls, gw_url, wl, args.concurrency, args.max_tokens,
                                 tokenize_probe=hashing == "engine_tokens",
                                 block_tokens=args.block_size))
        res.update(step_figures(gw_url))
    finally:
        fleet.stop_process(proc)
    res.update(variant=variant, policy=policy, hashing=hashing, chars_per_token=cpt)
    return res


# -- /tokenize cost, idle ----------------------------------------------------------------------


async def tokenize_idle(url: str, wl: Workload, trials: int) -> dict[str, Any]:
    """Time POST /tokenize (chat messages) on an idle replica for the shortest/longest turns."""
    first = min(wl.turns, key=lambda t: len(json.dumps(t.messages)))
    last = max(wl.turns, key=lambda t: len(json.dumps(t.messages)))
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as s:
        for label, tr in (("shortest", first), ("longest", last)):
            body = orjson.dumps({"model": MODEL, "messages": list(tr.messages),
                                 "add_generation_prompt": True})
            times, count = [], 0
            for _ in range(trials):
                t0 = time.perf_counter()
                async with s.post(url + "/tokenize", data=body,
                                  headers={"Content-Type": "application/json"}) as r:
                    count = (await r.json())["count"]
                times.append(time.perf_counter() - t0)
            out[label] = {"tokens": count, "p50_s": percentile(times, 0.5),
                          "p90_s": percentile(times, 0.9), "min_s": min(times)}
    return out


# -- phases ----------------------------------------------------------------------------------


def tokenizer_of(url: str) -> Callable[[dict[str, Any]], int]:
    """A blocking token counter backed by the replica's POST /tokenize."""
    import urllib.request

    def count(body: dict[str, Any]) -> int:
        req = urllib.request.Request(url + "/tokenize", data=json.dumps(
            {"model": MODEL, **body}).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return int(json.loads(r.read())["count"])

    return count


def phase(label: str, args: argparse.Namespace, model_dir: Path, blocks: int,
          variants: Sequence[str], wl: Workload | None, fleet: Fleet,
          ) -> tuple[dict[str, Any], Workload]:
    """Start replicas with ``blocks`` KV blocks each, run every variant ``repeats`` times
    interleaved, stop the replicas."""
    base = consecutive_free_ports(args.replicas)
    gib = kv_gib(blocks, args.block_size,
                 args.kv_bytes_per_token or launch.kv_bytes_per_token())
    slow = 1 if args.slow_layers else 0
    log(f"[{label}] starting {args.replicas} replicas: {blocks} blocks x {args.block_size} "
        f"tokens each ({gib} GiB), max_model_len {args.max_model_len}"
        + (f"; the last of {args.slow_layers} layers (slower)" if slow else ""))
    t0 = time.monotonic()
    binds = launch.plan_cpu_binding(args.replicas)
    common = {"served_model_name": MODEL, "max_model_len": args.max_model_len,
              "log_dir": str(fleet.log_dir), "num_kv_blocks": blocks,
              "block_size": args.block_size}
    reps = launch.start_replicas(args.replicas - slow, model_dir, base, kv_cache_gib=gib,
                                 cpu_bind=binds[:args.replicas - slow], **common)
    if slow:
        try:
            # The same tokenizer and served name, more layers: one replica of the pool on
            # slower hardware.
            slow_dir = launch.ensure_model(Path(f"{model_dir}-{args.slow_layers}l"),
                                           layers=args.slow_layers)
            per_token = launch.kv_bytes_per_token(args.slow_layers)
            reps += launch.start_replicas(
                1, slow_dir, base + args.replicas - 1, cpu_bind=binds[-1:],
                kv_cache_gib=kv_gib(blocks, args.block_size, per_token), **common)
        except BaseException:
            launch.stop_replicas(reps)
            raise
    info: dict[str, Any] = {"startup_s": round(time.monotonic() - t0, 1),
                            "kv_blocks": [r.num_kv_blocks for r in reps],
                            "kv_tokens": [r.kv_cache_tokens for r in reps],
                            "block_size": reps[0].block_size, "runs": []}
    try:
        urls = [r.url for r in reps]
        if wl is None:
            wl = build_workload(tokenizer_of(urls[0]), args.tenants, args.system_min,
                                args.system_max, args.users, args.turns, args.user_tokens,
                                args.reply_tokens, args.seed)
            log(f"workload: {len(wl.turns)} requests, system prompts {wl.system_tokens} tokens,"
                f" longest prompt {wl.max_prompt_tokens} tokens")
        if any(parse_variant(v)[1] == "engine_tokens" for v in variants):
            info["tokenize_idle"] = run_async(tokenize_idle(urls[0], wl, args.tokenize_trials))
            log(f"[{label}] /tokenize idle: {info['tokenize_idle']}")
        for rep in range(args.repeats):
            order = list(variants) if rep % 2 == 0 else list(reversed(variants))
            for v in order:
                res = run_variant(urls, v, wl, args, fleet, f"{label}{rep}")
                res["repeat"] = rep
                info["runs"].append(res)
                log(f"[{label}] rep {rep} {v}: TTFT p50 {fmt_ms(res['ttft_p50_s'])} p90 "
                    f"{fmt_ms(res['ttft_p90_s'])} hit {fmt_ratio(res['engine_hit_ratio'])} "
                    f"(expected {fmt_ratio(res['gateway_expected_hit_ratio'])}) "
                    f"short {describe_belief(res['belief'])} "
                    f"preemptions {res['engine_preemptions']:.0f} "
                    f"errors {res['errors']} wall {res['wall_s']} s "
                    f"tenants {res['tenants_per_replica']} prefill rate "
                    f"{res['prefill_tokens_per_s']} steps {res['engine_step_s']}")
    finally:
        launch.stop_replicas(reps)
    return info, wl


# -- report ----------------------------------------------------------------------------------


def describe_belief(belief: dict[str, Any] | None) -> str:
    """`belief_gaps` in one phrase: requests short of what the gateway expected (of them, in
    flight, engine-cold) and the points they cost."""
    if not belief:
        return "-"
    return (f"{belief['short']}/{belief['requests']} (in flight {belief['in_flight']}, "
            f"engine-cold {belief['engine_cold']}; {belief['short_points']:.3f} of the prompt "
            f"tokens, {belief['in_flight_points']:.3f} in flight)")


def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def fmt_ratio(v: float | None) -> str:
    return cell(v)


def aggregate(runs: Sequence[dict[str, Any]], variants: Sequence[str]) -> dict[str, Any]:
    """Per variant: medians over repeats of TTFT p50/p90, hit ratio, overhead."""
    out: dict[str, Any] = {}
    for v in variants:
        rs = [r for r in runs if r["variant"] == v]
        out[v] = {k: median([r[k] for r in rs]) for k in (
            "ttft_p50_s", "ttft_p90_s", "engine_hit_ratio", "gateway_expected_hit_ratio",
            "client_cached_ratio",
            "engine_queue_mean_s", "gateway_minus_engine_ttft_s", "wall_s")}
        out[v]["runs"] = len(rs)
        out[v]["errors"] = sum(r["errors"] for r in rs)
    return out


def render(report: dict[str, Any]) -> str:
    """Markdown tables: pressured and control, each policy's TTFT and engine hit ratio."""
    lines = []
    for label in ("pressured", "control"):
        ph = report.get(label)
        if not ph:
            continue
        lines += [f"### {label}: {ph['kv_blocks'][0]} KV blocks x {ph['block_size']} tokens "
                  f"per replica ({ph['kv_tokens'][0]} tokens)", ""]
        rows = []
        for v in dict.fromkeys(r["variant"] for r in ph["runs"]):
            rs = [r for r in ph["runs"] if r["variant"] == v]
            rows.append([v, *(median_range([r[k] for r in rs], f) for k, f in (
                ("ttft_p50_s", fmt_ms), ("ttft_p90_s", fmt_ms), ("engine_hit_ratio", fmt_ratio),
                ("gateway_expected_hit_ratio", fmt_ratio),
                ("engine_queue_mean_s", fmt_ms), ("gateway_minus_engine_ttft_s", fmt_ms))),
                str(sum(r["errors"] for r in rs)), str(len(rs))])
        lines.append(markdown_table(["variant", "TTFT p50 ms", "TTFT p90 ms", "engine hit ratio",
                                     "gateway expected hit", "queue mean ms",
                                     "gateway-engine TTFT ms", "errors", "runs"], rows))
    t = report.get("pressured", {}).get("tokenize_idle")
    if t:
        lines.append("/tokenize on an idle replica: " + ", ".join(
            f"{k} prompt {v['tokens']} tokens p50 {fmt_ms(v['p50_s'])} ms p90 "
            f"{fmt_ms(v['p90_s'])} ms" for k, v in t.items()))
    tgt = report.get("target")
    if tgt:
        lines.append(f"target (pressured, medians): hit ratio prefix_affinity / round_robin = "
                     f"{tgt['hit_ratio_x']:.2f} (>= 2: {tgt['hit_met']}); TTFT p50 "
                     f"{fmt_ms(tgt['pa_p50'])} vs {fmt_ms(tgt['rr_p50'])} ms "
                     f"(lower: {tgt['ttft_met']})")
    return "\n".join(lines) + "\n"


def target(agg: dict[str, Any]) -> dict[str, Any] | None:
    """The issue's target on the pressured medians."""
    pa, rr = agg.get("prefix_affinity"), agg.get("round_robin")
    if not pa or not rr or not pa["engine_hit_ratio"] or not rr["engine_hit_ratio"]:
        return None
    x = pa["engine_hit_ratio"] / rr["engine_hit_ratio"]
    return {"hit_ratio_x": x, "hit_met": x >= 2.0, "pa_p50": pa["ttft_p50_s"],
            "rr_p50": rr["ttft_p50_s"], "ttft_met": pa["ttft_p50_s"] < rr["ttft_p50_s"]}


# -- command line ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Three replicas: with two, round_robin's caches still keep about half of what is reused,
    # which caps the hit-ratio gain near 2x (docs/benchmarks.md, "Two replicas").
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--tenants", type=int, default=9)
    p.add_argument("--system-min", type=int, default=1500, help="shortest system prompt, tokens")
    p.add_argument("--system-max", type=int, default=2500, help="longest system prompt, tokens")
    p.add_argument("--users", type=int, default=3, help="users per tenant")
    p.add_argument("--turns", type=int, default=4, help="turns per user (history grows)")
    p.add_argument("--user-tokens", type=int, default=60, help="about, per user message")
    p.add_argument("--reply-tokens", type=int, default=100, help="about, per assistant reply")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    p.add_argument("--concurrency", type=int, default=3, help="concurrent users (closed loop)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--block-size", type=int, default=128, help="KV block tokens (CPU default)")
    p.add_argument("--pressure-blocks", type=int, default=0,
                   help="KV blocks per replica under pressure (0: from the workload: the "
                   "system prompts' blocks x pressure-fraction)")
    p.add_argument("--pressure-fraction", type=float, default=0.465,
                   help="per-replica cache as a fraction of all system prompts' blocks")
    p.add_argument("--control-blocks", type=int, default=512,
                   help="KV blocks per replica in the control run (holds everything)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-bytes-per-token", type=int, default=None,
                   help="KV bytes per token of the model (default: the default model's in "
                        "the dtype the launcher picks on this CPU, 16 KiB in bfloat16, 32 KiB "
                        "in float32)")
    p.add_argument("--slow-layers", type=int, default=0,
                   help="make the last replica a model of this many layers, same tokenizer "
                        "and name (the default model has 8): a pool of mixed speeds")
    p.add_argument("--repeats", type=int, default=3, help="runs per variant, interleaved")
    p.add_argument("--tokenize-trials", type=int, default=30)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated policy[+hashing][@chars_per_token], e.g. "
                   "prefix_affinity+engine_tokens or prefix_affinity@2.2")
    p.add_argument("--no-control", action="store_true")
    p.add_argument("--no-pressure", action="store_true")
    p.add_argument("--json", action="store_true", help="print the report as JSON last")
    p.add_argument("--output", help="write the JSON report to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    fleet = Fleet(Path(tempfile.mkdtemp(prefix="vllm-bench-")))
    t_start = time.monotonic()
    model_dir = launch.ensure_model()
    report: dict[str, Any] = {"args": vars(args), "log_dir": str(fleet.log_dir)}
    wl: Workload | None = None
    try:
        with sigterm_as_interrupt():
            if not args.no_pressure:
                blocks = args.pressure_blocks
                if not blocks:
                    # Size from the workload: needs its token counts, so fit on a 1-replica
                    # probe is avoided by the (conservative) targets instead of the fitted ones.
                    sys_blocks = sum(kv_blocks_for(t, args.block_size) for t in system_targets(
                        args.tenants, args.system_min, args.system_max))
                    blocks = max(math.ceil(args.max_model_len / args.block_size) + 1,
                                 round(sys_blocks * args.pressure_fraction))
                report["pressured"], wl = phase("pressured", args, model_dir, blocks,
                                                variants, wl, fleet)
            if not args.no_control:
                ctl = [v for v in variants if parse_variant(v)[1] == "chars"]
                report["control"], wl = phase("control", args, model_dir, args.control_blocks,
                                              ctl, wl, fleet)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    assert wl is not None
    report["workload"] = {"requests": len(wl.turns), "system_tokens": wl.system_tokens,
                          "max_prompt_tokens": wl.max_prompt_tokens}
    for label in ("pressured", "control"):
        if label in report:
            report[label]["summary"] = aggregate(
                report[label]["runs"], list(dict.fromkeys(r["variant"]
                                                           for r in report[label]["runs"])))
    if "pressured" in report:
        report["target"] = target(report["pressured"]["summary"])
    report["wall_s"] = round(time.monotonic() - t_start, 1)
    print(render(report), end="", flush=True)
    print(f"wall time {report['wall_s']} s; logs in {fleet.log_dir}", flush=True)
    line = json.dumps(report, default=str)
    if args.output:
        Path(args.output).write_text(line + "\n")
    if args.json:
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
