"""What sharing the prefixes they route costs the workers of one gateway without Redis: the
CPU of `WorkerLoad` ticks that write and read them, timed in one process on real files.

Two workers share a directory (a memory filesystem where there is one, as `serve` does). At
each tick of 25 ms, worker A records `rate * 0.025` prefixes of `--blocks` blocks (spread
over the replicas; half extend one of 50 earlier prefixes) and ticks, writing them; then B
ticks, reading and applying them. No request is in flight, so no load is written: what is
timed is the prefixes' part. Printed per tick and per decision: A's CPU, B's, and the bytes
A appended per decision.

    python -m loadtests.worker_share_cost [--rate 100] [--blocks 16 64 256] [--ticks 2000]
"""

from __future__ import annotations

import argparse
import itertools
import random
import tempfile
import time

from gateway.config import GatewayConfig
from gateway.defaults import one_pool_config
from gateway.state import GatewayState
from gateway.supervisor import shared_dir
from gateway.workerload import INTERVAL_S, WorkerLoad
from gateway.workerprefixes import WorkerPrefixes


def _state(replicas: int) -> GatewayState:
    return GatewayState(GatewayConfig.model_validate(one_pool_config(
        [f"http://127.0.0.1:{9000 + i}" for i in range(replicas)], 8080)))


def measure(rate: float, blocks: int, ticks: int, replicas: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(dir=shared_dir()) as directory:
        a, b = _state(replicas), _state(replicas)
        writer = WorkerPrefixes(directory, a.pools, a.observer, pid=1)
        la = WorkerLoad(directory, a, pid=1, prefixes=writer)
        lb = WorkerLoad(directory, b, pid=2,
                        prefixes=WorkerPrefixes(directory, b.pools, b.observer, pid=2))
        router = a.pools[0].router
        names = sorted(router.indexes)
        rng = random.Random(1)
        counter = itertools.count()
        per_tick = rate * INTERVAL_S
        carry = 0.0
        cpu_a = cpu_b = 0
        decisions = 0
        now = time.time()
        for i in range(ticks):
            carry += per_tick
            while carry >= 1.0:
                carry -= 1.0
                replica = rng.choice(names)
                # Half the prompts extend an earlier prefix, as conversations do.
                head = rng.randrange(1 << 40) if rng.random() < 0.5 else next(counter) % 50
                hashes = [hash((head, j)) & ((1 << 63) - 1) for j in range(blocks)]
                router.record(replica, hashes, 256.0 * blocks)
                decisions += 1
            at = now + i * INTERVAL_S
            t0 = time.process_time_ns()
            la.tick(at)
            t1 = time.process_time_ns()
            lb.tick(at)
            t2 = time.process_time_ns()
            cpu_a += t1 - t0
            cpu_b += t2 - t1
        written = writer.written_bytes
        applied = b.metrics.shared_inserts.values.get(("default", "applied"), 0.0)
        la.remove()
        lb.remove()
    return {"ticks": ticks, "decisions": decisions, "applied": applied,
            "writer_us_per_tick": cpu_a / ticks / 1e3, "reader_us_per_tick": cpu_b / ticks / 1e3,
            "writer_us_per_decision": cpu_a / max(decisions, 1) / 1e3,
            "reader_us_per_decision": cpu_b / max(decisions, 1) / 1e3,
            "bytes_per_decision": written / max(decisions, 1)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=100.0, help="decisions per second")
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 64, 256],
                   help="blocks per prompt (256 characters each by default)")
    p.add_argument("--ticks", type=int, default=2000)
    p.add_argument("--replicas", type=int, default=8)
    args = p.parse_args(argv)
    print(f"{args.rate:g} decisions/s, {args.replicas} replicas, {args.ticks} ticks of "
          f"{INTERVAL_S * 1e3:g} ms")
    print("| blocks | writer us/tick | reader us/tick | writer us/decision | "
          "reader us/decision | bytes/decision |")
    print("|---:|---:|---:|---:|---:|---:|")
    for blocks in args.blocks:
        r = measure(args.rate, blocks, args.ticks, args.replicas)
        print(f"| {blocks} | {r['writer_us_per_tick']:.1f} | {r['reader_us_per_tick']:.1f} | "
              f"{r['writer_us_per_decision']:.1f} | {r['reader_us_per_decision']:.1f} | "
              f"{r['bytes_per_decision']:.0f} |")


if __name__ == "__main__":
    main()
