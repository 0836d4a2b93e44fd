"""Pools learn what they cannot configure well: the engine's characters per token."""

from __future__ import annotations

from backends.adapters import EngineSnapshot
from backends.pool import Pool
from gateway.config import parse_config
from gateway.defaults import one_pool_config
from gateway.wiring import build_pools


def make_pool(**routing) -> Pool:
    config = parse_config(one_pool_config(["http://127.0.0.1:1"], 8080, models=("m",),
                                          routing={"block_chars": 256, **routing}))
    [pool] = build_pools(config)
    replica = pool.replicas["replica-0"]
    replica.snapshot = EngineSnapshot(block_size=128, num_blocks=512)  # 65,536 tokens
    pool.apply_engine_capacity(replica)
    return pool


def test_index_is_resized_when_the_tokenizer_is_denser_than_assumed() -> None:
    pool = make_pool()
    assert pool.router.indexes["replica-0"].capacity_blocks == 65536 * 4 // 256
    for _ in range(7):
        pool.observe_prompt_tokens(2200, 1000)
    assert pool.router.chars_per_token == 4.0  # too few samples to act on
    for _ in range(3):
        pool.observe_prompt_tokens(2200, 1000)
    assert abs(pool.router.chars_per_token - 2.2) < 1e-9
    # 65,536 tokens of 2.2 characters hold 563 blocks of 256 characters, not 1,024.
    assert pool.router.indexes["replica-0"].capacity_blocks == int(65536 * 2.2 / 256)
    request = pool.router.request_from_text("x" * 2200)
    assert abs(request.prompt_tokens - 1000) < 1e-6


def test_small_drift_is_ignored_and_learning_can_be_off() -> None:
    pool = make_pool()
    for _ in range(50):
        pool.observe_prompt_tokens(3800, 1000)
    assert pool.router.chars_per_token == 4.0  # within 10%: not worth a resize
    fixed = make_pool(learn_chars_per_token=False)
    for _ in range(50):
        fixed.observe_prompt_tokens(1000, 1000)
    assert fixed.router.chars_per_token == 4.0
