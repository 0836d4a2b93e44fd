"""The one place that turns the configuration into running objects and wires them together."""

from __future__ import annotations

from backends.pool import Ejection, HealthTiming, Pool, PoolSpec, ReplicaSpec
from gateway.config import EngineKind, GatewayConfig, PoolConfig, RoutingSettings
from routing import Router, build_policy


def build_router(routing: RoutingSettings, engine: EngineKind = "vllm") -> Router:
    """A pool's router, with its policy and settings (replicas are added by the pool)."""
    return Router(
        (),
        build_policy(routing.policy, routing.policy_settings()),
        block_chars=routing.block_chars,
        chars_per_token=routing.chars_per_token,
        index_capacity_blocks=routing.index_capacity_blocks,
        key_blocks=routing.key_blocks,
        prefill_tokens_per_s=routing.prefill_tokens_per_s,
        speed_decode_agrees=routing.speed_decode_agrees,
        pin_running=routing.pin_running,
        output_reserve=routing.output_reserve_for(engine),
        output_cached=routing.output_cached,
        decode_step_wait=routing.decode_step_wait,
        engine_speed=routing.engine_speed,
    )


def pool_spec(cfg: PoolConfig, routing: RoutingSettings) -> PoolSpec:
    return PoolSpec(
        name=cfg.name,
        engine=cfg.engine,
        models=tuple(cfg.models),
        replicas=tuple(ReplicaSpec(r.name, r.base_url,
                                   tuple(r.models) if r.models else None, r.api_key)
                       for r in cfg.replicas),
        health=HealthTiming(**cfg.health.model_dump()),
        api_key=cfg.api_key,
        hashing=routing.hashing,
        token_block_size=routing.token_block_size,
        learn_chars_per_token=routing.learn_chars_per_token,
        ejection=Ejection(**cfg.ejection.model_dump()),
    )


def build_pools(config: GatewayConfig) -> list[Pool]:
    pools = []
    for p in config.pools:
        routing = config.routing_for(p)
        pools.append(Pool(pool_spec(p, routing), build_router(routing, p.engine)))
    return pools
