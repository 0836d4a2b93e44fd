"""Fleet specs: mixed-speed simulated fleets from the command line, and slowed profiles."""

from __future__ import annotations

import pytest

from backends.sim.fleet_spec import (
    ReplicaProfile,
    apply_slow,
    describe,
    fleet_profiles,
    parse_fleet,
)
from backends.sim.profiles import PROFILES, fastest


def test_fleet_spec_lists_each_replica_in_order() -> None:
    fleet = parse_fleet("llama-8b-h200:2, qwen-32b-h200/3,qwen-32b-h200:1")
    assert [(r.profile, r.slowdown) for r in fleet] == [
        ("llama-8b-h200", 1.0), ("llama-8b-h200", 1.0), ("qwen-32b-h200", 3.0),
        ("qwen-32b-h200", 1.0)]
    assert describe(fleet) == "2 x llama-8b-h200 + 1 x qwen-32b-h200/3 + 1 x qwen-32b-h200"


def test_slow_makes_the_last_replicas_slower() -> None:
    fleet = fleet_profiles(4, "qwen-32b-h200", slow="1:3")
    assert [r.slowdown for r in fleet] == [1.0, 1.0, 1.0, 3.0]
    assert [r.slowdown for r in apply_slow(fleet, "2:2")] == [1.0, 1.0, 2.0, 6.0]
    assert len(fleet_profiles(None, "qwen-32b-h200")) == 8
    assert len(fleet_profiles(None, "qwen-32b-h200", "llama-8b-h200:3")) == 3


@pytest.mark.parametrize(("fleet", "slow", "replicas", "error"), [
    ("nope:2", None, None, "unknown profile 'nope'"),
    ("llama-8b-h200:0", None, None, "whole number >= 1"),
    ("llama-8b-h200:two", None, None, "count 'two'"),
    ("llama-8b-h200/0:1", None, None, "slowdown must be positive"),
    ("llama-8b-h200,,qwen-32b-h200", None, None, "empty entry"),
    ("llama-8b-h200:4", None, 8, "disagrees"),
    (None, "3", None, "expected N:F"),
    (None, "9:3", None, "from 1 to 8"),
    (None, "1:-2", None, "must be positive"),
])
def test_bad_fleet_specs_are_clear_errors(fleet: str | None, slow: str | None,
                                          replicas: int | None, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        fleet_profiles(replicas, "qwen-32b-h200", fleet, slow)


def test_a_slowed_profile_takes_factor_times_longer_at_everything() -> None:
    base = PROFILES["qwen-32b-h200"]
    slow = ReplicaProfile("qwen-32b-h200", 3.0).build()
    assert slow.name == "qwen-32b-h200/3"
    assert slow.ttft_s(20_000, 4096) == pytest.approx(3 * base.ttft_s(20_000, 4096))
    assert slow.decode_s(8) == pytest.approx(3 * base.decode_s(8))
    assert base.slowed(1.0) is base


def test_fastest_profile_is_no_slower_than_any() -> None:
    llama, qwen = PROFILES["llama-8b-h200"], PROFILES["qwen-32b-h200"]
    both = fastest([qwen, llama.slowed(2.0)])
    for p in (qwen, llama.slowed(2.0)):
        assert both.ttft_s(9000, 1000) <= p.ttft_s(9000, 1000)
        assert both.decode_s(4) <= p.decode_s(4)
