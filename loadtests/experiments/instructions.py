"""Instructions per request of gateways from several checkouts, counted by callgrind.

Wall-clock CPU figures move with whatever else the machine runs; instruction counts do not.
Each gateway runs under `valgrind --tool=callgrind` (Debian's `valgrind` package), in front
of the same instant stubs as loadtests.overhead; counting is switched on only while N
requests (concurrency 16) go through it.

    python -m loadtests.experiments.instructions 2000 non-stream . ../baseline
    python -m loadtests.experiments.instructions 2000 non-stream . --admission 64

With --admission N every gateway counted runs under admission control
(max_inflight_per_replica N), so only checkouts that have it can be compared that way.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import subprocess
import time

from gateway import processes
from gateway.defaults import one_pool_config
from loadtests import overhead
from loadtests.fleet import Fleet, use_uvloop


async def drive(url: str, bodies: list[bytes], stream: bool, n: int) -> overhead.Run:
    run = overhead.Run()
    async with overhead._session(16) as session:
        todo = iter(range(n))

        async def worker() -> None:
            for i in todo:
                await overhead.one(session, url, bodies[i % len(bodies)], stream, run)

        await asyncio.gather(*(worker() for _ in range(16)))
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("requests", type=int)
    ap.add_argument("mode", choices=("stream", "non-stream"))
    ap.add_argument("roots", nargs="+", help="checkouts whose gateway to count")
    ap.add_argument("--admission", type=int, metavar="N",
                    help="admission control, max_inflight_per_replica N, in every gateway")
    args = ap.parse_args()
    stream = args.mode == "stream"
    use_uvloop()
    bodies = overhead.request_bodies(stream=stream)
    with Fleet() as fleet:
        _, urls = fleet.start_stubs(4)
        for k, root in enumerate(args.roots):
            cfg = one_pool_config(urls, processes.free_ports(1)[0], pool="main",
                                  replica_prefix="stub", routing={"policy": "prefix_affinity"},
                                  pool_settings={"max_inflight_per_replica": args.admission}
                                  if args.admission else None)
            out = f"{fleet.log_dir}/callgrind-{k}.out"
            url, proc, _ = processes.start_gateway(
                cfg, fleet.log_dir, f"g{k}", deadline_s=300, env={"PYTHONPATH": root},
                python_flags=("-P",),
                wrap=lambda c, out=out: ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                                         f"--callgrind-out-file={out}", *c])
            fleet.procs.append(proc)
            target = url + "/v1/chat/completions"
            asyncio.run(drive(target, bodies, stream, 300))  # warm-up, not counted
            subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True,
                           capture_output=True)
            run = asyncio.run(drive(target, bodies, stream, args.requests))
            subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], check=True,
                           capture_output=True)
            subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True,
                           capture_output=True)
            total = 0
            deadline = time.monotonic() + 30
            while not total and time.monotonic() < deadline:  # the dump is written async
                for name in glob.glob(out + "*"):
                    with open(name) as f:
                        for line in f:
                            if line.startswith(("summary:", "totals:")):
                                total = max(total, int(line.split()[1]))
                time.sleep(0.2)
            print(f"{root} {args.mode}: {run.ok} ok, {run.errors} errors, "
                  f"{total / max(1, run.ok):,.0f} instructions per request", flush=True)
            fleet.stop_process(proc)


if __name__ == "__main__":
    main()
