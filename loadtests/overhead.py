"""The gateway's own added latency and CPU cost: direct-to-stub vs through-the-gateway.

Stub replicas answer instantly, so what the gateway adds is all that is measured. Each
measurement alternates direct and gateway runs (interleaved repetitions); the gateway and
the stubs share one CPU core, the load generator has another.

With --baseline-root DIR, a second gateway runs from the checkout in DIR (its own code) beside
this one, and every repetition runs direct, baseline and current in a rotating order; the
table then puts baseline and current side by side with their ratio.

With --shared-state, both gateways run from this checkout with the same Redis: the baseline
with `redis.shared_routing.enabled: false`, the current one sharing its routing state (what
sharing adds to the gateway's latency and CPU).

With --admission N, this checkout's gateway runs under admission control (the pool's
max_inflight_per_replica N, the class's admission defaults); a baseline never does, so
`--baseline-root . --admission N` measures what admission control costs.

    python -m loadtests.overhead        # the full run: about 3 minutes of measurement
    python -m loadtests.overhead --duration 1 --reps 1 --rates 200   # a quick check
    python -m loadtests.overhead --baseline-root ../old   # A/B against another checkout
    python -m loadtests.overhead --baseline-root . --admission 64   # admission's own cost
    python -m loadtests.overhead --shared-state   # shared routing state through Redis
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from loadtests.fleet import REPO, Fleet, use_uvloop
from loadtests.report import cell, span
from loadtests.stats import median, nearest_rank

SERVER_CORE = 0  # gateway (or proxy) and the stubs share this core
CLIENT_CORE = 1  # the load generator runs alone on this one
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def pin_self(core: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setaffinity(0, {core})


def start_gateway(fleet: Fleet, urls: list[str], name: str = "gateway",
                  internal_stream: bool = True, root: Path = REPO,
                  policy: str = "prefix_affinity",
                  admission: int | None = None,
                  redis: dict | None = None) -> tuple[subprocess.Popen, str]:
    """A gateway on the server core in front of the stubs; `root` picks the checkout it runs
    from; `admission`, a max_inflight_per_replica that puts it under admission control;
    `redis`, its `redis` section."""
    pool = {"max_inflight_per_replica": admission} if admission else None
    url, proc = fleet.start_gateway(urls, name, deadline_s=30, core=SERVER_CORE, root=root,
                                    pool="main", replica_prefix="stub",
                                    routing={"policy": policy},
                                    server={"non_streaming_ttft": internal_stream},
                                    pool_settings=pool, redis=redis)
    return proc, url


def request_bodies(n: int = 256, stream: bool = False) -> list[bytes]:
    """Chat requests sharing 16 system prompts (~1.5 KB), so prefix routing has work to do."""
    systems = [f"You are assistant #{k}. " + "Follow the house style guide carefully. " * 36
               for k in range(16)]
    out = []
    for i in range(n):
        body = {"model": "tiny", "max_tokens": 16, "stream": stream,
                "messages": [{"role": "system", "content": systems[i % 16]},
                             {"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]}
        out.append(orjson.dumps(body))
    return out


@dataclass
class Run:
    """One measurement: requests, errors, wall time, latencies (s), CPU-seconds of targets."""

    ok: int = 0
    errors: int = 0
    wall: float = 0.0
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    cpu: float = 0.0

    @property
    def rps(self) -> float:
        return self.ok / self.wall if self.wall else 0.0

    def pct(self, q: float, ttft: bool = False) -> float:
        return nearest_rank(self.ttfts if ttft else self.latencies, q)


async def one(session: aiohttp.ClientSession, url: str, body: bytes, stream: bool,
              run: Run, t0: float | None = None) -> None:
    start = t0 if t0 is not None else time.perf_counter()
    try:
        async with session.post(url, data=body,
                                headers={"content-type": "application/json"}) as resp:
            if stream:
                first = None
                async for _ in resp.content.iter_any():
                    if first is None:
                        first = time.perf_counter()
                if first is not None:
                    run.ttfts.append(first - start)
            else:
                await resp.read()
            if resp.status != 200:
                run.errors += 1
                return
    except (aiohttp.ClientError, OSError, TimeoutError):
        run.errors += 1
        return
    run.latencies.append(time.perf_counter() - start)
    run.ok += 1


def _session(limit: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit, force_close=False),
        timeout=aiohttp.ClientTimeout(total=30), skip_auto_headers=("User-Agent",),
        auto_decompress=False)


async def closed_loop(urls: list[str], bodies: list[bytes], stream: bool, concurrency: int,
                      duration: float, pids: list[int]) -> Run:
    """`concurrency` workers back to back for `duration` seconds (after a short warm-up)."""
    async with _session(concurrency) as session:
        warm = Run()
        await asyncio.gather(*(one(session, urls[i % len(urls)], bodies[i % len(bodies)],
                                   stream, warm) for i in range(concurrency * 4)))
        run = Run()
        stop = time.perf_counter() + duration
        counter = iter(range(10**9))

        async def worker() -> None:
            while time.perf_counter() < stop:
                i = next(counter)
                await one(session, urls[i % len(urls)], bodies[i % len(bodies)], stream, run)

        cpu0 = sum(cpu_seconds(p) for p in pids)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        run.wall = time.perf_counter() - t0
        run.cpu = sum(cpu_seconds(p) for p in pids) - cpu0
        return run


async def open_loop(urls: list[str], bodies: list[bytes], stream: bool, rate: float,
                    duration: float, pids: list[int]) -> Run:
    """Requests started on a fixed schedule; latency counts from the scheduled start."""
    async with _session(0) as session:
        warm = Run()
        await asyncio.gather(*(one(session, urls[i % len(urls)], bodies[i], stream, warm)
                               for i in range(32)))
        run = Run()
        n = int(rate * duration)
        tasks = []
        cpu0 = sum(cpu_seconds(p) for p in pids)
        t0 = time.perf_counter()
        for i in range(n):
            due = t0 + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session, urls[i % len(urls)],
                                                 bodies[i % len(bodies)], stream, run, due)))
        await asyncio.gather(*tasks)
        run.wall = time.perf_counter() - t0
        run.cpu = sum(cpu_seconds(p) for p in pids) - cpu0
        return run


@contextlib.contextmanager
def fleet(count: int, internal_stream: bool = True,
          baseline_root: Path | None = None, admission: int | None = None,
          shared_state: bool = False) -> Iterator[dict]:
    """Stubs and a gateway in front of them (and one from `baseline_root`, when given), all on
    the server core; stopped on exit. `shared_state`: both gateways use one Redis, only the
    current one shares its routing state through it."""
    with Fleet() as f:
        stub, urls = f.start_stubs(count, core=SERVER_CORE)
        redis_url = f.start_redis() if shared_state else None
        gw, gw_url = start_gateway(f, urls, internal_stream=internal_stream,
                                   admission=admission,
                                   redis={"url": redis_url, "key_prefix": "current:"}
                                   if redis_url else None)
        out = {"stub": stub, "urls": urls, "gateway": gw, "gateway_url": gw_url}
        if redis_url:
            # A second gateway sharing the current one's state, with no traffic of its own:
            # it applies the current one's inserts and measures their lag (on the load
            # generator's core, so that the server core measures the current gateway alone).
            peer_url, _ = f.start_gateway(
                urls, "peer", deadline_s=30, core=CLIENT_CORE, pool="main",
                replica_prefix="stub", routing={"policy": "prefix_affinity"},
                redis={"url": redis_url, "key_prefix": "current:"})
            out["peer_url"] = peer_url
        if baseline_root is not None:
            base, base_url = start_gateway(
                f, urls, "baseline", internal_stream=internal_stream, root=baseline_root,
                redis={"url": redis_url, "key_prefix": "baseline:",
                       "shared_routing": {"enabled": False}} if redis_url else None)
            out.update(baseline=base, baseline_url=base_url)
        yield out


def rotation(reps: int, variants: list[str]) -> Iterator[tuple[int, str]]:
    """(rep, variant): every repetition runs each variant once, the order rotated by one each
    time (A B C, B C A, C A B, ...; with two variants A B, B A), so none always goes first."""
    n = len(variants)
    for r in range(reps):
        for v in variants[r % n:] + variants[:r % n]:
            yield r, v


def interleave(reps: int, variants: list[str], fn: Callable[[str, int], None]) -> None:
    """Run `fn(variant, rep)` in `rotation` order."""
    for r, v in rotation(reps, variants):
        fn(v, r)


def record(run: Run, gateway_cpu_s: float | None, stream: bool) -> dict:
    """One measurement as the results keep it (milliseconds; TTFTs only for streams)."""
    return {"rps": run.rps, "ok": run.ok, "errors": run.errors,
            "cpu_ms_per_req": 1000 * run.cpu / max(1, run.ok),
            "gateway_cpu_ms_per_req": 1000 * gateway_cpu_s / max(1, run.ok)
            if gateway_cpu_s is not None else 0.0,
            "p50_ms": 1000 * run.pct(0.5), "p99_ms": 1000 * run.pct(0.99),
            "ttft_p50_ms": 1000 * run.pct(0.5, True) if stream else None,
            "ttft_p99_ms": 1000 * run.pct(0.99, True) if stream else None}


def measure(args: argparse.Namespace) -> dict:
    """Every measurement of every target, interleaved; with a baseline the gateway targets
    are "baseline" and "current", else "gateway"."""
    results: dict = {"closed": {}, "open": {}, "config": vars(args)}
    baseline_root = args.baseline_root.resolve() if args.baseline_root else None
    with fleet(args.replicas, not args.no_internal_stream, baseline_root,
               args.admission, args.shared_state) as f:
        stub_pid = f["stub"].pid
        # name: (URLs round robin, PIDs whose CPU counts, the gateway's PID or None).
        # Direct: the load generator talks to the stubs itself, round robin over them.
        targets: dict[str, tuple[list[str], list[int], int | None]] = {
            "direct": ([u + "/v1/chat/completions" for u in f["urls"]], [stub_pid], None)}
        gateways = [("baseline", "baseline"), ("current", "gateway")] if baseline_root \
            else [("gateway", "gateway")]
        for name, key in gateways:
            pid = f[key].pid
            targets[name] = ([f[f"{key}_url"] + "/v1/chat/completions"], [pid, stub_pid], pid)

        def run_one(fn, target: str, stream: bool, bodies: list[bytes],
                    *rest) -> tuple[Run, dict]:
            urls, pids, gw_pid = targets[target]
            g0 = cpu_seconds(gw_pid) if gw_pid else 0.0
            run = _run_sync(fn, urls, bodies, stream, *rest, pids)
            gcpu = cpu_seconds(gw_pid) - g0 if gw_pid else None
            return run, record(run, gcpu, stream)

        for stream in (False, True):
            bodies = request_bodies(stream=stream)
            mode = "stream" if stream else "non-stream"

            def run_closed(target: str, _r: int, stream: bool = stream, bodies=bodies,
                           mode: str = mode) -> None:
                run, rec = run_one(closed_loop, target, stream, bodies, args.concurrency,
                                   args.duration)
                results["closed"].setdefault(mode, {}).setdefault(target, []).append(rec)
                print(f"  closed c={args.concurrency} {mode:10} {target:8} {run.rps:8.0f} req/s"
                      f"  errors {run.errors}", file=sys.stderr, flush=True)

            interleave(args.reps, list(targets), run_closed)
            for rate in args.rates:
                def run_open(target: str, _r: int, stream: bool = stream, bodies=bodies,
                             mode: str = mode, rate: float = rate) -> None:
                    run, rec = run_one(open_loop, target, stream, bodies, rate, args.duration)
                    results["open"].setdefault(f"{mode}@{rate:g}", {}).setdefault(
                        target, []).append(rec)
                    print(f"  open {rate:g}/s {mode:10} {target:8} p50 {1000 * run.pct(0.5):.2f}"
                          f" ms  p99 {1000 * run.pct(0.99):.2f} ms  errors {run.errors}",
                          file=sys.stderr, flush=True)

                interleave(args.reps, list(targets), run_open)
        if "peer_url" in f:
            try:
                results["shared_lag"] = shared_lag(f["peer_url"])
            except OSError as exc:  # the figures measured so far still count
                print(f"  shared state lag: the peer did not answer ({exc})", file=sys.stderr)
    return results


def shared_lag(url: str) -> dict:
    """The lag histogram of a gateway sharing routing state: its count and quantiles (each
    the upper bound of the bucket it falls in), in milliseconds."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    buckets: list[tuple[float, float]] = []
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == "gateway_shared_state_lag_seconds_bucket":
                buckets.append((float(sample.labels["le"]), sample.value))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0.0
    out: dict = {"count": int(total)}
    for q in (0.5, 0.9, 0.99, 0.999):
        le = next((b for b, n in buckets if total and n >= q * total), None)
        out[f"p{q * 100:g}_ms"] = None if le is None else 1000 * le
    return out


def _run_sync(fn, urls: list[str], bodies: list[bytes], stream: bool, *rest) -> Run:
    """Run one measurement on a fresh event loop (round robin over `urls`)."""
    return asyncio.run(fn(urls, bodies, stream, *rest))


def summarise(res: dict) -> dict:
    out: dict = {"closed": {}, "open": {}}
    for mode, by in res["closed"].items():
        d, g = by["direct"], by["gateway"]
        out["closed"][mode] = {
            "direct_rps": median([x["rps"] for x in d]),
            "direct_rps_spread": span([x["rps"] for x in d]),
            "gateway_rps": median([x["rps"] for x in g]),
            "gateway_rps_spread": span([x["rps"] for x in g]),
            "gateway_cpu_ms_per_req": median([x["gateway_cpu_ms_per_req"] for x in g]),
            "gateway_cpu_ms_spread": span([x["gateway_cpu_ms_per_req"] for x in g]),
            "stub_cpu_ms_per_req_direct": median([x["cpu_ms_per_req"] for x in d]),
            "errors": sum(x["errors"] for x in d + g),
        }
    for key, by in res["open"].items():
        d, g = by["direct"], by["gateway"]
        row = {}
        for metric in ("p50_ms", "p99_ms", "ttft_p50_ms", "ttft_p99_ms"):
            if d[0][metric] is None:
                continue
            dm, gm = median([x[metric] for x in d]), median([x[metric] for x in g])
            added = [gx[metric] - dx[metric] for dx, gx in zip(d, g, strict=False)]
            row[metric] = {"direct": dm, "gateway": gm, "added": median(added),
                           "added_spread": span(added)}
        row["gateway_cpu_ms_per_req"] = median([x["gateway_cpu_ms_per_req"] for x in g])
        row["errors"] = sum(x["errors"] for x in d + g)
        out["open"][key] = row
    return out


def print_table(s: dict, args: argparse.Namespace) -> None:
    if getattr(args, "admission", None):
        print(f"\ngateway under admission control, max_inflight_per_replica {args.admission}")
    print(f"\nclosed loop, c={args.concurrency}, {args.duration:g}s x {args.reps} reps "
          "(median, [min..max])")
    print(f"{'mode':11} {'direct req/s':>22} {'gateway req/s':>22} {'gw CPU-ms/req':>20}"
          f" {'req per gw CPU-s':>17}")
    for mode, r in s["closed"].items():
        print(f"{mode:11} {r['direct_rps']:8.0f} [{r['direct_rps_spread']:>11}] "
              f"{r['gateway_rps']:8.0f} [{r['gateway_rps_spread']:>11}] "
              f"{r['gateway_cpu_ms_per_req']:6.3f} [{r['gateway_cpu_ms_spread']:>11}] "
              f"{1000 / r['gateway_cpu_ms_per_req'] if r['gateway_cpu_ms_per_req'] else 0:17.0f}")
    print(f"\nopen loop, {args.duration:g}s x {args.reps} reps: latency ms (median over reps;"
          " added = gateway - direct, per interleaved pair)")
    print(f"{'mode@rate':18} {'metric':12} {'direct':>8} {'gateway':>8} {'added':>8} "
          f"{'added spread':>16} {'gw CPU-ms/req':>14}")
    for key, row in s["open"].items():
        for metric in ("p50_ms", "p99_ms", "ttft_p50_ms", "ttft_p99_ms"):
            if metric not in row:
                continue
            m = row[metric]
            print(f"{key:18} {metric:12} {m['direct']:8.2f} {m['gateway']:8.2f} "
                  f"{m['added']:+8.2f} {m['added_spread']:>16} "
                  f"{row['gateway_cpu_ms_per_req']:14.3f}")


AB_GATEWAYS = ("baseline", "current")


def _added(direct: list[dict], gw: list[dict], metric: str) -> list[float]:
    """Gateway minus direct, per interleaved repetition."""
    return [g[metric] - d[metric] for d, g in zip(direct, gw, strict=False)]


def summarise_ab(res: dict) -> list[dict]:
    """One row per (measurement, metric): the median over repetitions and the [min..max] of
    each gateway. Added latency is over direct, paired by repetition; streams count TTFT."""
    rows: list[dict] = []
    sections = [(f"closed {mode}", by) for mode, by in res["closed"].items()]
    sections += [(f"open {key}/s", by) for key, by in res["open"].items()]
    for name, by in sections:
        stream = by["direct"][0]["ttft_p50_ms"] is not None
        lat = "TTFT" if stream else "latency"
        metrics: list[tuple[str, Callable[[list[dict], list[dict]], list[float]]]] = [
            ("req/s", lambda d, g: [x["rps"] for x in g]),
            (f"added {lat} p50 ms", lambda d, g, m=("ttft_p50_ms" if stream else "p50_ms"):
                _added(d, g, m)),
            (f"added {lat} p99 ms", lambda d, g, m=("ttft_p99_ms" if stream else "p99_ms"):
                _added(d, g, m)),
            ("gw CPU-ms/req", lambda d, g: [x["gateway_cpu_ms_per_req"] for x in g]),
        ]
        errors = {gw: sum(x["errors"] for x in by[gw]) for gw in AB_GATEWAYS}
        for label, values in metrics:
            row: dict = {"measurement": name, "metric": label, "errors": errors}
            for gw in AB_GATEWAYS:
                xs = values(by["direct"], by[gw])
                row[gw] = {"median": median(xs), "spread": span(xs)}
            b, c = row["baseline"]["median"], row["current"]["median"]
            row["ratio"] = c / b if b and b > 0 and c is not None else None
            rows.append(row)
    return rows


def format_ab_table(rows: list[dict], args: argparse.Namespace) -> str:
    current = (f"current gateway (admission control, max_inflight_per_replica "
               f"{args.admission})" if getattr(args, "admission", None) else "current gateway")
    base = f"baseline ({args.baseline_root})"
    if getattr(args, "shared_state", False):
        base, current = ("baseline (Redis, routing state not shared)",
                         "current (Redis, routing state shared)")
    lines = [f"\n{base} vs {current}; closed loop c="
             f"{args.concurrency}, open loop at each rate; {args.duration:g}s x {args.reps} reps "
             "interleaved with direct (median [min..max]; added = gateway - direct per rep)",
             f"{'measurement':22} {'metric':20} {'baseline':>28} {'current':>28} "
             f"{'current/baseline':>17}"]
    last = None
    for row in rows:
        name = row["measurement"] if row["measurement"] != last else ""
        last = row["measurement"]
        cells = []
        for gw in AB_GATEWAYS:
            m = row[gw]["median"]
            fmt = "{:.0f}" if row["metric"] == "req/s" else "{:.3f}" \
                if row["metric"].startswith("gw CPU") else "{:+.2f}"
            cells.append(f"{cell(m, fmt):>9} [{row[gw]['spread']:>15}]")
        ratio = cell(row["ratio"], "{:.2f}")
        lines.append(f"{name:22} {row['metric']:20} {cells[0]:>28} {cells[1]:>28} {ratio:>17}")
    errors = {gw: sum(r["errors"][gw] for r in rows if r["metric"] == "req/s")
              for gw in AB_GATEWAYS}
    lines.append(f"errors: baseline {errors['baseline']}, current {errors['current']}")
    lag = getattr(args, "lag", None)
    if lag:
        shown = ", ".join(f"{k[:-3]} <= {v:g} ms" for k, v in lag.items()
                          if k != "count" and v is not None)
        lines.append(f"shared state lag (decision on the current gateway to applied on a "
                     f"peer), {lag['count']} inserts: {shown}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rates", type=float, nargs="+", default=[200.0, 500.0])
    ap.add_argument("--duration", type=float, default=4.0, help="seconds per measurement")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-internal-stream", action="store_true",
                    help="gateway config non_streaming_ttft: false (plain non-stream forward)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--baseline-root", type=Path, metavar="DIR",
                    help="also run a gateway from the checkout in DIR (its own code) and "
                         "compare it with this one, interleaved")
    ap.add_argument("--admission", type=int, metavar="N",
                    help="run this checkout's gateway under admission control, with "
                         "max_inflight_per_replica N (a baseline runs without)")
    ap.add_argument("--shared-state", action="store_true",
                    help="compare this checkout with and without shared routing state, both "
                         "with the same Redis (implies --baseline-root .)")
    args = ap.parse_args(argv)
    if args.shared_state:
        if args.baseline_root is not None:
            ap.error("--shared-state runs both gateways from this checkout: no --baseline-root")
        args.baseline_root = REPO
    if args.admission is not None and args.admission < 1:
        ap.error("--admission must be at least 1")
    if args.reps < 1 or args.duration <= 0:
        ap.error("--reps must be at least 1 and --duration positive")
    if args.baseline_root and not (args.baseline_root / "gateway" / "cli.py").is_file():
        ap.error(f"--baseline-root {args.baseline_root}: no gateway/cli.py there")
    pin_self(CLIENT_CORE)
    use_uvloop()
    res = measure(args)
    args.lag = res.get("shared_lag")
    if args.baseline_root:
        rows = summarise_ab(res)
        if args.json:
            print(json.dumps({"summary": rows, "raw": res}, indent=1, default=str))
        else:
            print(format_ab_table(rows, args))
        return 0
    s = summarise(res)
    if args.json:
        print(json.dumps({"summary": s, "raw": res}, indent=1, default=str))
    else:
        print_table(s, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
