"""The HTTP server protocol's own cost per request: uvicorn's httptools protocol against the
gateway's bounded one (gateway/httpserver.py), with no sockets, replicas or gateway work.

A typical OpenAI client request (9 headers, a 200-byte body) is fed to one kept-alive
connection of each protocol in turn, answered by a trivial ASGI app; the figure is the median
over interleaved rounds, in microseconds per request.

    python -m loadtests.server_protocol              # 7 rounds of 20,000 requests each
    python -m loadtests.server_protocol --rounds 3 --requests 5000
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.config import ServerConfig
from gateway.httpserver import ServerLimits, protocol_class
from loadtests.fleet import use_uvloop
from loadtests.stats import median

REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n"
           b"User-Agent: OpenAI/Python 1.0\r\nAccept: application/json\r\n"
           b"Content-Type: application/json\r\nAuthorization: Bearer sk-x\r\n"
           b"X-Stainless-Lang: python\r\nConnection: keep-alive\r\nContent-Length: 200\r\n\r\n"
           + b"x" * 200)


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})


class _Transport(asyncio.Transport):
    """Swallows what the protocol writes."""

    def __init__(self) -> None:
        super().__init__()
        self._closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        self._closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8080), "peername": ("127.0.0.1", 50000)}.get(
            name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def per_request_us(protocol: type[asyncio.Protocol], n: int) -> float:
    config = Config(_app, lifespan="off", log_level="error", access_log=False)
    config.load()
    conn = protocol(config=config, server_state=ServerState(), app_state={},
                    _loop=asyncio.get_running_loop())
    conn.connection_made(_Transport())
    start = time.perf_counter()
    for _ in range(n):
        conn.data_received(REQUEST)
        await asyncio.sleep(0)  # the request's ASGI task runs and answers
        await asyncio.sleep(0)
    return (time.perf_counter() - start) / n * 1e6


async def run(rounds: int, requests: int) -> None:
    s = ServerConfig()
    bounded = protocol_class(ServerLimits(
        s.max_header_bytes, s.max_headers, s.header_timeout_s, s.body_timeout_s,
        s.keepalive_timeout_s, s.max_connections))
    results: dict[str, list[float]] = {"uvicorn httptools": [], "gateway bounded": []}
    for _ in range(rounds):
        for name, cls in (("uvicorn httptools", HttpToolsProtocol),
                          ("gateway bounded", bounded)):
            results[name].append(await per_request_us(cls, requests))
    for name, values in results.items():
        print(f"{name:18s} {median(values):6.2f} us/request  (min {min(values):.2f}, "
              f"max {max(values):.2f}, {rounds} rounds of {requests})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--requests", type=int, default=20000)
    args = ap.parse_args()
    use_uvloop()
    asyncio.run(run(args.rounds, args.requests))


if __name__ == "__main__":
    main()
