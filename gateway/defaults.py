"""The embedded default deployment that `prefix-gateway up` runs with no configuration."""

from __future__ import annotations

from typing import Any

from gateway.config import GatewayConfig, parse_config

DEFAULT_MODEL = "tiny"
REALTIME_REPLICAS = 3
BATCH_REPLICAS = 2


def default_config(realtime_urls: list[str], batch_urls: list[str], *, port: int = 8080,
                   model: str = DEFAULT_MODEL, realtime_engine: str = "vllm",
                   batch_engine: str = "trtllm", redis_url: str | None = None,
                   batch: dict[str, Any] | None = None) -> GatewayConfig:
    """Two pools: `realtime` (vLLM-like replicas) and `batch` (trtllm-serve-like replicas).

    Requests choose a class with the `x-traffic-class` header or OpenAI's `service_tier`
    (`flex` means batch); everything else is realtime. With `redis_url`, the Batch API runs
    its lines on the batch class (`batch`: keys of the configuration's batch section).
    """
    extra: dict[str, Any] = {}
    if redis_url:
        extra["redis"] = {"url": redis_url}
    if batch:
        extra["batch"] = batch
    return parse_config({
        "server": {"host": "127.0.0.1", "port": port},
        "pools": [
            {"name": "realtime", "engine": realtime_engine, "models": [model],
             "replicas": [{"name": f"realtime-{i}", "url": u}
                          for i, u in enumerate(realtime_urls)]},
            {"name": "batch", "engine": batch_engine, "models": [model],
             "replicas": [{"name": f"batch-{i}", "url": u} for i, u in enumerate(batch_urls)]},
        ],
        "traffic_classes": [{"name": "realtime", "pool": "realtime"},
                            {"name": "batch", "pool": "batch"}],
        "classification": {"header": "x-traffic-class",
                           "service_tier": {"flex": "batch", "default": "realtime",
                                            "priority": "realtime", "auto": "realtime"},
                           "default_class": "realtime"},
        **extra,
    }, "<embedded default>")


def one_pool_config(replica_urls: list[str], port: int, *, pool: str = "default",
                    engine: str = "vllm", models: tuple[str, ...] = (DEFAULT_MODEL,),
                    replica_prefix: str = "replica", routing: dict[str, Any] | None = None,
                    health: dict[str, Any] | None = None,
                    server: dict[str, Any] | None = None) -> dict[str, Any]:
    """A config (as a dict, to write as YAML) with one pool and one traffic class.

    Tests and benchmarks build their gateways with this, each overriding what it measures.
    """
    pool_cfg: dict[str, Any] = {
        "name": pool, "engine": engine, "models": list(models),
        "replicas": [{"name": f"{replica_prefix}-{i}", "url": u}
                     for i, u in enumerate(replica_urls)],
    }
    if health:
        pool_cfg["health"] = health
    cfg: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port, **(server or {})},
        "pools": [pool_cfg],
        "traffic_classes": [{"name": "default", "pool": pool}],
        "classification": {"default_class": "default"},
    }
    if routing:
        cfg["routing"] = routing
    return cfg

