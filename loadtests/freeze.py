"""How fast a frozen replica leaves rotation: SIGSTOP one of two replicas under streaming load
and time, from the signal, until the gateway stops routing to it.

    python -m loadtests.freeze                    # 5 rounds, default ejection settings
    python -m loadtests.freeze --rounds 10 --json

Each round starts two simulated vLLM replicas (each its own process) and a gateway whose
health checks run only every 30 s, so what takes the frozen replica out is the request path
(the stall watch), not the prober. Eight clients keep streams running on both replicas; one
replica is SIGSTOPped, and the gateway's /admin/stats is polled every 20 ms. Printed per
round and summarised: seconds until the replica shows as out of rotation, and how many new
requests were routed to it after the freeze (each waits there until failed over).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from typing import Any

import aiohttp

from gateway import processes
from loadtests.fleet import Fleet, run_async

SLOW_PROBES = {"interval_s": 30, "timeout_s": 1, "failure_threshold": 1,
               "metrics_interval_s": 30}


async def _stream_forever(session: aiohttp.ClientSession, url: str, i: int,
                          stop: asyncio.Event, routed: list[tuple[float, str]]) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        body = {"model": "tiny", "prompt": f"client {i} turn {n} " * 20, "max_tokens": 300,
                "stream": True}
        try:
            async with session.post(url + "/v1/completions", json=body) as resp:
                routed.append((time.perf_counter(), resp.headers.get("x-gateway-replica", "")))
                async for _ in resp.content.iter_any():
                    if stop.is_set():
                        break
        except (TimeoutError, aiohttp.ClientError):
            await asyncio.sleep(0.05)


async def _replica_out(session: aiohttp.ClientSession, url: str, name: str) -> bool:
    async with session.get(url + "/admin/stats") as resp:
        stats = await resp.json()
    return any(r["name"] == name and not r["healthy"]
               for p in stats["pools"] for r in p["replicas"])


async def one_round(fleet: Fleet, stall_s: float) -> dict[str, Any]:
    ports = processes.free_ports(2)
    procs = []
    for i, port in enumerate(ports):
        procs.append(fleet.spawn([sys.executable, "-m", "backends.sim", "--port", str(port),
                                  "--kind", "vllm", "--model", "tiny", "--name", f"r{i}"],
                                 f"r{i}"))
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    processes.wait_healthy(urls, procs, deadline_s=60)
    config = {
        "server": {"host": "127.0.0.1", "port": processes.free_ports(1)[0]},
        "pools": [{"name": "rt", "engine": "vllm", "models": ["tiny"],
                   "replicas": [{"name": f"r{i}", "url": u} for i, u in enumerate(urls)],
                   "health": SLOW_PROBES, "ejection": {"stall_s": stall_s}}],
        "traffic_classes": [{"name": "rt", "pool": "rt"}],
        "classification": {"default_class": "rt"},
    }
    gw, gw_proc = fleet.start_gateway_config(config)
    stop = asyncio.Event()
    routed: list[tuple[float, str]] = []
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        clients = [asyncio.create_task(_stream_forever(session, gw, i, stop, routed))
                   for i in range(8)]
        try:
            while {name for _, name in routed} != {"r0", "r1"}:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # both replicas streaming
            frozen_at = time.perf_counter()
            os.kill(procs[0].pid, signal.SIGSTOP)
            deadline = frozen_at + 30
            while not await _replica_out(session, gw, "r0"):
                if time.perf_counter() > deadline:
                    raise RuntimeError("the frozen replica was still in rotation after 30 s")
                await asyncio.sleep(0.02)
            out_s = time.perf_counter() - frozen_at
            sent_there = sum(1 for t, name in routed if t > frozen_at and name == "r0")
        finally:
            os.kill(procs[0].pid, signal.SIGCONT)
            stop.set()
            for c in clients:
                c.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
    for proc in (gw_proc, *procs):
        fleet.stop_process(proc)
    return {"out_of_rotation_s": round(out_s, 3), "requests_routed_there_after": sent_there}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--stall-s", type=float, default=1.0,
                   help="the pool's ejection.stall_s (default 1, the default)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rounds = []
    with Fleet() as fleet:
        for i in range(args.rounds):
            r = run_async(one_round(fleet, args.stall_s))
            rounds.append(r)
            if not args.json:
                print(f"round {i + 1}: out of rotation after {r['out_of_rotation_s']:.2f} s, "
                      f"{r['requests_routed_there_after']} new request(s) routed there after "
                      "the freeze", flush=True)
    outs = [r["out_of_rotation_s"] for r in rounds]
    summary = {"stall_s": args.stall_s, "rounds": rounds,
               "out_of_rotation_s": {"median": statistics.median(outs), "max": max(outs)}}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"out of rotation: median {summary['out_of_rotation_s']['median']:.2f} s, "
              f"max {summary['out_of_rotation_s']['max']:.2f} s over {len(outs)} rounds "
              f"(ejection.stall_s {args.stall_s})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
