"""Reading Prometheus text from the engines' and the gateway's /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.request
from collections.abc import Sequence

import aiohttp

# vLLM's names; the simulated replica (kind vllm) exposes the same.
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
SUCCESS = "vllm:request_success_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions_total"
ENGINE_TTFT = "vllm:time_to_first_token_seconds"
ENGINE_QUEUE = "vllm:request_queue_time_seconds"
GATEWAY_TTFT = "gateway_time_to_first_token_seconds"
GATEWAY_PREFIX_BLOCKS = "gateway_prefix_blocks_total"
"""The prompt blocks the gateway expected to hit, or miss, on the replica it chose (its
index's estimate at routing time), labelled `result`."""
TRTLLM_NAMES = {
    HITS: "trtllm_prompt_cache_hit_tokens_total",
    QUERIES: "trtllm_prompt_tokens_total",
    SUCCESS: "trtllm_request_success_total",
    RUNNING: "trtllm_num_requests_running",
    WAITING: "trtllm_num_requests_waiting",
    ENGINE_TTFT + "_sum": "trtllm_time_to_first_token_seconds_sum",
    ENGINE_TTFT + "_count": "trtllm_time_to_first_token_seconds_count",
}
"""vLLM's names -> trtllm-serve's, on the Prometheus page it mounts with return_perf_metrics
(`/prometheus/metrics`; its `/metrics` is JSON iteration stats, drained by each read, which
only the gateway should read). Its TTFT histogram records a request when it finishes."""
ENGINE_METRICS_PATHS = {"vllm": "/metrics", "trtllm": "/prometheus/metrics"}


def parse_sums(text: str, names: Sequence[str]) -> dict[str, float]:
    """Per named sample, the sum over all its series (labels ignored: one replica process may
    label several engines); 0.0 for a name that is absent."""
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        cut = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=len(line))
        name = line[:cut]
        if name in out:
            # A malformed value: skip the series rather than fail the run.
            with contextlib.suppress(ValueError):
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def engine_sums(text: str, names: Sequence[str], engine: str = "vllm") -> dict[str, float]:
    """`parse_sums` of an engine's metrics page for vLLM's `names`: on trtllm-serve's, each
    read under its own name (TRTLLM_NAMES) and returned under vLLM's."""
    if engine != "trtllm":
        return parse_sums(text, names)
    theirs = {n: TRTLLM_NAMES.get(n, n) for n in names}
    sums = parse_sums(text, list(theirs.values()))
    return {n: sums[t] for n, t in theirs.items()}


def labelled_values(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every series of the sample `name`: its labels and its value (label values with
    escaped quotes are not expected: the gateway's and engines' labels are names)."""
    out = []
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name):len(name) + 1] not in ("{", " "):
            continue
        labels: dict[str, str] = {}
        rest = line[len(name):]
        if rest.startswith("{"):
            inner, _, rest = rest[1:].partition("}")
            for part in inner.split('",'):
                key, sep, value = part.partition("=")
                if sep:
                    labels[key.strip()] = value.strip().strip('"')
        with contextlib.suppress(ValueError, IndexError):
            out.append((labels, float(rest.split()[0])))
    return out


async def scrape(session: aiohttp.ClientSession, url: str, names: Sequence[str],
                 timeout_s: float = 10.0, engine: str = "vllm") -> dict[str, float]:
    """The named sums of one base URL's metrics page; raises on a failed read. `engine`:
    "vllm" (its /metrics, the names as given), or "trtllm" (its /prometheus/metrics, each of
    vLLM's names read as TRTLLM_NAMES says, and returned under vLLM's)."""
    async with session.get(url.rstrip("/") + ENGINE_METRICS_PATHS[engine],
                           timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
        r.raise_for_status()
        return engine_sums(await r.text(), names, engine)


async def scrape_all(session: aiohttp.ClientSession, urls: Sequence[str], names: Sequence[str],
                     timeout_s: float = 5.0, engine: str = "vllm",
                     ) -> list[dict[str, float] | None]:
    """`scrape` of every URL at once; None for each one that could not be read."""
    async def one(url: str) -> dict[str, float] | None:
        try:
            return await scrape(session, url, names, timeout_s, engine)
        except (TimeoutError, aiohttp.ClientError):
            return None

    return list(await asyncio.gather(*(one(u) for u in urls)))


def scrape_sync(url: str, names: Sequence[str], timeout_s: float = 5.0,
                engine: str = "vllm") -> dict[str, float]:
    """`scrape` without an event loop (urllib)."""
    with urllib.request.urlopen(url.rstrip("/") + ENGINE_METRICS_PATHS[engine],
                                timeout=timeout_s) as r:
        return engine_sums(r.read().decode(), names, engine)


def wait_idle(urls: Sequence[str], deadline_s: float = 300.0, poll_s: float = 0.5,
              engine: str = "vllm") -> None:
    """Return once no replica runs or queues a request (the previous run's tail is done);
    RuntimeError when the deadline passes first."""
    end = time.monotonic() + deadline_s
    while True:
        busy = 0.0
        for u in urls:
            m = scrape_sync(u, (RUNNING, WAITING), engine=engine)
            busy += m[RUNNING] + m[WAITING]
        if busy == 0:
            return
        if time.monotonic() > end:
            raise RuntimeError(f"replicas still busy ({busy:.0f} requests) after {deadline_s}s")
        time.sleep(poll_s)
