"""Benchmarks, run from the repository root as `python -m loadtests.NAME --help`.

Benchmarks: simulate (offline, no HTTP), scoreboard (every simulated scenario), replay (a trace
over HTTP), compare_http (routers over HTTP in one run), overhead (the gateway's own cost),
vllm_bench (real vLLM CPU replicas), locustfile (locust scenarios). Shared pieces: traces,
fleet (processes), metrics, stats, report, caches, sse, settings. One-off investigations live
in loadtests.experiments.
"""
