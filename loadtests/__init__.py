"""Benchmarks: trace replay, the offline simulator, locust scenarios, hot-path figures."""
