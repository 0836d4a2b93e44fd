"""Compare routers over HTTP in front of the same simulated replicas, in one run.

Starts the simulated replicas once; then for each router (the gateway with round_robin,
least_load, prefix_affinity, and the real SGLang router 0.3.2 with cache_aware at its default
flags) it waits until the replicas are idle, resets their prefix caches, starts the router,
replays the same requests through it with loadtests.replay, stops it, and finally prints a
markdown table. Every figure comes from the client and the replicas' own /metrics.

    python -m loadtests.compare_http --trace data/traces/synthetic_trace.jsonl \
        --replicas 8 --limit 1000 --speedup 10
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from backends.sim.fleet_spec import describe
from loadtests import replay as rp
from loadtests.caches import reset_prefix_caches
from loadtests.fleet import Fleet, run_async, sigterm_as_interrupt
from loadtests.metrics import wait_idle
from loadtests.report import cell, emit_json, markdown_table
from loadtests.settings import add_workload_param, key_value
from loadtests.traces import TraceRequest, load_requests

SGLANG = "sglang_cache_aware"
DEFAULT_ROUTERS = ("round_robin", "least_load", "prefix_affinity", SGLANG)


def run_one(router: str, fleet: Fleet, replica_urls: list[str],
            requests: Sequence[TraceRequest], opts: rp.ReplayOptions,
            prefill_rates: Sequence[float] | None = None) -> dict[str, Any]:
    """Start `router` in front of the replicas, replay, stop it; the replay's result (with
    each replica's prefill rate, its prefill imbalance by time too)."""
    wait_idle(replica_urls, engine=opts.engine)
    reset_prefix_caches(replica_urls, engine=opts.engine)
    opts.label = router
    if router == SGLANG:
        from loadtests.baselines.sglang_router import free_port, start_sglang_router

        handle = start_sglang_router(replica_urls, free_port(), "cache_aware",
                                     log_path=fleet.log_dir / "sglang-router.log",
                                     startup_timeout=120)
        try:
            data = run_async(rp.replay(handle.url, replica_urls, requests, opts))
        finally:
            handle.stop()
    else:
        policy, *pairs = router.split("/")
        routing = dict(key_value(p) for p in pairs)
        url, proc = rp.start_gateway(fleet, replica_urls, policy, routing, engine=opts.engine,
                                     name=f"gateway-{len(fleet.procs)}-{policy}")
        try:
            data = run_async(rp.replay(url, replica_urls, requests, opts))
        finally:
            fleet.stop_process(proc)
    return rp.summarize(data, requests, router, prefill_rates)


def _f(v: float | None, digits: int = 3) -> str:
    return cell(v, f"{{:.{digits}f}}")


def results_table(results: Sequence[dict[str, Any]]) -> str:
    """One markdown row per router."""
    header = ["router", "requests", "errors", "TTFT mean s", "TTFT p50 s", "TTFT p90 s",
              "TTFT p99 s", "engine TTFT mean s", "TPOT p50 s", "hit ratio", "ideal", "hit/ideal",
              "imbalance",
              "prefill imb.", "prefill time imb.", "peak in-flight imb.", "duration s"]
    # Only engines that allocate KV as they go preempt: the column where one did.
    preempting = any(r.get("engine_preemptions") for r in results)
    if preempting:
        header.insert(-1, "preemptions")
    rows = []
    for r in results:
        hit, ideal = r.get("hit_ratio"), r.get("ideal_hit_ratio")
        rel = hit / ideal if hit is not None and ideal else None
        rows.append([
            r["policy"], str(r["requests"]), str(r["errors"]), _f(r["ttft_mean_s"]),
            _f(r["ttft_p50_s"]), _f(r["ttft_p90_s"]), _f(r["ttft_p99_s"]),
            _f(r.get("engine_ttft_mean_s")), _f(r["tpot_p50_s"], 4), _f(hit), _f(ideal),
            _f(rel, 2), _f(r["imbalance"], 2),
            _f(r["prefill_imbalance"], 2), _f(r.get("prefill_time_imbalance"), 2),
            _f(r["peak_inflight_imbalance"], 2),
            *([cell(r.get("engine_preemptions"), "{}")] if preempting else []),
            _f(r["duration_s"], 1)])
    return markdown_table(header, rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Mooncake-format JSONL file, or a RAGPulse directory")
    src.add_argument("--workload", choices=sorted(rp.SYNTHETIC), help="a synthetic workload")
    add_workload_param(p)
    rp.add_fleet_arguments(p)
    p.add_argument("--routers", default=",".join(DEFAULT_ROUTERS),
                   help=f"comma-separated; gateway policies, each optionally with routing "
                   f"settings as POLICY/KEY=VALUE/... (prefix_affinity/replica_speed=false), "
                   f"or {SGLANG}")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--max-output", type=int, default=rp.DEFAULT_MAX_OUTPUT)
    p.add_argument("--kv-capacity-tokens", type=int, default=rp.DEFAULT_KV_CAPACITY_TOKENS)
    p.add_argument("--profile", default=rp.DEFAULT_PROFILE)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    rp.add_stream_share(p)
    p.add_argument("--output", help="append each router's JSON result to this JSONL file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    requests = load_requests(args.trace, args.workload, args.limit, args.speedup,
                                dict(args.workload_param), from_zero=True)
    source = args.workload or Path(str(args.trace).rstrip("/")).name
    fleet = Fleet()
    results: list[dict[str, Any]] = []
    try:
        with sigterm_as_interrupt():
            urls, sims = rp.start_sim_fleet(fleet, args)
            rates = [r.build().prefill_tokens_per_s for r in sims]
            rp.log(f"{args.replicas} simulated replicas ({describe(sims)}, time scale "
                   f"{args.time_scale}, {args.kv_capacity_tokens} KV tokens each); "
                   f"{len(requests)} requests of {source}; logs in {fleet.log_dir}")
            for router in routers:
                opts = rp.ReplayOptions(max_output=args.max_output, timeout_s=args.timeout,
                                        stream_share=args.stream_share, engine=args.engine)
                t = time.monotonic()
                try:
                    res = run_one(router, fleet, urls, requests, opts, rates)
                except (RuntimeError, FileNotFoundError, OSError) as exc:
                    rp.log(f"{router}: FAILED: {exc}")
                    res = {"policy": router, "failed": str(exc)[:500]}
                    results.append(res)
                    continue
                res.update(rp.sim_conditions(args), speedup=args.speedup,
                           max_output=args.max_output, source=source)
                rp.log(f"{router}: done in {time.monotonic() - t:.0f} s; TTFT p50 "
                       f"{_f(res['ttft_p50_s'])} s, hit {_f(res['hit_ratio'])}")
                results.append(res)
                emit_json(res, False, args.output)
    except KeyboardInterrupt:
        rp.log("interrupted; stopping")
        return 130
    finally:
        fleet.stop()
    ok = [r for r in results if "failed" not in r]
    engines = ", allocating KV as vLLM does" if args.vllm_engines else ""
    print(f"\n{source}: {len(requests)} requests, speedup {args.speedup}, {args.replicas} "
          f"replicas ({describe(sims)}, time scale {args.time_scale}, "
          f"{args.kv_capacity_tokens} KV tokens each{engines})\n")
    print(results_table(ok), end="")
    for r in results:
        if "failed" in r:
            print(f"\n{r['policy']}: failed: {r['failed']}")
    return 0 if len(ok) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
