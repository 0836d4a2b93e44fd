"""Requests per second and CPU per request of `serve --workers 1` and `--workers 2`.

Both gateways run at once in front of the same instant stub replicas (loadtests/stub_replica.py)
and are measured in turn, interleaved: a closed loop (`--concurrency` requests back to back:
the most the machine gives, with the load generator on it too) and an open loop at fixed
rates (the same offered load for both: CPU per request compares the work each does), where
`workers=1 at half` is also measured: one worker at half the rate, the requests each of two
workers gets, so that what a worker costs per request at that rate shows apart from what
sharing the gateway between workers costs. The closed loop also runs against `2 separate
gateways` (two single-process gateways, alternate requests to each): two processes without
a supervisor or shared files. Voluntary context switches per request (/proc/PID/status, the
warm-up included) tell how often the gateway's processes went to sleep waiting for work. A
gateway's CPU is the sum over its processes (the supervisor and every worker) during the
measured requests only: the warm-up's requests and the idle time before them are not counted
against the measured ones.

    python -m loadtests.workers_bench                 # about two minutes
    python -m loadtests.workers_bench --duration 2 --reps 1 --rates 200   # a quick check
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import psutil

from loadtests.fleet import Fleet
from loadtests.overhead import (
    Run,
    closed_loop,
    cpu_seconds,
    interleave,
    open_loop,
    request_bodies,
)
from loadtests.overhead import _run_sync as run_sync
from loadtests.report import span
from loadtests.stats import median

VARIANTS = ("workers=1", "workers=2")
HALF = "workers=1 at half"
"""One worker at half an open loop's rate: what each of two workers gets."""
SEPARATE = "2 separate gateways"
"""Two single-process gateways, the client sending alternate requests to each: what two
processes cost without a supervisor or shared files (closed loop)."""


def gateway_pids(pid: int) -> list[int]:
    """The gateway's process and its workers (if any)."""
    return [pid, *(c.pid for c in psutil.Process(pid).children())]


def voluntary_switches(pid: int) -> int:
    """How many times the process has gone to sleep (in epoll_wait, mostly), from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    return 0


def record(run: Run, pids: list[int], switches: int = 0) -> dict:
    """One measurement: the gateway's CPU (its processes `pids`) over the measured requests
    only, as the run counted it from their first to their last; `switches`, its processes'
    voluntary context switches over the run (warm-up included)."""
    gcpu = sum(run.cpu_by_pid[p] for p in pids)
    return {"rps": run.rps, "ok": run.ok, "errors": run.errors,
            "gateway_cpu_ms_per_req": 1000 * gcpu / max(1, run.ok),
            "gateway_cores": gcpu / run.wall if run.wall else 0.0,
            "switches_per_req": switches / max(1, run.ok)}


def measure(args: argparse.Namespace) -> dict:
    results: dict = {}
    with Fleet() as f:
        stub, urls = f.start_stubs(args.replicas)
        targets = {}
        for v in VARIANTS:
            n = int(v.split("=")[1])
            url, proc = f.start_gateway(urls, v.replace("=", "-"), pool="main",
                                        replica_prefix="stub", server={"workers": n})
            targets[v] = ([url + "/v1/chat/completions"], [proc.pid])
        url, proc = f.start_gateway(urls, "workers-1-b", pool="main", replica_prefix="stub",
                                    server={"workers": 1})
        one_url, one_pid = targets[VARIANTS[0]]
        targets[SEPARATE] = ([*one_url, url + "/v1/chat/completions"], [*one_pid, proc.pid])
        targets[HALF] = targets[VARIANTS[0]]
        bodies = request_bodies(stream=False)

        def one(kind: str, v: str, fn, *rest) -> None:
            gateway_urls, roots = targets[v]
            pids = [p for root in roots for p in gateway_pids(root)]
            s0 = sum(voluntary_switches(p) for p in pids)
            run = run_sync(fn, gateway_urls, bodies, False, *rest, [stub.pid, *pids])
            rec = record(run, pids, sum(voluntary_switches(p) for p in pids) - s0)
            results.setdefault(kind, {}).setdefault(v, []).append(rec)
            cpu_ms = rec["gateway_cpu_ms_per_req"]
            print(f"  {kind:12} {v}  {run.rps:7.0f} req/s  gateway {cpu_ms:.3f} ms CPU/req"
                  f" ({rec['gateway_cores']:.2f} cores)  errors {run.errors}",
                  file=sys.stderr, flush=True)

        def idle(v: str, _r: int) -> None:
            """What the gateway spends with no request: health checks, metric scrapes."""
            pids = gateway_pids(targets[v][1][0])
            g0, t0 = sum(cpu_seconds(p) for p in pids), time.perf_counter()
            time.sleep(args.duration)
            ms = 1000 * (sum(cpu_seconds(p) for p in pids) - g0) / (time.perf_counter() - t0)
            results.setdefault("idle", {}).setdefault(v, []).append(ms)
            print(f"  idle         {v}  {ms:.1f} ms CPU per second", file=sys.stderr, flush=True)

        interleave(args.reps, list(VARIANTS), idle)
        interleave(args.reps, [*VARIANTS, SEPARATE], lambda v, _r: one(
            f"closed c={args.concurrency}", v, closed_loop, args.concurrency, args.duration))
        for rate in args.rates:
            interleave(args.reps, [*VARIANTS, HALF], lambda v, _r, rate=rate: one(
                f"open {rate:g}/s", v, open_loop, rate / 2 if v == HALF else rate,
                args.duration))
    return results


def table(results: dict) -> str:
    lines = ["| load | gateway | req/s | gateway CPU ms/req | gateway cores busy | errors | "
             "voluntary switches/req |",
             "|---|---|---:|---:|---:|---:|---:|"]
    idle = results.get("idle", {})
    for kind, by in results.items():
        if kind == "idle":
            continue
        for v in (*VARIANTS, SEPARATE, HALF):
            if v not in by:
                continue
            runs = by[v]
            rps = [r["rps"] for r in runs]
            cpu = [r["gateway_cpu_ms_per_req"] for r in runs]
            lines.append(f"| {kind} | {v} | {median(rps):.0f} {span(rps)} | "
                         f"{median(cpu):.3f} {span(cpu)} | "
                         f"{median([r['gateway_cores'] for r in runs]):.2f} | "
                         f"{sum(r['errors'] for r in runs)} | "
                         f"{median([r.get('switches_per_req', 0.0) for r in runs]):.2f} |")
    lines.append("")
    lines.append("Idle (no requests): " + ", ".join(
        f"{v} {median(idle[v]):.1f} ms CPU per second" for v in VARIANTS if v in idle))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rates", type=float, nargs="+", default=[300.0])
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    results = measure(args)
    print(json.dumps(results) if args.json else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
