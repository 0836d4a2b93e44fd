"""Evidence for the stack choice: one minimal pass-through proxy on four server/client stacks.

Each proxy and the gateway run in front of the same stub replicas, closed loop, interleaved.
With --gateways-only --baseline-root DIR it is an A/B of the gateway against another checkout
(e.g. a git worktree of an older commit):

    python -m loadtests.experiments.stack_choice
    python -m loadtests.experiments.stack_choice --gateways-only --baseline-root ../old
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import sys
from pathlib import Path

from gateway import processes
from loadtests.fleet import Fleet, pinned
from loadtests.overhead import (
    CLIENT_CORE,
    SERVER_CORE,
    closed_loop,
    cpu_seconds,
    pin_self,
    request_bodies,
    start_gateway,
)
from loadtests.report import span
from loadtests.stats import median

_SSE = [(b"content-type", b"text/event-stream")]
_JSON = [(b"content-type", b"application/json")]


class Proxy:
    """A raw ASGI pass-through: read the body, forward to the next replica, relay the reply."""

    def __init__(self, urls: list[str], client: str) -> None:
        self.urls = itertools.cycle([u + "/v1/chat/completions" for u in urls])
        self.kind = client
        self.client = None

    async def _start(self) -> None:
        if self.kind == "aiohttp":
            import aiohttp

            self.client = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        else:
            import httpx

            self.client = httpx.AsyncClient(
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                timeout=30)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (msg := await receive())["type"] != "lifespan.shutdown":
                await self._start()
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body, more = b"", True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        stream = b'"stream":true' in body
        url, headers = next(self.urls), {"content-type": "application/json"}
        if self.kind == "aiohttp":
            async with self.client.post(url, data=body, headers=headers) as resp:
                await self._relay(send, resp.status, stream, resp.content.iter_any(), resp.read)
        else:
            req = self.client.build_request("POST", url, content=body, headers=headers)
            resp = await self.client.send(req, stream=True)
            try:
                await self._relay(send, resp.status_code, stream, resp.aiter_raw(), resp.aread)
            finally:
                await resp.aclose()

    @staticmethod
    async def _relay(send, status: int, stream: bool, chunks, read) -> None:
        if stream:
            await send({"type": "http.response.start", "status": status, "headers": _SSE})
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        else:
            data = await read()
            await send({"type": "http.response.start", "status": status,
                        "headers": [*_JSON, (b"content-length", str(len(data)).encode())]})
            await send({"type": "http.response.body", "body": data})


def serve(port: int, urls: list[str], client: str, server: str) -> None:
    import uvicorn

    loop, http = ("uvloop", "httptools") if server == "uvloop" else ("asyncio", "h11")
    uvicorn.run(Proxy(urls, client), host="127.0.0.1", port=port, loop=loop, http=http,
                log_level="warning", access_log=False, lifespan="on")


VARIANTS = [("aiohttp", "uvloop"), ("httpx", "uvloop"), ("aiohttp", "asyncio"),
            ("httpx", "asyncio")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--gateways-only", action="store_true",
                    help="skip the four minimal proxies (for a gateway A/B with --baseline-root)")
    ap.add_argument("--baseline-root", type=Path,
                    help="also run the gateway from this checkout (e.g. a git worktree of an "
                    "older commit), interleaved with the current one")
    ap.add_argument("--serve", nargs=4, metavar=("PORT", "URLS", "CLIENT", "SERVER"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        port, urls, client, server = args.serve
        serve(int(port), urls.split(","), client, server)
        return 0
    pin_self(CLIENT_CORE)
    results: dict[str, dict[str, list[dict]]] = {}
    with Fleet() as fleet:
        _, urls = fleet.start_stubs(4, core=SERVER_CORE)
        targets: dict[str, tuple[str, int]] = {}
        for client, server in [] if args.gateways_only else VARIANTS:
            port = processes.free_ports(1)[0]
            p = fleet.spawn(pinned([sys.executable, "-m", __spec__.name, "--serve",
                                    str(port), ",".join(urls), client, server],
                                   SERVER_CORE), f"{client}-{server}")
            url = f"http://127.0.0.1:{port}"
            processes.wait_healthy([url], [p], deadline_s=20, path="/v1/chat/completions")
            targets[f"{server}+{client} proxy"] = (url, p.pid)
        gw, gw_url = start_gateway(fleet, urls)
        targets["prefix-gateway"] = (gw_url, gw.pid)
        if args.baseline_root:
            base, base_url = start_gateway(fleet, urls, "baseline",
                                           root=args.baseline_root.resolve())
            targets["prefix-gateway baseline"] = (base_url, base.pid)
        for stream in (False, True):
            bodies = request_bodies(stream=stream)
            mode = "stream" if stream else "non-stream"
            for r in range(args.reps):
                order = list(targets) if r % 2 == 0 else list(targets)[::-1]
                for name in order:
                    url, pid = targets[name]
                    c0 = cpu_seconds(pid)
                    run = asyncio.run(closed_loop([url + "/v1/chat/completions"], bodies,
                                                  stream, args.concurrency, args.duration,
                                                  []))
                    cpu = cpu_seconds(pid) - c0
                    results.setdefault(name, {}).setdefault(mode, []).append(
                        {"rps": run.rps, "cpu_ms_per_req": 1000 * cpu / max(1, run.ok),
                         "errors": run.errors})
                    print(f"  {mode:10} {name:26} {run.rps:7.0f} req/s "
                          f"{1000 * cpu / max(1, run.ok):.3f} CPU-ms/req "
                          f"errors {run.errors}", file=sys.stderr, flush=True)
    summary = {name: {mode: {"rps": median([x["rps"] for x in xs]),
                             "rps_spread": span([x["rps"] for x in xs]),
                             "cpu_ms_per_req": median([x["cpu_ms_per_req"] for x in xs]),
                             "cpu_ms_spread": span([x["cpu_ms_per_req"] for x in xs]),
                             "errors": sum(x["errors"] for x in xs)}
                      for mode, xs in by.items()} for name, by in results.items()}
    if args.json:
        print(json.dumps({"summary": summary, "raw": results}, indent=1))
        return 0
    print(f"\nclosed loop c={args.concurrency}, {args.duration:g}s x {args.reps} reps, "
          "median [min..max]")
    print(f"{'variant':26} {'non-stream req/s':>24} {'CPU-ms/req':>8} "
          f"{'stream req/s':>24} {'CPU-ms/req':>8}")
    for name, by in summary.items():
        ns, st = by["non-stream"], by["stream"]
        print(f"{name:26} {ns['rps']:7.0f} [{ns['rps_spread']:>15}] {ns['cpu_ms_per_req']:8.3f}"
              f" {st['rps']:7.0f} [{st['rps_spread']:>15}] {st['cpu_ms_per_req']:8.3f}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
