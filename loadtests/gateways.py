"""Several gateways as one: the same replay through 1, 2 and 3 gateway processes, with and
without Redis, in front of the same simulated replicas, as one markdown table.

Starts the simulated replicas once; then for each gateway count (and Redis on or off) it waits
until the replicas are idle, resets their prefix caches, starts that many gateways on one
config (loadtests.replay.start_gateways), replays the requests spread round-robin over them
(request i to gateway i mod N, as a load balancer would), and stops them. With Redis every run
gets a key prefix of its own, so no run reads an earlier one's state.

    python -m loadtests.gateways --workload tenants --replicas 8 --speedup 2
    python -m loadtests.gateways --workload tenants --replicas 8 --speedup 2 --redis both

With `--stream-share 0.5` every other request streams, so with an even gateway count the
odd-numbered gateways get every streamed request and the others every request passed
through whole: a client that streams on one gateway (or worker) next to one that does not.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from backends.sim.fleet_spec import describe
from loadtests import replay as rp
from loadtests.caches import reset_prefix_caches
from loadtests.fleet import Fleet, run_async, sigterm_as_interrupt
from loadtests.metrics import wait_idle
from loadtests.report import cell, emit_json, markdown_table
from loadtests.settings import add_routing_settings, add_workload_param, key_value
from loadtests.shadow import replay_shadow
from loadtests.traces import TraceRequest, load_requests


def run_one(fleet: Fleet, replica_urls: list[str], requests: Sequence[TraceRequest],
            count: int, redis: dict[str, Any] | None, policy: str | None,
            routing: dict[str, Any], opts: rp.ReplayOptions,
            shadow: bool = False) -> dict[str, Any]:
    """`count` gateways (with this `redis` section, or none) in front of idle, emptied
    replicas; the replay's result (with `shadow`, its shadow single gateway's figures)."""
    wait_idle(replica_urls, engine=opts.engine)
    reset_prefix_caches(replica_urls, engine=opts.engine)
    cfg = rp.gateway_config(replica_urls, policy, routing, redis, engine=opts.engine)
    shade = replay_shadow(cfg, requests) if shadow else None
    started = rp.start_gateways(fleet, cfg, count,
                                name=f"gateway-{count}{'-redis' if redis else ''}")
    procs = [proc for _, proc in started]
    try:
        cpu0 = rp.cpu_seconds(procs)
        data = run_async(rp.replay([u for u, _ in started], replica_urls, requests, opts,
                                   shade))
        cpu1 = rp.cpu_seconds(procs)
        speeds = [learned_speeds(url) for url, _ in started]
    finally:
        for proc in procs:
            fleet.stop_process(proc)
    res = rp.summarize(data, requests, opts.label)
    res["redis"] = redis is not None
    if redis:
        res["redis_key_prefix"] = redis["key_prefix"]
    if cpu0 is not None and cpu1 is not None:
        res["gateway_cpu_ms_per_request"] = 1000 * (cpu1 - cpu0) / len(requests)
    res["speeds_by_gateway"] = speeds
    return res


def learned_speeds(gateway_url: str) -> dict[str, float] | None:
    """Each replica's speed as the gateway prices it at the end of a run, from its
    /admin/stats (None if it does not answer): how far the gateways agree on a mixed
    fleet's speeds."""
    try:
        stats = httpx.get(f"{gateway_url}/admin/stats", timeout=5.0).json()
    except (httpx.HTTPError, ValueError):
        return None
    return {r["name"]: r["speed"] for p in stats["pools"] for r in p["replicas"]}


def _f(v: float | None, digits: int = 3) -> str:
    return cell(v, f"{{:.{digits}f}}")


def results_table(results: Sequence[dict[str, Any]]) -> str:
    """One markdown row per run; `/ 1 gw` is the mean TTFT over the first one-gateway run's
    without Redis (or the first run's)."""
    ref = next((r for r in results if r["gateways"] == 1 and not r["redis"]), results[0])
    shadow = any("shadow_agreement" in r for r in results)
    header = ["gateways", "Redis", "requests", "errors", "TTFT mean s", "/ 1 gw", "TTFT p99 s",
              "engine TTFT mean s", "hit ratio", "hit/ideal", "prefill imb.", "agreement",
              "agr. last",
              *(["shadow agr.", "shadow match", "shadow held"] if shadow else []), "warm requests",
              "gateway CPU ms/req", "duration s"]
    rows = []
    for r in results:
        hit, ideal = r.get("hit_ratio"), r.get("ideal_hit_ratio")
        mean, ref_mean = r["ttft_mean_s"], ref["ttft_mean_s"]
        rows.append([
            str(r["gateways"]), "yes" if r["redis"] else "no", str(r["requests"]),
            str(r["errors"]), _f(mean), _f(mean / ref_mean if mean and ref_mean else None),
            _f(r["ttft_p99_s"]), _f(r.get("engine_ttft_mean_s")), _f(hit),
            _f(hit / ideal if hit is not None and ideal else None),
            _f(r["prefill_imbalance"], 2), _f(r["agreement"]), _f(r.get("agreement_last")),
            *([_f(r.get("shadow_agreement")), _f(r.get("shadow_match_agreement")),
                 _f(r.get("shadow_held_agreement"))]
              if shadow else []),
            str(r["warm_requests"]),
            _f(r.get("gateway_cpu_ms_per_request"), 2), _f(r["duration_s"], 1)])
    return markdown_table(header, rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Mooncake-format JSONL file, RAGPulse directory or Azure "
                     "CSV")
    src.add_argument("--workload", choices=sorted(rp.SYNTHETIC), help="a synthetic workload")
    add_workload_param(p)
    p.add_argument("--counts", default="1,2,3", help="gateway counts to run (default 1,2,3)")
    p.add_argument("--redis", choices=("off", "on", "both"), default="off",
                   help="runs without Redis, with it, or both for every count (default off)")
    p.add_argument("--redis-url", help="with --redis on|both: this Redis instead of a "
                   "redis-server started on a free port")
    p.add_argument("--redis-set", action="append", default=[], metavar="KEY=VALUE",
                   type=key_value, help="another key of the gateways' `redis` section "
                   "(repeatable)")
    p.add_argument("--policy", default=None, help="gateway routing policy (default: the "
                   "gateway's)")
    add_routing_settings(p)
    rp.add_fleet_arguments(p)
    rp.add_stream_share(p)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--max-output", type=int, default=rp.DEFAULT_MAX_OUTPUT)
    p.add_argument("--kv-capacity-tokens", type=int, default=rp.DEFAULT_KV_CAPACITY_TOKENS)
    p.add_argument("--profile", default=rp.DEFAULT_PROFILE)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--concurrency-limit", type=int, default=0,
                   help="cap on requests in flight (default 0: none, pure open loop)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--shadow", action="store_true", help="also ask a shadow single gateway, in "
                   "the client, where one gateway would send each request: shadow_agreement "
                   "(loadtests.replay's --shadow)")
    p.add_argument("--json", action="store_true", help="print the results as JSON, one line "
                   "each, after the table")
    p.add_argument("--output", help="append each run's JSON result to this JSONL file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    counts = [int(c) for c in args.counts.split(",") if c.strip()]
    if not counts or min(counts) < 1:
        raise SystemExit("gateways: --counts must list positive gateway counts")
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.redis]
    if (args.redis_url or args.redis_set) and args.redis == "off":
        raise SystemExit("gateways: --redis-url and --redis-set need --redis on or both")
    requests = load_requests(args.trace, args.workload, args.limit, args.speedup,
                             dict(args.workload_param), from_zero=True)
    if not requests:
        raise SystemExit("gateways: no requests to send")
    source = args.workload or Path(str(args.trace).rstrip("/")).name
    policy = args.policy or rp.default_policy()
    fleet = Fleet()
    results: list[dict[str, Any]] = []
    try:
        with sigterm_as_interrupt():
            redis_url = None
            if True in modes:
                redis_url = args.redis_url or fleet.start_redis()
            urls, sims = rp.start_sim_fleet(fleet, args)
            rp.log(f"{args.replicas} simulated replicas ({describe(sims)}, time scale "
                   f"{args.time_scale}, {args.kv_capacity_tokens} KV tokens each); "
                   f"{len(requests)} requests of {source}; logs in {fleet.log_dir}")
            for with_redis in modes:
                for count in counts:
                    redis = (rp.redis_section(redis_url, dict(args.redis_set))
                             if with_redis and redis_url else None)
                    opts = rp.ReplayOptions(args.max_output, args.concurrency_limit,
                                            args.timeout, label=policy,
                                            stream_share=args.stream_share, engine=args.engine)
                    t = time.monotonic()
                    res = run_one(fleet, urls, requests, count, redis, args.policy,
                                  dict(args.settings), opts, args.shadow)
                    res.update(rp.sim_conditions(args), speedup=args.speedup,
                               max_output=args.max_output, source=source)
                    rp.log(f"{count} gateway(s), Redis {'on' if redis else 'off'}: done in "
                           f"{time.monotonic() - t:.0f} s; TTFT mean {_f(res['ttft_mean_s'])} s, "
                           f"agreement {_f(res['agreement'])}")
                    results.append(res)
                    emit_json(res, False, args.output)
    except KeyboardInterrupt:
        rp.log("interrupted; stopping")
        return 130
    finally:
        fleet.stop()
    print(f"\n{source}: {len(requests)} requests, speedup {args.speedup}, {args.replicas} "
          f"replicas ({describe(sims)}, time scale {args.time_scale}, "
          f"{args.kv_capacity_tokens} KV tokens each), policy {policy}\n")
    print(results_table(results), end="", flush=True)
    if args.json:
        for r in results:
            emit_json(r, True, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
