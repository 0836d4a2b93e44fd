"""Emptying the replicas' prefix caches between runs, so every policy starts cold."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

RESET_PATHS = {"vllm": "/reset_prefix_cache", "trtllm": "/sim/reset_prefix_cache"}
"""Per engine, where a replica's prefix cache is emptied: vLLM's endpoint; trtllm-serve has
none, and only the simulated one (its control endpoint) can be emptied."""


def _reset_once(url: str, timeout_s: float, engine: str = "vllm") -> bool:
    req = urllib.request.Request(url.rstrip("/") + RESET_PATHS[engine], data=b"",
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            body = r.read()
    except (urllib.error.URLError, OSError):
        return False
    # vLLM answers {"success": false} while requests still hold blocks; the simulated
    # replica answers 200 with an empty body.
    try:
        data = json.loads(body) if body.strip() else None
    except ValueError:
        data = None
    return not (isinstance(data, dict) and data.get("success") is not True)


def reset_prefix_caches(urls: Sequence[str], deadline_s: float = 20.0,
                        poll_s: float = 0.2, engine: str = "vllm") -> None:
    """POST /reset_prefix_cache to every replica until each reports success; RuntimeError
    naming the replica when the deadline passes first."""
    end = time.monotonic() + deadline_s
    for url in urls:
        while not _reset_once(url, timeout_s=10.0, engine=engine):
            if time.monotonic() > end:
                raise RuntimeError(f"{url}: /reset_prefix_cache did not succeed within "
                                   f"{deadline_s:.0f}s")
            time.sleep(poll_s)
