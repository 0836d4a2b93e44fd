"""The routing cost benchmark: it drives every request through its whole life."""

from __future__ import annotations

import pytest

from loadtests.route_cost import main, measure


@pytest.mark.parametrize("settings", [{}, {"pin_running": False}])
def test_every_request_routed_ends_and_leaves_nothing_held(settings) -> None:
    r = measure(settings, requests=400, rounds=2, concurrency=16)
    assert r["requests"] == 400 and len(r["rounds_us"]) == 2
    assert 0 < r["best_us"] <= r["median_us"]
    assert r["inflight_left"] == 0
    assert r["pinned_left"] == 0
    assert r["reserved_left"] == 0


def test_the_table_has_the_defaults_and_the_settings_given(capsys) -> None:
    assert main(["--requests", "200", "--rounds", "1", "--set", "pin_running=false"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and "µs" not in line]
    assert [row.split(" | ")[0] for row in rows] == ["| defaults", "| pin_running=false"]
