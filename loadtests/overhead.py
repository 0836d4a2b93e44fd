"""The gateway's own added latency and CPU cost: direct-to-stub vs through-the-gateway.

Stub replicas answer instantly, so what the gateway adds is all that is measured. Each
measurement alternates direct and gateway runs (interleaved repetitions); the gateway and
the stubs share one CPU core, the load generator has another.

Each gateway runs at its checkout's own server defaults; --internal-stream turns
`non_streaming_ttft` on in this checkout's gateway (non-streaming requests streamed from the
stubs and reassembled instead of passed through), --no-internal-stream off, and
--upstream-client picks its client to the stubs; a baseline keeps its own defaults.

With --baseline-root DIR, a second gateway runs from the checkout in DIR (its own code) beside
this one, and every repetition runs direct, baseline and current in a rotating order; the
table then puts baseline and current side by side with their ratio.

With --shared-state, both gateways run from this checkout with the same Redis: the baseline
with `redis.shared_routing.enabled: false`, the current one sharing its routing state (what
sharing adds to the gateway's latency and CPU).

With --admission N, this checkout's gateway runs under admission control (the pool's
max_inflight_per_replica N, the class's admission defaults); a baseline never does, so
`--baseline-root . --admission N` measures what admission control costs.

With --sglang, the SGLang router (policy cache_aware, from its own virtualenv: see
loadtests/baselines/sglang_router.py) runs on the server core too, in front of the same stubs,
and every repetition runs direct, gateway and sglang in a rotating order: the table shows each
router's CPU per request, the stubs' CPU per request behind it and without any router, and the
latency each adds.

    python -m loadtests.overhead        # the full run: about 3 minutes of measurement
    python -m loadtests.overhead --duration 1 --reps 1 --rates 200   # a quick check
    python -m loadtests.overhead --baseline-root ../old   # A/B against another checkout
    python -m loadtests.overhead --baseline-root . --admission 64   # admission's own cost
    python -m loadtests.overhead --sglang   # against the SGLang router, in the same run
    python -m loadtests.overhead --baseline-root . --upstream-client aiohttp   # the clients
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
from loadtests.stats import bucket_bound, median, nearest_rank

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
                  internal_stream: bool | None = None, root: Path = REPO,
                  upstream_client: str | None = None,
                  policy: str = "prefix_affinity",
                  admission: int | None = None,
                  redis: dict | None = None) -> tuple[subprocess.Popen, str]:
    """A gateway on the server core in front of the stubs; `root` picks the checkout it runs
    from; `internal_stream` and `upstream_client`, its `non_streaming_ttft` and
    `upstream_client` (None: its checkout's default); `admission`, a max_inflight_per_replica
    that puts it under admission control; `redis`, its `redis` section."""
    pool = {"max_inflight_per_replica": admission} if admission else None
    server = {} if internal_stream is None else {"non_streaming_ttft": internal_stream}
    if upstream_client is not None:
        server["upstream_client"] = upstream_client
    url, proc = fleet.start_gateway(urls, name, deadline_s=30, core=SERVER_CORE, root=root,
                                    pool="main", replica_prefix="stub",
                                    routing={"policy": policy},
                                    server=server or None,
                                    pool_settings=pool, redis=redis)
    return proc, url


def request_bodies(n: int = 256, stream: bool = False, prompt_chars: int = 2000
                   ) -> list[bytes]:
    """Chat requests of `prompt_chars` characters of message content (at least the
    question's), sharing 16 system prompts, so prefix routing has work to do."""
    out = []
    for i in range(n):
        question = f"Question {i}: what is {i} + {i}?"
        head = f"You are assistant #{i % 16}. "
        fill = max(0, prompt_chars - len(question) - len(head))
        rule = "Follow the house style guide carefully. "
        system = head + (rule * (fill // len(rule) + 1))[:fill]
        body = {"model": "tiny", "max_tokens": 16, "stream": stream,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": question}]}
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
    cpu_by_pid: dict[int, float] = field(default_factory=dict)
    """CPU-seconds each measured process spent during the measurement (not the warm-up)."""

    @property
    def cpu(self) -> float:
        return sum(self.cpu_by_pid.values())

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

        cpu0 = {p: cpu_seconds(p) for p in pids}
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        run.wall = time.perf_counter() - t0
        run.cpu_by_pid = {p: cpu_seconds(p) - c for p, c in cpu0.items()}
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
        cpu0 = {p: cpu_seconds(p) for p in pids}
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
        run.cpu_by_pid = {p: cpu_seconds(p) - c for p, c in cpu0.items()}
        return run


@contextlib.contextmanager
def on_core(core: int) -> Iterator[None]:
    """This process (so every child it starts meanwhile) on one core, then back as it was: a
    multi-threaded child then starts, and sizes its thread pool, on that core alone."""
    try:
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {core})
    except (OSError, AttributeError):
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def start_sglang(f: Fleet, urls: list[str]):
    """The SGLang router (cache_aware, every other flag at its default) on the server core in
    front of the stubs, from its own virtualenv (deploy/sglang-router/install.sh): its handle,
    or None (and why, on stderr) when it is not installed or does not start."""
    from loadtests.baselines.sglang_router import free_port, start_sglang_router

    try:
        with on_core(SERVER_CORE):
            handle = start_sglang_router(urls, free_port(), "cache_aware",
                                         log_path=f.log_dir / "sglang-router.log",
                                         startup_timeout=120)
    except (RuntimeError, FileNotFoundError, OSError) as exc:
        print(f"SGLang router not measured: {exc}", file=sys.stderr, flush=True)
        return None
    return handle


@contextlib.contextmanager
def fleet(count: int, internal_stream: bool | None = None,
          baseline_root: Path | None = None, admission: int | None = None,
          sglang: bool = False, shared_state: bool = False,
          upstream_client: str | None = None) -> Iterator[dict]:
    """Stubs and a gateway in front of them (and one from `baseline_root`, and the SGLang
    router, when asked), all on the server core; stopped on exit. `shared_state`: both
    gateways use one Redis, only the current one shares its routing state through it."""
    with Fleet() as f:
        stub, urls = f.start_stubs(count, core=SERVER_CORE)
        redis_url = f.start_redis() if shared_state else None
        gw, gw_url = start_gateway(f, urls, internal_stream=internal_stream,
                                   upstream_client=upstream_client,
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
                f, urls, "baseline", root=baseline_root,
                redis={"url": redis_url, "key_prefix": "baseline:",
                       "shared_routing": {"enabled": False}} if redis_url else None)
            out.update(baseline=base, baseline_url=base_url)
        handle = start_sglang(f, urls) if sglang else None
        try:
            if handle is not None:
                out.update(sglang=handle, sglang_url=handle.url)
            yield out
        finally:
            if handle is not None:
                handle.stop()


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


def record(run: Run, gateway_cpu_s: float | None, stream: bool,
           stub_cpu_s: float | None = None) -> dict:
    """One measurement as the results keep it (milliseconds; TTFTs only for streams).
    `gateway_cpu_s` is the router's CPU time (None for direct), `stub_cpu_s` the stubs'."""
    per = 1000 / max(1, run.ok)
    return {"rps": run.rps, "ok": run.ok, "errors": run.errors,
            "cpu_ms_per_req": per * run.cpu,
            "gateway_cpu_ms_per_req": per * gateway_cpu_s
            if gateway_cpu_s is not None else 0.0,
            "stub_cpu_ms_per_req": per * stub_cpu_s if stub_cpu_s is not None else None,
            "p50_ms": 1000 * run.pct(0.5), "p99_ms": 1000 * run.pct(0.99),
            "ttft_p50_ms": 1000 * run.pct(0.5, True) if stream else None,
            "ttft_p99_ms": 1000 * run.pct(0.99, True) if stream else None}


def measure(args: argparse.Namespace) -> dict:
    """Every measurement of every target, interleaved; with a baseline the gateway targets
    are "baseline" and "current", else "gateway" (and "sglang" with --sglang)."""
    results: dict = {"closed": {}, "open": {}, "config": vars(args)}
    baseline_root = args.baseline_root.resolve() if args.baseline_root else None
    with fleet(args.replicas, args.internal_stream, baseline_root,
               args.admission, getattr(args, "sglang", False),
               getattr(args, "shared_state", False),
               getattr(args, "upstream_client", None)) as f:
        stub_pid = f["stub"].pid
        # name: (URLs round robin, PIDs whose CPU counts, the router's PID or None).
        # Direct: the load generator talks to the stubs itself, round robin over them.
        targets: dict[str, tuple[list[str], list[int], int | None]] = {
            "direct": ([u + "/v1/chat/completions" for u in f["urls"]], [stub_pid], None)}
        gateways = [("baseline", "baseline"), ("current", "gateway")] if baseline_root \
            else [("gateway", "gateway")]
        if "sglang" in f:
            gateways.append(("sglang", "sglang"))
        for name, key in gateways:
            pid = f[key].pid
            targets[name] = ([f[f"{key}_url"] + "/v1/chat/completions"], [pid, stub_pid], pid)

        def run_one(fn, target: str, stream: bool, bodies: list[bytes],
                    *rest) -> tuple[Run, dict]:
            urls, pids, gw_pid = targets[target]
            run = _run_sync(fn, urls, bodies, stream, *rest, pids)
            gcpu = run.cpu_by_pid[gw_pid] if gw_pid else None
            return run, record(run, gcpu, stream, run.cpu_by_pid[stub_pid])

        for stream in (False, True):
            bodies = request_bodies(stream=stream, prompt_chars=args.prompt_chars)
            mode = "stream" if stream else "non-stream"

            def run_closed(target: str, _r: int, stream: bool = stream, bodies=bodies,
                           mode: str = mode) -> None:
                run, rec = run_one(closed_loop, target, stream, bodies, args.concurrency,
                                   args.duration)
                results["closed"].setdefault(mode, {}).setdefault(target, []).append(rec)
                print(f"  closed c={args.concurrency} {mode:10} {target:8} {run.rps:8.0f} req/s"
                      f"  router {rec['gateway_cpu_ms_per_req']:.3f} stubs "
                      f"{rec['stub_cpu_ms_per_req']:.3f} CPU-ms/req  errors {run.errors}",
                      file=sys.stderr, flush=True)

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
    bounds, cumulative = [b for b, _ in buckets], [n for _, n in buckets]
    out: dict = {"count": int(cumulative[-1]) if cumulative else 0}
    for q in (0.5, 0.9, 0.99, 0.999):
        le = bucket_bound(bounds, cumulative, q)
        out[f"p{q * 100:g}_ms"] = None if le is None else 1000 * le
    return out


def _run_sync(fn, urls: list[str], bodies: list[bytes], stream: bool, *rest) -> Run:
    """Run one measurement on a fresh event loop (round robin over `urls`)."""
    return asyncio.run(fn(urls, bodies, stream, *rest))


def _routers(by: dict) -> list[str]:
    return [t for t in by if t != "direct"]


def summarise(res: dict) -> dict:
    """Per measurement and router (gateway, sglang): medians over repetitions with their
    [min..max]; added latency is router minus direct, paired by repetition."""
    out: dict = {"closed": {}, "open": {}}
    for mode, by in res["closed"].items():
        d = by["direct"]
        direct_stubs = [x["stub_cpu_ms_per_req"] for x in d]
        row: dict = {"direct_rps": median([x["rps"] for x in d]),
                     "direct_rps_spread": span([x["rps"] for x in d]),
                     "stub_cpu_ms_per_req_direct": median(direct_stubs),
                     "stub_cpu_ms_direct_spread": span(direct_stubs),
                     "errors": sum(x["errors"] for x in d), "routers": {}}
        for router in _routers(by):
            g = by[router]
            stubs = [x["stub_cpu_ms_per_req"] for x in g if x["stub_cpu_ms_per_req"] is not None]
            row["routers"][router] = {
                "rps": median([x["rps"] for x in g]), "rps_spread": span([x["rps"] for x in g]),
                "cpu_ms_per_req": median([x["gateway_cpu_ms_per_req"] for x in g]),
                "cpu_ms_spread": span([x["gateway_cpu_ms_per_req"] for x in g]),
                "stub_cpu_ms_per_req": median(stubs), "stub_cpu_ms_spread": span(stubs),
                "errors": sum(x["errors"] for x in g)}
            row["errors"] += row["routers"][router]["errors"]
        out["closed"][mode] = row
    for key, by in res["open"].items():
        d = by["direct"]
        row = {"errors": sum(x["errors"] for x in d), "routers": {}}
        for router in _routers(by):
            g = by[router]
            r: dict = {}
            for metric in ("p50_ms", "p99_ms", "ttft_p50_ms", "ttft_p99_ms"):
                if d[0][metric] is None:
                    continue
                added = _added(d, g, metric)
                r[metric] = {"direct": median([x[metric] for x in d]),
                             "router": median([x[metric] for x in g]),
                             "added": median(added), "added_spread": span(added)}
            r["cpu_ms_per_req"] = median([x["gateway_cpu_ms_per_req"] for x in g])
            r["cpu_ms_spread"] = span([x["gateway_cpu_ms_per_req"] for x in g])
            r["errors"] = sum(x["errors"] for x in g)
            row["errors"] += r["errors"]
            row["routers"][router] = r
        out["open"][key] = row
    return out


def format_table(s: dict, args: argparse.Namespace) -> str:
    """The summary as text: closed loop (CPU per request of each router and of the stubs
    behind it), then open loop (latency each router adds)."""
    lines = []
    if getattr(args, "admission", None):
        lines.append(f"\ngateway under admission control, max_inflight_per_replica "
                     f"{args.admission}")
    lines.append(f"\nclosed loop, c={args.concurrency}, {args.duration:g}s x {args.reps} reps, "
                 f"{args.prompt_chars}-character prompts (median [min..max])")
    lines.append(f"{'mode':11} {'target':8} {'req/s':>16} {'router CPU-ms/req':>24} "
                 f"{'stubs CPU-ms/req':>24} {'vs sglang':>10}")
    for mode, r in s["closed"].items():
        lines.append(f"{mode:11} {'direct':8} {r['direct_rps']:6.0f} "
                     f"[{r['direct_rps_spread']:>9}] {'-':>24} "
                     f"{r['stub_cpu_ms_per_req_direct']:6.3f} "
                     f"[{r['stub_cpu_ms_direct_spread']:>15}] {'':>10}")
        sgl = r["routers"].get("sglang")
        for router, g in r["routers"].items():
            ratio = cell(g["cpu_ms_per_req"] / sgl["cpu_ms_per_req"]
                         if sgl and sgl["cpu_ms_per_req"] and router != "sglang" else None,
                         "{:.2f}x")
            lines.append(f"{'':11} {router:8} {g['rps']:6.0f} [{g['rps_spread']:>9}] "
                         f"{g['cpu_ms_per_req']:6.3f} [{g['cpu_ms_spread']:>15}] "
                         f"{cell(g['stub_cpu_ms_per_req'], '{:6.3f}')} "
                         f"[{g['stub_cpu_ms_spread']:>15}] {ratio:>10}")
    lines.append(f"\nopen loop, {args.duration:g}s x {args.reps} reps: latency ms (median over "
                 "reps; added = router - direct, per interleaved repetition)")
    lines.append(f"{'mode@rate':16} {'metric':12} {'router':8} {'direct':>8} {'router':>8} "
                 f"{'added':>8} {'added spread':>16} {'CPU-ms/req':>11}")
    for key, row in s["open"].items():
        for router, g in row["routers"].items():
            for metric in ("p50_ms", "p99_ms", "ttft_p50_ms", "ttft_p99_ms"):
                if metric not in g:
                    continue
                m = g[metric]
                lines.append(f"{key:16} {metric:12} {router:8} {m['direct']:8.2f} "
                             f"{m['router']:8.2f} {m['added']:+8.2f} {m['added_spread']:>16} "
                             f"{g['cpu_ms_per_req']:11.3f}")
    lines.append(f"errors: {sum(r['errors'] for r in s['closed'].values())} closed loop, "
                 f"{sum(r['errors'] for r in s['open'].values())} open loop")
    return "\n".join(lines)


AB_GATEWAYS = ("baseline", "current")


def _added(direct: list[dict], gw: list[dict], metric: str) -> list[float]:
    """Gateway minus direct, per interleaved repetition."""
    return [g[metric] - d[metric] for d, g in zip(direct, gw, strict=False)]


def summarise_ab(res: dict) -> list[dict]:
    """One row per (measurement, metric): the median over repetitions and the [min..max] of
    each gateway (and of the SGLang router, when it ran). Added latency is over direct, paired
    by repetition; streams count TTFT."""
    rows: list[dict] = []
    sections = [(f"closed {mode}", by) for mode, by in res["closed"].items()]
    sections += [(f"open {key}/s", by) for key, by in res["open"].items()]
    for name, by in sections:
        stream = by["direct"][0]["ttft_p50_ms"] is not None
        lat = "TTFT" if stream else "latency"
        targets = [t for t in (*AB_GATEWAYS, "sglang") if t in by]
        metrics: list[tuple[str, Callable[[list[dict], list[dict]], list[float]]]] = [
            ("req/s", lambda d, g: [x["rps"] for x in g]),
            (f"added {lat} p50 ms", lambda d, g, m=("ttft_p50_ms" if stream else "p50_ms"):
                _added(d, g, m)),
            (f"added {lat} p99 ms", lambda d, g, m=("ttft_p99_ms" if stream else "p99_ms"):
                _added(d, g, m)),
            ("gw CPU-ms/req", lambda d, g: [x["gateway_cpu_ms_per_req"] for x in g]),
        ]
        if by["direct"][0].get("stub_cpu_ms_per_req") is not None:
            metrics.append(("stubs CPU-ms/req", lambda d, g: [x["stub_cpu_ms_per_req"]
                                                              for x in g]))
            metrics.append(("stubs direct CPU-ms", lambda d, g: [x["stub_cpu_ms_per_req"]
                                                                 for x in d]))
        errors = {gw: sum(x["errors"] for x in by[gw]) for gw in targets}
        for label, values in metrics:
            row: dict = {"measurement": name, "metric": label, "errors": errors}
            for gw in targets:
                xs = values(by["direct"], by[gw])
                row[gw] = {"median": median(xs), "spread": span(xs)}
            b, c = row["baseline"]["median"], row["current"]["median"]
            row["ratio"] = c / b if b and b > 0 and c is not None else None
            if "sglang" in row:
                g = row["sglang"]["median"]
                row["ratio_sglang"] = c / g if g and g > 0 and c is not None else None
            rows.append(row)
    return rows


def format_ab_table(rows: list[dict], args: argparse.Namespace) -> str:
    current = (f"current gateway (admission control, max_inflight_per_replica "
               f"{args.admission})" if getattr(args, "admission", None) else "current gateway")
    sglang = any("sglang" in row for row in rows)
    targets = [*AB_GATEWAYS, "sglang"] if sglang else list(AB_GATEWAYS)
    base = f"baseline ({args.baseline_root})"
    if getattr(args, "shared_state", False):
        base, current = ("baseline (Redis, routing state not shared)",
                         "current (Redis, routing state shared)")
    lines = [f"\n{base} vs {current}"
             f"{' vs the SGLang router' if sglang else ''}; closed loop c="
             f"{args.concurrency}, open loop at each rate; {args.duration:g}s x {args.reps} reps "
             "interleaved with direct (median [min..max]; added = gateway - direct per rep)",
             f"{'measurement':22} {'metric':20} "
             + " ".join(f"{t:>28}" for t in targets)
             + f" {'current/baseline':>17}" + (f" {'current/sglang':>15}" if sglang else "")]
    last = None
    for row in rows:
        name = row["measurement"] if row["measurement"] != last else ""
        last = row["measurement"]
        cells = []
        for gw in targets:
            m = row[gw]["median"]
            fmt = "{:.0f}" if row["metric"] == "req/s" else "{:.3f}" \
                if "CPU" in row["metric"] else "{:+.2f}"
            cells.append(f"{cell(m, fmt):>9} [{row[gw]['spread']:>15}]")
        line = (f"{name:22} {row['metric']:20} " + " ".join(f"{c:>28}" for c in cells)
                + f" {cell(row['ratio'], '{:.2f}'):>17}")
        if sglang:
            line += f" {cell(row.get('ratio_sglang'), '{:.2f}'):>15}"
        lines.append(line)
    errors = {gw: sum(r["errors"][gw] for r in rows if r["metric"] == "req/s")
              for gw in targets}
    lines.append("errors: " + ", ".join(f"{gw} {n}" for gw, n in errors.items()))
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
    ap.add_argument("--prompt-chars", type=int, default=2000,
                    help="characters of message content per request (default 2000)")
    ap.add_argument("--sglang", action="store_true",
                    help="also run the SGLang router (cache_aware; deploy/sglang-router/"
                         "install.sh installs it) in front of the same stubs, interleaved")
    ap.add_argument("--internal-stream", dest="internal_stream", action="store_true",
                    default=None, help="this checkout's gateway with non_streaming_ttft: true "
                    "(non-streaming requests streamed from the stubs and reassembled); a "
                    "baseline keeps its own default")
    ap.add_argument("--no-internal-stream", dest="internal_stream", action="store_false",
                    help="this checkout's gateway with non_streaming_ttft: false (its default: "
                         "plain non-stream forward)")
    ap.add_argument("--upstream-client", choices=["httptools", "aiohttp"],
                    help="this checkout's gateway with this server.upstream_client (a baseline "
                         "keeps its own default)")
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
        print(format_table(s, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
