"""A stand-in for a gateway's admin API on loopback: fixed JSON answers behind an admin key,
for the experiments CLI and page without a live gateway behind them."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from gateway.experiments import ExperimentRecord, Sample

STATIC = Path(__file__).resolve().parent.parent / "gateway" / "static"


@contextmanager
def admin_stub(routes: dict[str, Any], admin_key: str | None = None) -> Iterator[str]:
    """Serve `routes` (path -> JSON body, or str for an HTML page) until the block ends;
    /admin/... wants `admin_key` as a Bearer token when one is given. Yields the base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path not in routes:
                return self._send(404, {"error": {"message": "not found"}})
            body = routes[path]
            if isinstance(body, str):
                return self._send(200, body, "text/html; charset=utf-8")
            if admin_key and self.headers.get("Authorization") != f"Bearer {admin_key}":
                return self._send(401, {"error": {"message": "an admin key is required",
                                                  "type": "authentication_error"}})
            self._send(200, body)

        def _send(self, status: int, body: Any, kind: str = "application/json") -> None:
            data = (body if isinstance(body, str) else json.dumps(body)).encode()
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def experiments_body(seed: int = 0, pairs: int = 120) -> dict[str, Any]:
    """GET /admin/experiments's body for two experiments: a mirror whose candidate is about
    1.5x slower to the first token (with a few failures), and a small split."""
    rng = random.Random(seed)
    mirror = ExperimentRecord("llama-vs-qwen", "mirror", "chat", "h200-8b", "h200-32b", 1.0)
    t0 = 1_764_583_200.0
    for i in range(pairs):
        ttft, out = rng.uniform(0.05, 0.4), rng.randint(20, 200)
        tpot = rng.uniform(0.01, 0.02)
        prompt = rng.randint(200, 4000)
        mirror.add("baseline", Sample(t0 + i * 0.4, ttft, tpot, ttft + out * tpot, prompt, out,
                                      inflight=rng.randint(0, 6)), pair=i)
        if i % 40 == 39:
            mirror.add("candidate", Sample(t0 + i * 0.4, None, None, 30.0, prompt, None,
                                           error="timeout"), pair=i)
            continue
        mirror.add("candidate", Sample(t0 + i * 0.4, ttft * 1.5, tpot * 1.2,
                                       ttft * 1.5 + out * tpot * 1.2, prompt, out,
                                       inflight=rng.randint(0, 6)), pair=i)
    mirror.count("sent", pairs)
    mirror.count("failed", pairs // 40)
    split = ExperimentRecord("trtllm-split", "split", "batch", "vllm", "trtllm", 0.25)
    for i in range(12):
        arm = "candidate" if i % 4 == 0 else "baseline"
        split.add(arm, Sample(t0 + i, 0.2 + i / 100, 0.015, 1.0, 1000 + i, 50))
    split.enabled = False
    engines = {"baseline": {"prefix_cache_hit_ratio": 0.4125, "kv_usage": 0.4,
                            "queue_length": 1.0},
               "candidate": {"prefix_cache_hit_ratio": 0.55, "kv_usage": None,
                             "queue_length": None}}
    unstarted = split.report(now=t0 + 20)
    unstarted["conditions"]["since"] = None  # as loadtests.ab's simulated clock has it
    return {"experiments": [mirror.report(engines, now=t0 + pairs * 0.4 + 5), unstarted]}
