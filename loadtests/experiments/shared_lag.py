"""Shared routing state's lag and background CPU, for several flush intervals.

Two gateways' states share one throwaway redis-server, in this process (no HTTP, no
replicas): gateway A routes RATE decisions per second for DURATION seconds, B applies them,
and B's `gateway_shared_state_lag_seconds` gives the lag from A's decision to B's index. Then
one gateway alone, with no traffic, for DURATION seconds: the CPU its sharing task costs per
second (getrusage of this process, so run it on a machine that is otherwise quiet).

    python -m loadtests.experiments.shared_lag                  # 200/s, 6 s, 10/25/50 ms
    python -m loadtests.experiments.shared_lag --rate 500 --intervals 0.025
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import resource
import time

from backends.upstream.inprocess import InProcessUpstream
from gateway.config import parse_config
from gateway.defaults import one_pool_config
from gateway.state import GatewayState
from loadtests.fleet import Fleet
from loadtests.stats import bucket_bound
from routing.types import ReplicaView


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def state(redis_url: str, prefix: str, interval: float) -> GatewayState:
    cfg = one_pool_config([f"http://r{i}.test:8000" for i in range(4)], 8080,
                          redis={"url": redis_url, "key_prefix": prefix,
                                 "shared_routing": {"flush_interval_s": interval}})
    return GatewayState(parse_config(cfg), upstream=InProcessUpstream())


def quantile_ms(bounds: tuple[float, ...], row: list[float], q: float) -> float:
    """The upper bound of the bucket holding quantile `q`, in milliseconds (`row`: a count per
    bucket, then the sum, as the gateway's histograms keep them)."""
    return 1000 * (bucket_bound(bounds, list(itertools.accumulate(row[:-1])), q) or 0.0)


async def lag(redis_url: str, interval: float, rate: float, duration: float) -> str:
    a, b = (state(redis_url, f"lag-{interval}:", interval) for _ in range(2))
    for s in (a, b):
        assert s.shared is not None
        s.shared.start()
    router = a.pools[0].router
    views = [ReplicaView(name=n) for n in router.indexes]
    requests = [router.request_from_text(f"tenant {i} " * 200 + f"question {i}")
                for i in range(256)]
    await asyncio.sleep(0.5)
    t0 = time.perf_counter()
    for i in range(int(rate * duration)):
        router.route(requests[i % len(requests)], views)
        delay = t0 + (i + 1) / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
    await asyncio.sleep(0.5)
    family = b.metrics.shared_lag
    row = family.rows[(a.pools[0].name,)]
    n = sum(row[:-1])
    out = (f"{1000 * interval:8.0f} {rate:10.0f} {int(n):8d} {1000 * row[-1] / n:9.1f} "
           + " ".join(f"{quantile_ms(family.bounds, row, q):8g}" for q in (0.5, 0.9, 0.99)))
    for s in (a, b):
        assert s.shared is not None and s.redis is not None
        await s.shared.stop()
        await s.redis.aclose()
    return out


async def idle(redis_url: str, interval: float, duration: float) -> float:
    """CPU-ms per second of one gateway's sharing task with no traffic."""
    s = state(redis_url, f"idle-{interval}:", interval)
    assert s.shared is not None and s.redis is not None
    s.shared.start()
    await asyncio.sleep(0.5)
    c0 = cpu_s()
    await asyncio.sleep(duration)
    used = cpu_s() - c0
    await s.shared.stop()
    await s.redis.aclose()
    return 1000 * used / duration


async def main(args: argparse.Namespace) -> None:
    with Fleet() as fleet:
        url = fleet.start_redis()
        print(f"{'flush ms':>8} {'decided/s':>10} {'inserts':>8} {'mean ms':>9} "
              f"{'p50 <=':>8} {'p90 <=':>8} {'p99 <=':>8}  idle CPU-ms/s")
        for interval in args.intervals:
            row = await lag(url, interval, args.rate, args.duration)
            print(f"{row}  {await idle(url, interval, args.duration):8.1f}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=200.0, help="decisions per second on A")
    ap.add_argument("--duration", type=float, default=6.0, help="seconds per measurement")
    ap.add_argument("--intervals", type=float, nargs="+", default=[0.01, 0.025, 0.05],
                    help="flush_interval_s values to measure")
    asyncio.run(main(ap.parse_args()))
