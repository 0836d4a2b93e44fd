"""The router's CPU time per request: route, dispatch, first token and end, as the gateway
calls them, with requests overlapping as they do in a busy pool.

Prompts are shared system prompts (tenants) plus a question of their own, already hashed, so
what is timed is the routing alone (hashing a prompt is timed by tests of its own and costs
the same whatever the policy). The replicas' views are built once; the gateway builds them
per request from its pool, which is not routing either.

    python -m loadtests.route_cost --replicas 8 --set pin_running=true
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from gateway.config import RoutingSettings
from gateway.wiring import build_router
from loadtests.settings import key_value, settings_text
from routing import Router
from routing.types import Decision, ReplicaView, RoutingRequest


def prompts(router: Router, n: int, tenants: int, system_blocks: int,
            own_blocks: int, max_tokens: int = 256) -> list[RoutingRequest]:
    """`n` requests of `system_blocks + own_blocks` chained blocks, as `router` makes them from
    hashes: a tenant's system prompt (request i is tenant i % tenants's) and blocks of its own;
    each asks for `max_tokens`, as the gateway reads it from the request."""
    block_tokens = router.block_chars / router.chars_per_token
    out = []
    for i in range(n):
        hashes = [i % tenants * 1_000_003 + b for b in range(system_blocks)]
        hashes += [(i + 1) * 7_919_009 + b for b in range(own_blocks)]
        request = router.request_from_hashes(hashes, len(hashes) * block_tokens, block_tokens)
        request.output_tokens = max_tokens
        out.append(request)
    return out


def run_once(router: Router, views: Sequence[ReplicaView], requests: Sequence[RoutingRequest],
             concurrency: int) -> float:
    """Seconds of routing work for `requests`: each is routed and dispatched, sees its first
    token once `concurrency` later ones were routed, and ends `concurrency` after that, having
    generated the tokens it asked for."""
    waiting: deque[tuple[Decision, int]] = deque()
    running: deque[tuple[Decision, int]] = deque()
    now = 0.0
    perf = time.perf_counter
    start = perf()
    for request in requests:
        now += 0.01
        decision = router.route(request, views)
        router.dispatched(decision, now)
        waiting.append((decision, int(request.output_tokens)))
        if len(waiting) > concurrency:
            d, generated = waiting.popleft()
            router.first_token(d, now, now - 0.5)
            running.append((d, generated))
        if len(running) > concurrency:
            d, generated = running.popleft()
            router.finished(d, True, generated)
    for d, generated in waiting:
        router.first_token(d, now, now - 0.5)
        running.append((d, generated))
    for d, generated in running:
        router.finished(d, True, generated)
    return perf() - start


def measure(settings: dict[str, Any], *, replicas: int = 8, requests: int = 20_000,
            rounds: int = 5, concurrency: int = 32, tenants: int = 200,
            system_blocks: int = 20, own_blocks: int = 5) -> dict[str, Any]:
    """Microseconds per request over `rounds` fresh routers with these routing `settings`."""
    routing = RoutingSettings(**settings)
    names = [f"r{i}" for i in range(replicas)]
    views = [ReplicaView(name=n) for n in names]

    def fresh() -> Router:
        router = build_router(routing)
        for n in names:
            router.add_replica(n)
        return router

    reqs = prompts(fresh(), requests, tenants, system_blocks, own_blocks)
    per_request: list[float] = []
    for _ in range(rounds):
        router = fresh()
        per_request.append(run_once(router, views, reqs, concurrency) / requests * 1e6)
    return {
        "settings": settings, "replicas": replicas, "requests": requests,
        "blocks": system_blocks + own_blocks, "concurrency": concurrency,
        "best_us": min(per_request), "median_us": statistics.median(per_request),
        "rounds_us": per_request,
        "inflight_left": sum(router.load.inflight.values()),
        "pinned_left": sum(ix.pinned_blocks for ix in router.indexes.values()),
        "reserved_left": sum(ix.reserved for ix in router.indexes.values()),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=32,
                    help="requests awaiting a first token, and as many decoding")
    ap.add_argument("--set", action="append", default=[], type=key_value, metavar="KEY=VALUE",
                    help="routing setting for a second run beside the defaults (repeatable)")
    args = ap.parse_args(argv)
    runs = [{}] + ([dict(args.set)] if args.set else [])
    results = [measure(settings, replicas=args.replicas, requests=args.requests,
                       rounds=args.rounds, concurrency=args.concurrency) for settings in runs]
    print(f"{args.replicas} replicas, {args.requests} requests of {results[0]['blocks']} "
          f"blocks (tenants' system prompts + blocks of their own), {args.concurrency} "
          f"awaiting a first token and {args.concurrency} decoding; best and median of "
          f"{args.rounds} rounds\n")
    print("| settings | µs per request, best | median |")
    print("|---|---:|---:|")
    for settings, r in zip(runs, results, strict=True):
        label = settings_text(settings.items(), ", ")
        print(f"| {label} | {r['best_us']:.1f} | {r['median_us']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
