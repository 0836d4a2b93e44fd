"""What a read of an engine's metrics costs: the engine's API server, and the gateway's read
of the page (a scrape's scan for the samples it uses, and between scrapes the scan for the
count of first tokens alone), next to prometheus_client's parse of the whole page.

Starts one vLLM CPU replica (the local tiny model) unless given `--url` and `--pid` of a
running vLLM API server, reads its /metrics page `--reads` times in a row, and prints one
markdown table.

    python -m loadtests.count_read_cost
    python -m loadtests.count_read_cost --url http://127.0.0.1:8100 --pid 12345
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from backends.adapters.vllm import parse_vllm_first_tokens, parse_vllm_metrics
from loadtests.overhead import cpu_seconds
from loadtests.report import markdown_table


def per_call_ms(fn: Callable[[], object], n: int) -> float:
    """Mean wall milliseconds of `fn()` over `n` calls."""
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return 1000.0 * (time.perf_counter() - start) / n


def measure(url: str, pid: int | None, reads: int) -> list[list[str]]:
    with httpx.Client(timeout=10.0) as client:
        page = client.get(url + "/metrics").text
        cpu0 = cpu_seconds(pid) if pid else None
        latencies = []
        for _ in range(reads):
            start = time.perf_counter()
            client.get(url + "/metrics").raise_for_status()
            latencies.append(1000.0 * (time.perf_counter() - start))
        server_cpu = (1000.0 * (cpu_seconds(pid) - cpu0) / reads) if pid and cpu0 is not None \
            else None
    latencies.sort()
    full = per_call_ms(lambda: list(text_string_to_metric_families(page)), max(10, reads // 10))
    scrape = per_call_ms(lambda: parse_vllm_metrics(page), reads)
    scan = per_call_ms(lambda: parse_vllm_first_tokens(page), reads * 10)
    return [
        ["page", f"{len(page.encode()) / 1000:.1f} kB, {page.count(chr(10))} lines"],
        ["read latency p50 / p99 ms", f"{statistics.median(latencies):.2f} / "
                                      f"{latencies[int(0.99 * (len(latencies) - 1))]:.2f}"],
        ["API server CPU ms per read", "-" if server_cpu is None else f"{server_cpu:.2f}"],
        ["prometheus_client: the whole page parsed ms", f"{full:.3f}"],
        ["gateway: a scrape's scan ms", f"{scrape:.3f}"],
        ["gateway: first-token scan (between scrapes) ms", f"{scan:.4f}"],
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running vLLM API server (default: start one locally)")
    p.add_argument("--pid", type=int, help="its pid, to read its CPU time")
    p.add_argument("--reads", type=int, default=200)
    args = p.parse_args(argv)
    if args.reads < 1:
        raise SystemExit("count_read_cost: --reads must be at least 1")
    replicas = []
    url, pid = args.url, args.pid
    if url is None:
        from backends.vllm_cpu.launch import ensure_model, start_replicas
        replicas = start_replicas(1, ensure_model(), base_port=8190)
        url, pid = replicas[0].url, replicas[0].pid
    try:
        rows = measure(url.rstrip("/"), pid, args.reads)
    finally:
        for r in replicas:
            r.stop()
    print(f"\n{args.reads} reads of {url}/metrics in a row\n")
    print(markdown_table(["measure", "value"], rows), end="", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
