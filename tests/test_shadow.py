"""The shadow single gateway of a replay (loadtests/shadow.py): what it is told and learns."""

from __future__ import annotations

import pytest

from loadtests.replay import ReplayOptions, replay, summarize
from loadtests.shadow import replay_shadow
from loadtests.traces import prompt_text
from tests.test_replay import _scripted_gateways
from tests.test_traces import HAND_REPLICAS, HAND_TRACE

REPLICAS = ("r0", "r1")


def _config(policy: str = "prefix_affinity") -> dict:
    return {
        "pools": [{"name": "p", "engine": "vllm", "models": ["m"],
                   "replicas": [{"name": n, "url": f"http://127.0.0.1:{9000 + i}"}
                                for i, n in enumerate(REPLICAS)]}],
        "traffic_classes": [{"name": "default", "pool": "p"}],
        "classification": {"default_class": "default"},
        "routing": {"policy": policy},
    }


async def test_the_shadow_of_scripted_gateways_picks_each_prefix_holder() -> None:
    prompts = [prompt_text(r) for r in HAND_TRACE]
    seen: list[list[str]] = []
    urls, runners = await _scripted_gateways(
        2, dict(zip(prompts, HAND_REPLICAS, strict=True)), seen)
    shadow = replay_shadow(_config(), HAND_TRACE)
    try:
        data = await replay(",".join(urls), [], HAND_TRACE, ReplayOptions(max_output=4), shadow)
    finally:
        for r in runners:
            await r.cleanup()
    picks = shadow.shadow.picks
    # 1 (1,2,4) and 3 (1,2,3,6) go where their longest prefix is, r0, as do the gateways;
    # 2 (1,2,4,5) went to r1, but one gateway would have sent it to r0, which held 1,2,4;
    # 6 (7,9) to r1, which held 7 from 5.
    assert [picks[i] for i in (1, 2, 3, 6)] == ["r0", "r0", "r0", "r1"]
    res = summarize(data, HAND_TRACE, "scripted")
    assert res["shadow_warm_requests"] == 5
    assert 3 / 5 <= res["shadow_agreement"] <= 4 / 5
    # 2's replica held less of it than the shadow's pick: a miss by either figure.
    assert res["shadow_match_agreement"] <= 4 / 5
    # Each warm request's prefix was held by some replica when it came.
    assert res["shadow_held_requests"] == 5
    assert res["shadow_held_agreement"] == res["shadow_agreement"]


def test_a_request_served_by_a_replica_the_shadow_does_not_know_is_not_counted() -> None:
    shadow = replay_shadow(_config(), HAND_TRACE[:2])
    shadow.ask(0, 0.0)
    assert shadow.served(0, "elsewhere", "cold") is False
    shadow.ask(1, 0.1)
    assert shadow.served(1, "r1", "cold") is True
    shadow.first_token(1, 0.2)
    shadow.finished(1, True)
    figures = shadow.figures(HAND_TRACE[:2], [None, "r1"])
    assert figures["shadow_warm_requests"] == 0  # the first was never answered: 1 is cold
    assert shadow.router.load.inflight.get("r1", 0) == 0


def test_sync_copies_what_a_gateway_learned_from_the_engines() -> None:
    shadow = replay_shadow(_config(), HAND_TRACE)
    seen_views = []
    choose = shadow.router.policy.choose

    def recording(request, views, lookup):
        seen_views.append({v.name: (v.engine_waiting, v.kv_usage) for v in views})
        return choose(request, views, lookup)

    shadow.router.policy.choose = recording  # type: ignore[method-assign]
    shadow.sync({"pools": [{"name": "p", "chars_per_token": 3.5, "replicas": [
        {"name": "r0", "index_capacity_blocks": 123, "engine_waiting": 2,
         "engine_kv_usage": 0.95},
        {"name": "r1", "index_capacity_blocks": 456, "engine_waiting": None,
         "engine_kv_usage": None},
        {"name": "unknown", "index_capacity_blocks": 7}]}]})
    assert shadow.router.chars_per_token == pytest.approx(3.5)
    assert shadow.router.indexes["r0"].capacity_blocks == 123
    assert shadow.router.indexes["r1"].capacity_blocks == 456
    assert "unknown" not in shadow.router.indexes
    shadow.ask(0, 0.0)
    assert seen_views[-1]["r0"] == (2, 0.95)
    assert seen_views[-1]["r1"] == (0, None)


def test_replay_shadow_names_a_pool_of_the_configuration() -> None:
    with pytest.raises(ValueError, match="no pool"):
        replay_shadow(_config(), HAND_TRACE, pool="absent")
    assert sorted(replay_shadow(_config(), HAND_TRACE, pool="p").router.indexes) == ["r0", "r1"]


@pytest.mark.parametrize(("args", "message"), [
    (["--url", "http://127.0.0.1:9", "--shadow"], "needs the routers' configuration file"),
    (["--shadow", "gateway.yaml"], "--shadow CONFIG is for --url"),
])
def test_replay_says_which_shadow_it_needs(args: list[str], message: str) -> None:
    from loadtests.replay import main

    with pytest.raises(SystemExit, match=message):
        main(["--workload", "tenants", "--limit", "2", *args])
