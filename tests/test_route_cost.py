"""The routing cost benchmark: it drives every request through its whole life."""

from __future__ import annotations

import pytest

from gateway.config import RoutingSettings
from gateway.wiring import build_router
from loadtests.route_cost import main, measure, prompts
from routing.types import ReplicaView


@pytest.mark.parametrize("settings", [{}, {"pin_running": False}])
def test_every_request_routed_ends_and_leaves_nothing_held(settings) -> None:
    r = measure(settings, requests=400, rounds=2, concurrency=16)
    assert r["requests"] == 400 and len(r["rounds_us"]) == 2
    assert 0 < r["best_us"] <= r["median_us"]
    assert r["inflight_left"] == 0
    assert r["pinned_left"] == 0
    assert r["reserved_left"] == 0


def test_the_benchmarks_requests_reserve_room_for_their_output_at_the_defaults() -> None:
    """So that `reserved_left` above counts something given back, not nothing taken."""
    router = build_router(RoutingSettings())
    router.add_replica("r0")
    request = prompts(router, 1, tenants=1, system_blocks=20, own_blocks=5)[0]
    decision = router.route(request, [ReplicaView(name="r0")])
    assert decision.output_blocks > 0
    assert router.indexes["r0"].reserved == decision.output_blocks


def test_the_table_has_the_defaults_and_the_settings_given(capsys) -> None:
    assert main(["--requests", "200", "--rounds", "1", "--set", "pin_running=false"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and "µs" not in line]
    assert [row.split(" | ")[0] for row in rows] == ["| defaults", "| pin_running=false"]
