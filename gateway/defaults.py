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
                   batch: dict[str, Any] | None = None,
                   auth: dict[str, Any] | None = None) -> GatewayConfig:
    """Two pools: `realtime` (vLLM-like replicas) and `batch` (trtllm-serve-like replicas).

    Requests choose a class with the `x-traffic-class` header or OpenAI's `service_tier`
    (`flex` means batch); everything else is realtime. Under admission control: each replica
    takes 64 requests at once, the classes queue beyond that (realtime first), and realtime
    borrows the batch pool while that pool is less than half busy, never its reserved quarter.
    With `redis_url`, the Batch API runs its lines on the batch class (`batch`: keys of the
    configuration's batch section). `auth`: the configuration's auth section (client and
    admin keys, as digests).
    """
    extra: dict[str, Any] = {}
    if auth:
        extra["auth"] = auth
    if redis_url:
        extra["redis"] = {"url": redis_url}
    if batch:
        extra["batch"] = batch
    return parse_config({
        "server": {"host": "127.0.0.1", "port": port},
        "pools": [
            {"name": "realtime", "engine": realtime_engine, "models": [model],
             "max_inflight_per_replica": 64, "reserved_fraction": 0.25,
             "replicas": [{"name": f"realtime-{i}", "url": u}
                          for i, u in enumerate(realtime_urls)]},
            {"name": "batch", "engine": batch_engine, "models": [model],
             "max_inflight_per_replica": 64, "reserved_fraction": 0.25,
             "replicas": [{"name": f"batch-{i}", "url": u} for i, u in enumerate(batch_urls)]},
        ],
        "traffic_classes": [
            {"name": "realtime", "pool": "realtime", "priority": 10,
             "admission": {"max_queue": 256, "max_queue_wait_s": 30,
                           "borrow": [{"pool": "batch", "while_below": 0.5}]}},
            {"name": "batch", "pool": "batch", "priority": 0,
             "admission": {"max_queue": 4096, "max_queue_wait_s": 300}},
        ],
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
                    server: dict[str, Any] | None = None,
                    pool_settings: dict[str, Any] | None = None,
                    class_settings: dict[str, Any] | None = None,
                    redis: dict[str, Any] | None = None) -> dict[str, Any]:
    """A config (as a dict, to write as YAML) with one pool and one traffic class.

    Tests and benchmarks build their gateways with this, each overriding what it measures;
    `pool_settings` and `class_settings` are more keys of the pool and of the class (e.g.
    `max_inflight_per_replica`, `admission`).
    """
    pool_cfg: dict[str, Any] = {
        "name": pool, "engine": engine, "models": list(models),
        "replicas": [{"name": f"{replica_prefix}-{i}", "url": u}
                     for i, u in enumerate(replica_urls)],
    }
    if health:
        pool_cfg["health"] = health
    pool_cfg.update(pool_settings or {})
    cfg: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port, **(server or {})},
        "pools": [pool_cfg],
        "traffic_classes": [{"name": "default", "pool": pool, **(class_settings or {})}],
        "classification": {"default_class": "default"},
    }
    if routing:
        cfg["routing"] = routing
    if redis:
        cfg["redis"] = redis
    return cfg

