"""What a full mirror costs the client: its TTFT with the mirror on and off, in one run.

    python -m loadtests.mirror_cost                       # 12 blocks of 60 requests
    python -m loadtests.mirror_cost --blocks 20 --concurrency 8 --json

Two pools of two simulated vLLM replicas each (the baseline on the 8B H200 profile, the
candidate on the 32B one, in real time unless --time-scale says otherwise) and one gateway
whose traffic class is mirrored to the candidate (fraction 1: every request is copied). The
clients stream chat requests (2,000-character prompts over 16 shared system prompts, 16
output tokens) in a closed loop, block after block; the mirror is switched on and off between
blocks through the admin API, in the order on, off, off, on, ... so that drift over the run
falls on both sides alike. Before an off block the copies still in flight are waited for.
Printed: the client's TTFT p50 and p90 (first content byte, at the client) with and without
the mirror, their difference, the copies sent and dropped, and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

import aiohttp

from loadtests.fleet import Fleet, run_async
from loadtests.overhead import Run, _session, one, request_bodies
from loadtests.stats import percentile

HEALTH = {"interval_s": 1.0, "timeout_s": 2, "failure_threshold": 2, "metrics_interval_s": 1.0}


def config(base: list[str], cand: list[str], port: int, max_concurrency: int) -> dict:
    def pool(name: str, urls: list[str]) -> dict[str, Any]:
        return {"name": name, "engine": "vllm", "models": ["tiny"], "health": HEALTH,
                "replicas": [{"name": f"{name}-{i}", "url": u} for i, u in enumerate(urls)]}

    return {
        "server": {"host": "127.0.0.1", "port": port},
        "pools": [pool("baseline", base), pool("candidate", cand)],
        "traffic_classes": [{"name": "chat", "pool": "baseline"},
                            {"name": "trial", "pool": "candidate"}],
        "classification": {"default_class": "chat"},
        "experiments": [{"name": "cost", "traffic_class": "chat", "baseline": "baseline",
                         "candidate": "candidate", "mode": "mirror", "fraction": 1.0,
                         "max_concurrency": max_concurrency}],
    }


async def metric_sum(session: aiohttp.ClientSession, url: str, prefix: str) -> float:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix))


async def copies_settled(session: aiohttp.ClientSession, url: str, deadline_s: float) -> None:
    """Wait until every copy sent has ended (its candidate sample is recorded)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        sent = await metric_sum(session, url, 'gateway_experiment_mirror_copies_total'
                                '{experiment="cost",result="sent"}')
        done = await metric_sum(session, url, 'gateway_experiment_requests_total'
                                '{arm="candidate"')
        if done >= sent:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("mirror copies did not end in time")


async def block(url: str, bodies: list[bytes], start: int, n: int, concurrency: int,
                run: Run) -> None:
    """`n` streamed requests, `concurrency` at a time, their TTFTs added to `run`."""
    queue = list(range(start, start + n))
    async with _session(concurrency) as session:
        async def worker() -> None:
            while queue:
                i = queue.pop(0)
                await one(session, url + "/v1/chat/completions", bodies[i % len(bodies)],
                          True, run)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    bodies = request_bodies(512, stream=True, prompt_chars=2000)
    runs = {"on": Run(), "off": Run()}
    order = [("on", "off", "off", "on")[i % 4] for i in range(args.blocks)]
    async with aiohttp.ClientSession() as admin:
        await block(url, bodies, 0, args.per_block, args.concurrency, Run())  # warm-up
        sent = 0
        for i, mode in enumerate(order):
            async with admin.post(f"{url}/admin/experiments/cost/"
                                  f"{'enable' if mode == 'on' else 'disable'}") as resp:
                resp.raise_for_status()
            if mode == "off":
                await copies_settled(admin, url, 60)
            await block(url, bodies, (i + 1) * args.per_block, args.per_block,
                        args.concurrency, runs[mode])
        await copies_settled(admin, url, 60)
        sent = await metric_sum(admin, url, 'gateway_experiment_mirror_copies_total'
                                '{experiment="cost",result="sent"}')
        dropped = await metric_sum(admin, url, 'gateway_experiment_mirror_copies_total'
                                   '{experiment="cost",result="dropped"}')
    out: dict[str, Any] = {"blocks": args.blocks, "per_block": args.per_block,
                           "concurrency": args.concurrency, "time_scale": args.time_scale,
                           "copies_sent": sent, "copies_dropped": dropped}
    for mode, run in runs.items():
        out[mode] = {"requests": run.ok, "errors": run.errors,
                     "ttft_p50_ms": 1000 * (percentile(run.ttfts, 0.5) or 0.0),
                     "ttft_p90_ms": 1000 * (percentile(run.ttfts, 0.9) or 0.0)}
    p50_on, p50_off = out["on"]["ttft_p50_ms"], out["off"]["ttft_p50_ms"]
    out["ttft_p50_diff_ms"] = p50_on - p50_off
    out["ttft_p50_diff_pct"] = 100 * (p50_on - p50_off) / p50_off if p50_off else None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=12, help="measured blocks (half on)")
    parser.add_argument("--per-block", type=int, default=60, help="requests per block")
    parser.add_argument("--concurrency", type=int, default=8, help="clients at once")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="the simulated engines' time scale (1: real time)")
    parser.add_argument("--max-concurrency", type=int, default=256,
                        help="the experiment's mirror copies in flight at most")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    from gateway import processes

    with Fleet() as fleet:
        base = fleet.start_sims(2, 262_144, "llama-8b-h200", args.time_scale, name="base")
        cand = fleet.start_sims(2, 262_144, "qwen-32b-h200", args.time_scale, name="cand")
        url, _ = fleet.start_gateway_config(
            config(base, cand, processes.free_ports(1)[0], args.max_concurrency))
        out = run_async(measure(url, args))
    out["load_average"] = {"before": [round(x, 2) for x in load_before],
                           "after": [round(x, 2) for x in os.getloadavg()]}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"mirror cost: {args.blocks} blocks of {args.per_block} streamed requests, "
          f"{args.concurrency} clients, time scale {args.time_scale}")
    print(f"{'':12}{'requests':>10}{'errors':>8}{'TTFT p50':>12}{'TTFT p90':>12}")
    for mode in ("off", "on"):
        r = out[mode]
        print(f"{'mirror ' + mode:12}{r['requests']:>10}{r['errors']:>8}"
              f"{r['ttft_p50_ms']:>10.2f}ms{r['ttft_p90_ms']:>10.2f}ms")
    pct = out["ttft_p50_diff_pct"]
    print(f"TTFT p50 with the mirror minus without: {out['ttft_p50_diff_ms']:+.2f} ms "
          f"({pct:+.1f}%)" if pct is not None else "TTFT p50 difference: n/a")
    print(f"copies sent {out['copies_sent']:.0f}, dropped {out['copies_dropped']:.0f}")
    la = out["load_average"]
    print(f"load average before {la['before']}, after {la['after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
